"""Snakemake glue for rule `report_generation`; the logic is dflash_pipeline.report."""

from dflash_pipeline.core.joblog import job_logging
from dflash_pipeline.report.figures import (
    generation_throughput,
    plot_finish_reasons,
    plot_generation_lengths,
    plot_generation_throughput,
    read_benchmark_seconds,
    shard_label,
    summarize_generated,
)
from dflash_pipeline.core.jobstate import read_stage_telemetry


def run(smk) -> None:
    with job_logging(smk.log[0]):
        summaries = [summarize_generated(path) for path in smk.input.generated]
        seconds = {shard_label(p): read_benchmark_seconds(p) for p in smk.input.benchmarks}
        telemetry = read_stage_telemetry(smk.params.run_url, "generate", [s["shard"] for s in summaries])
        plot_generation_throughput(generation_throughput(summaries, seconds, telemetry), smk.output.throughput)
        plot_generation_lengths(summaries, smk.output.lengths)
        plot_finish_reasons(summaries, smk.output.finish)


run(snakemake)  # noqa: F821 (injected by Snakemake)
