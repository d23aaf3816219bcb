"""Report stage: the figures and tables of ``snakemake --report``, one function per `report_*` rule.

Each reads what its stage left (stats, metrics, benchmarks, telemetry) and draws with
``dflash_pipeline.report.figures``. Run by hand: ``python -m dflash_pipeline.stages.report --help``.
"""

from __future__ import annotations

import argparse
import sys

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import StageTotals, read_stage_telemetry
from dflash_pipeline.core.storage import ReadOnlyStorage
from dflash_pipeline.report import figures, headline, tables


def report_prompts(summary: str, quarantine: str, figure: str, table: str) -> None:
    summary_doc, rows = figures.read_json(summary), figures.read_jsonl(quarantine)
    figures.plot_prompts(summary_doc, rows, figure)
    tables.write_quarantine_table(summary_doc, rows, table)


def report_generation(
    generated: list[str], benchmarks: list[str], run_url: str, throughput: str, lengths: str, finish: str
) -> None:
    summaries = [figures.summarize_generated(path) for path in generated]
    seconds = {figures.shard_label(p): figures.read_benchmark_seconds(p) for p in benchmarks}
    telemetry = read_stage_telemetry(run_url, "generate", [s["shard"] for s in summaries])
    figures.plot_generation_throughput(figures.generation_throughput(summaries, seconds, telemetry), throughput)
    figures.plot_generation_lengths(summaries, lengths)
    figures.plot_finish_reasons(summaries, finish)


def report_tune(result: str, table: str) -> None:
    tables.write_tune_table(figures.read_json(result), table)


def report_tokenization(stats: list[str], supervised: str, degenerate: str, table: str) -> None:
    docs = [figures.read_json(path) for path in stats]
    figures.plot_supervised_histogram(docs, supervised)
    figures.plot_degenerate_reasons(docs, degenerate)
    tables.write_tokenization_table(docs, table)


def report_training(run_url: str, segments: int, figure: str, segment_taus: list[str] = ()) -> None:
    # The per-step metrics are the segments' own (_progress/), next to their manifests; each
    # segment's τ is its segment_tau record (none where train.segment_eval is off).
    figures.write_training_report(run_url, range(segments), figure, segment_taus)


def report_evaluation(metrics: str, figure: str) -> None:
    figures.write_evaluation_report(metrics, figure)


def report_headline(
    metrics: str | None,
    run_url: str,
    shards: list[str],
    benchmarks: dict[str, int],
    gpu_hours_of: str,
    table: str,
    evaluate_engine: str | None = None,
) -> None:
    """The report's first item: the headline figures (report/headline.py); ``metrics`` None (a run
    that stops before evaluate) or no ``shards`` leave their figures "not measured yet"."""
    totals = StageTotals(ReadOnlyStorage.open(run_url), "generate").read() if shards else {}
    by_name = {layout.shard_name(k): v for k, v in totals.items()}
    missing = [s for s in shards if s not in by_name]
    records = [by_name[s] for s in shards if s in by_name]
    records += list(read_stage_telemetry(run_url, "generate", missing).values()) if missing else []
    samples, tokens = headline.generated_counts(records)
    found = headline.headline(
        figures.read_json(metrics) if metrics else None,
        samples=samples,
        tokens=tokens,
        gpu_hours=headline.gpu_hours_from_benchmarks(benchmarks),
        gpu_hours_of=gpu_hours_of,
        evaluate_engine=evaluate_engine,
    )
    headline.write_headline_table(found, table)


def report_storage(run_url: str, figure: str) -> None:
    # The run root as it is now, outputs, logs, _progress/ and checkpoints alike.
    objects = ReadOnlyStorage.open(run_url).list("")
    figures.plot_storage(figures.storage_by_stage(objects), figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.report", description=__doc__)
    sub = parser.add_subparsers(dest="report", required=True)
    p = sub.add_parser("prompts", help="ingest summary and quarantine")
    p.add_argument("--summary", required=True)
    p.add_argument("--quarantine", required=True)
    p.add_argument("--figure", required=True)
    p.add_argument("--table", required=True)
    p = sub.add_parser("generation", help="throughput, lengths, finish reasons")
    p.add_argument("--generated", nargs="+", required=True)
    p.add_argument("--benchmarks", nargs="*", default=[])
    p.add_argument("--run-url", required=True)
    p.add_argument("--throughput", required=True)
    p.add_argument("--lengths", required=True)
    p.add_argument("--finish", required=True)
    p = sub.add_parser("tune", help="the engine settings tune measured")
    p.add_argument("--result", required=True)
    p.add_argument("--table", required=True)
    p = sub.add_parser("tokenization", help="supervised tokens and the gate's reasons")
    p.add_argument("--stats", nargs="+", required=True)
    p.add_argument("--supervised", required=True)
    p.add_argument("--degenerate", required=True)
    p.add_argument("--table", required=True)
    p = sub.add_parser("training", help="loss and acceptance curves")
    p.add_argument("--run-url", required=True)
    p.add_argument("--segments", type=int, required=True)
    p.add_argument("--figure", required=True)
    p.add_argument("--segment-taus", nargs="*", default=[], help="rule segment_tau's records")
    p = sub.add_parser("evaluation", help="acceptance per prompt set")
    p.add_argument("--metrics", required=True)
    p.add_argument("--figure", required=True)
    p = sub.add_parser("storage", help="bytes per stage")
    p.add_argument("--run-url", required=True)
    p.add_argument("--figure", required=True)
    args = vars(parser.parse_args(argv))
    REPORTS[args.pop("report")](**args)
    return 0


REPORTS = {
    "prompts": report_prompts,
    "generation": report_generation,
    "tune": report_tune,
    "tokenization": report_tokenization,
    "training": report_training,
    "evaluation": report_evaluation,
    "storage": report_storage,
}


if __name__ == "__main__":
    sys.exit(main())
