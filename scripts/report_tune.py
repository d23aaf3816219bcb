"""Snakemake glue for rule `report_tune`: dflash_pipeline.stages.report.report_tune."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.report import report_tune


def run(smk) -> None:
    with job_logging(smk.log[0]):
        report_tune(smk.input.result, smk.output.table)


run(snakemake)  # noqa: F821 (injected by Snakemake)
