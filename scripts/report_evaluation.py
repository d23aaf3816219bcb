"""Snakemake glue for rule `report_evaluation`: dflash_pipeline.stages.report.report_evaluation."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.report import report_evaluation

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_evaluation"):
    report_evaluation(smk.input.metrics, smk.output.figure)
