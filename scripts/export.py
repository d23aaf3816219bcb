"""Snakemake glue for rule `export`: dflash_pipeline.stages.export."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.export import export_drafter


def run(smk) -> None:
    with job_logging(smk.log[0]):
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


run(snakemake)  # noqa: F821 (injected by Snakemake)
