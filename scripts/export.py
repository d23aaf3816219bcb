"""Snakemake glue for rule `export`: dflash_pipeline.stages.export."""

from dflash_pipeline.core.checksums import record_outputs, verify_inputs
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.export import export_drafter


def run(smk) -> None:
    with job_logging(smk.log[0]):
        verify_inputs(smk, [smk.input.manifest])
        # Declared only for drafters the speculators format can express (rules/train.smk).
        speculators = smk.output.get("speculators_config")
        export_drafter(
            smk.params.run_url,
            smk.input.manifest,
            smk.output.config,
            smk.output.weights,
            smk.params.dtype,
            target=smk.params.target,
            speculators_out=(speculators, smk.output.speculators_weights) if speculators else None,
        )
        # What evaluate and the serving engines load (core.checksums).
        record_outputs(
            smk,
            [
                smk.output.config,
                smk.output.weights,
                *([speculators, smk.output.speculators_weights] if speculators else []),
            ],
        )


run(snakemake)  # noqa: F821 (injected by Snakemake)
