"""Snakemake glue for rule `report_tokenization`: dflash_pipeline.stages.report.report_tokenization."""

from dflash_pipeline.core.checksums import verify_inputs
from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.stages.report import report_tokenization


def run(smk) -> None:
    with job_logging(smk.log[0]):
        verify_inputs(smk, list(smk.input.stats))
        report_tokenization(list(smk.input.stats), smk.output.supervised, smk.output.degenerate, smk.output.table)


run(snakemake)  # noqa: F821 (injected by Snakemake)
