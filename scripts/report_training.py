"""Snakemake glue for rule `report_training`: dflash_pipeline.stages.report.report_training."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.report import report_training

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_training") as job:
    report_training(job.run_url, smk.params.segments, smk.output.figure, list(smk.input.segment_taus))
