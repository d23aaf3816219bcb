"""Snakemake glue for rule `report_headline`: dflash_pipeline.stages.report.report_headline."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.report.headline import benchmark_gpus
from dflash_pipeline.stages.report import report_headline

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_headline") as job:
    report_headline(
        smk.input.get("metrics"),
        job.run_url,
        list(smk.params.shards),
        benchmark_gpus(smk.input.get("benchmarks", []), smk.config),
        smk.params.gpu_hours_of,
        smk.output.table,
        smk.config["evaluate"]["engine"],
    )
