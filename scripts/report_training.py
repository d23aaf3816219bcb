"""Snakemake glue for rule `report_training`: dflash_pipeline.stages.report.report_training."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.report import report_training


def run(smk) -> None:
    with job_logging(smk.log[0]):
        report_training(smk.params.run_url, smk.params.segments, smk.output.figure)


run(snakemake)  # noqa: F821 (injected by Snakemake)
