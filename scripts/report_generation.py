"""Snakemake glue for rule `report_generation`: dflash_pipeline.stages.report.report_generation."""

from dflash_pipeline.core.stage_job import stage_job
from dflash_pipeline.stages.report import report_generation

smk = snakemake  # noqa: F821 (injected by Snakemake)
with stage_job(smk, "report_generation") as job:
    job.verify(smk.input.generated)
    report_generation(
        list(smk.input.generated),
        list(smk.input.benchmarks),
        job.run_url,
        smk.output.throughput,
        smk.output.lengths,
        smk.output.finish,
    )
