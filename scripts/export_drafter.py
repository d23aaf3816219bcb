"""Snakemake glue for rule `export_drafter`; the logic is dflash_pipeline.training.export."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.export import export_drafter


def run(smk) -> None:
    with job_logging(smk.log[0]):
        summary = export_drafter(
            smk.params.run_url,
            smk.input.manifest,
            smk.output.config,
            smk.output.weights,
            smk.params.dtype,
        )
        print(f"exported {summary['tensors']} tensors, {summary['parameters']:,} parameters")


run(snakemake)  # noqa: F821 (injected by Snakemake)
