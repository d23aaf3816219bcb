"""Snakemake glue for rule `report_tokenization`: dflash_pipeline.stages.report.report_tokenization."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.report import report_tokenization

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_tokenization") as job:
    job.verify(smk.input.stats)
    report_tokenization(list(smk.input.stats), smk.output.supervised, smk.output.degenerate, smk.output.table)
