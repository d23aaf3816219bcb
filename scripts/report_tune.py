"""Snakemake glue for rule `report_tune`: dflash_pipeline.stages.report.report_tune."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.report import report_tune

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_tune"):
    report_tune(smk.input.result, smk.output.table)
