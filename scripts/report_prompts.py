"""Snakemake glue for rule `report_prompts`: dflash_pipeline.stages.report.report_prompts."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.report import report_prompts

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_prompts"):
    report_prompts(smk.input.summary, smk.input.quarantine, smk.output.figure, smk.output.table)
