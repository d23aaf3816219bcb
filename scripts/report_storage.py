"""Snakemake glue for rule `report_storage`: dflash_pipeline.stages.report.report_storage."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.report import report_storage

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_storage") as job:
    report_storage(job.run_url, smk.output.figure)
