"""Snakemake glue for rule `report_storage`: dflash_pipeline.stages.report.report_storage."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.report import report_storage


def run(smk) -> None:
    with job_logging(smk.log[0]):
        report_storage(smk.params.run_url, smk.output.figure)


run(snakemake)  # noqa: F821 (injected by Snakemake)
