"""Snakemake glue for rule `report_evaluation`: dflash_pipeline.stages.report.report_evaluation."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.report import report_evaluation


def run(smk) -> None:
    with job_logging(smk.log[0]):
        report_evaluation(smk.input.metrics, smk.output.figure)


run(snakemake)  # noqa: F821 (injected by Snakemake)
