"""Snakemake glue for rule `report_prompts`: dflash_pipeline.stages.report.report_prompts."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.report import report_prompts


def run(smk) -> None:
    with job_logging(smk.log[0]):
        report_prompts(smk.input.summary, smk.input.quarantine, smk.output.figure, smk.output.table)


run(snakemake)  # noqa: F821 (injected by Snakemake)
