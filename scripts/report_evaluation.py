"""Snakemake glue for rule `report_evaluation`; the logic is dflash_pipeline.report."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.report.figures import write_evaluation_report


def run(smk) -> None:
    with job_logging(smk.log[0]):
        write_evaluation_report(smk.input.metrics, smk.output.figure)


run(snakemake)  # noqa: F821 (injected by Snakemake)
