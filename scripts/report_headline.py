"""Snakemake glue for rule `report_headline`: dflash_pipeline.stages.report.report_headline."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.report.headline import benchmark_gpus
from dflash_pipeline.stages.report import report_headline


def run(smk) -> None:
    with job_logging(smk.log[0]):
        report_headline(
            smk.input.get("metrics"),
            smk.params.run_url,
            list(smk.params.shards),
            benchmark_gpus(smk.input.get("benchmarks", []), smk.config),
            smk.params.gpu_hours_of,
            smk.output.table,
        )


run(snakemake)  # noqa: F821 (injected by Snakemake)
