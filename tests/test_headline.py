"""The run's headline figures (report/headline.py): from evaluate's metrics with near ties and
lost tokens, in the report's table and in the status page's snapshot."""

from __future__ import annotations

import json

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import LocalStorage, ReadOnlyStorage
from dflash_pipeline.report import headline
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder
from tests.support.status_run import write_run

METRICS = {
    "overall": {"tau": 3.456, "speedup_estimate": 2.25},
    "lossless": {
        "checked": True,
        "prompts": 4,
        "exact": 3,
        "near_tie": 1,
        "lost": 0,
        "near_ties": {"p3": {"verdict": "near_tie"}},
        "failures": {},
        "passed": True,
    },
    "engine": {
        "name": "vllm",
        "overall": {"tau": 3.1},
        "lossless": {
            "checked": True,
            "prompts": 4,
            "exact": 1,
            "near_tie": 2,
            "lost": 1,
            "near_ties": {"p1": {}, "p2": {}},
            "failures": {"p4": {"verdict": "lost"}},
            "passed": False,
        },
    },
}


def rows(figures: dict) -> dict:
    return {r["key"]: r["text"] for r in headline.headline_rows(figures)}


def test_headline_from_metrics_with_near_ties_and_a_lost_token():
    figures = headline.headline(METRICS, samples=1200, tokens=3_400_000, gpu_hours=12.345)
    assert (figures["tau_loop"], figures["tau_engine"], figures["speedup"]) == (3.456, 3.1, 2.25)
    # The engine lost a token: the run's verdict is lost, though the loop passed.
    assert figures["lossless"] == "lost"
    assert figures["lossless_checks"]["loop"] == {
        "checked": True, "passed": True, "prompts": 4, "exact": 3, "near_tie": 1, "lost": 0,
    }  # fmt: skip
    assert figures["lossless_checks"]["engine"]["lost"] == 1
    text = rows(figures)
    assert text == {
        "tau_loop": "3.46",
        "tau_engine": "3.10",
        "lossless": "loop: passed: 4 prompts, 3 exact, 1 near tie, 0 lost; "
        "vllm: LOST: 4 prompts, 1 exact, 2 near ties, 1 lost",
        "speedup": "2.25×",
        "samples": "1,200",
        "tokens": "3,400,000",
        "gpu_hours": "12.35",
    }


def test_headline_before_evaluate_and_of_a_sampled_run():
    text = rows(headline.headline(None))
    assert set(text.values()) == {None}  # every figure: not measured yet
    sampled = {"overall": {"tau": 2.0}, "lossless": {"checked": False, "reason": "sampled (temperature > 0)"}}
    figures = headline.headline(sampled)
    assert figures["lossless"] is None and figures["tau_engine"] is None
    assert rows(figures)["lossless"] == "loop: not checked (sampled (temperature > 0))"
    # Counts missing from an older section come from its lists.
    old = headline.lossless_counts({"checked": True, "prompts": 2, "exact": 1, "near_ties": {"a": {}}, "failures": {}})
    assert (old["near_tie"], old["lost"], old["passed"]) == (1, 0, True)


def test_gpu_hours_from_benchmarks_and_generated_counts(tmp_path):
    bench = tmp_path / "benchmark.generate-00000.tsv"
    bench.write_text("s\th:m:s\tmax_rss\n1800.0\t0:30:00\t1\n")
    assert headline.gpu_hours_from_benchmarks({str(bench): 4, str(tmp_path / "missing.tsv"): 8}) == 2.0
    assert headline.gpu_hours_from_benchmarks({}) is None
    assert headline.generated_counts([{"samples_done": 3, "tokens_generated": 40}, {"samples_done": 2}]) == (5, 40)
    assert headline.generated_counts([]) == (None, None)


def test_headline_table_says_not_measured_yet(tmp_path):
    headline.write_headline_table(headline.headline(None, samples=7), tmp_path / "h.html")
    page = (tmp_path / "h.html").read_text()
    assert "<th>samples</th><td class='headline-samples'>7</td>" in page
    assert page.count("not measured yet") == 6
    assert "<body" not in page and "body{" not in page  # includable in the report's landing page


def test_status_snapshot_has_the_headline_and_the_reports_gpu_hours(tmp_path):
    root = tmp_path / "results/demo"
    run = LocalStorage(root)
    events = write_run(run, tmp_path)
    run.write_text(layout.EVAL_METRICS, json.dumps(METRICS))
    # A finished GPU job of 30 minutes on 2 GPUs, as its benchmark file records it; a CPU job's
    # benchmark adds nothing.
    bench = "s\th:m:s\tmax_rss\n1800.0\t0:30:00\t100\n"
    run.write_text(layout.benchmark_key("evaluate"), bench)
    run.write_text(layout.benchmark_key("prepare", 0), bench)
    gpus = {"tune": 0, "generate": 0, "extract": 2, "train": 2, "evaluate": 2}
    source = RunSource(
        ReadOnlyStorage.open(str(root)), num_shards=2, events_file=events, workdir=tmp_path, gpus_per_rule=gpus
    )
    snap = SnapshotBuilder(source).build()
    figures = snap["headline"]
    assert (figures["tau_loop"], figures["tau_engine"], figures["lossless"]) == (3.456, 3.1, "lost")
    assert figures["speedup"] == 2.25
    # The running generate shard's counts (write_run: 4 samples, 50 tokens so far).
    assert (figures["samples"], figures["tokens"]) == (4, 50)
    # The report's figure from the same files: the same number, said the same way.
    paths = [str(root / layout.benchmark_key("evaluate")), str(root / layout.benchmark_key("prepare", 0))]
    report_hours = headline.gpu_hours_from_benchmarks({p: gpus.get(headline.benchmark_rule(p), 0) for p in paths})
    assert figures["gpu_hours"] == report_hours == 1.0
    rows = {r["key"]: r for r in figures["rows"]}
    assert rows["gpu_hours"]["text"] == "1.00" and rows["gpu_hours"]["label"] == f"GPU-hours ({headline.GPU_HOURS_OF})"


def test_status_snapshot_headline_before_evaluate(tmp_path):
    root = tmp_path / "results/demo"
    events = write_run(LocalStorage(root), tmp_path)
    LocalStorage(root).delete(layout.EVAL_METRICS)
    source = RunSource(ReadOnlyStorage.open(str(root)), num_shards=2, events_file=events, workdir=tmp_path)
    figures = SnapshotBuilder(source).build()["headline"]
    assert figures["tau_loop"] is None and figures["lossless"] is None and figures["gpu_hours"] is None


def test_each_benchmark_counts_the_gpus_its_job_held_by_the_config():
    from dflash_pipeline.report.headline import benchmark_gpus

    config = {"generation": {"gpus_per_job": 2, "server": {"tp": 2}}, "train": {"gpus_per_job": 8}}
    paths = [
        "r/outputs/benchmark.tune.tsv",
        "r/outputs/benchmark.generate-00003.tsv",
        "r/outputs/benchmark.extract-00003.tsv",
        "r/outputs/benchmark.train-segment-001.tsv",
        "r/outputs/benchmark.evaluate.tsv",
    ]
    assert list(benchmark_gpus(paths, config).values()) == [2, 2, 1, 8, 1]
    cpu = {"generation": {"gpus_per_job": 0, "server": {"tp": 1}}, "train": {"gpus_per_job": 0}}
    assert set(benchmark_gpus(paths, cpu).values()) == {0}


def test_the_run_summary_states_tau_lossless_speedup_and_where_the_drafter_is(tmp_path):
    from dflash_pipeline.core.config import validate_config
    from dflash_pipeline.report.run_summary import run_summary

    run = LocalStorage(tmp_path / "run")
    config = validate_config({"evaluate": {"engine": "transformers"}})
    before = run_summary(config, str(tmp_path / "run"), run)
    assert "  τ (loop): not measured yet" in before and "  τ (engine): not configured" in before
    run.write_text(layout.EVAL_METRICS, json.dumps(METRICS))
    run.write_text(layout.DRAFTER_CONFIG, "{}")
    lines = run_summary(config, str(tmp_path / "run"), run)
    assert lines[0].startswith(f"Run {config['run']} done: prepare, ") and str(tmp_path / "run") in lines[0]
    assert "  τ (loop): 3.46" in lines and "  speed-up (estimated): 2.25×" in lines
    assert any(line.startswith("  lossless: loop: ") and "LOST" in line for line in lines), lines
    assert f"  drafter: {tmp_path / 'run'}/drafter/" in lines and lines[-1].startswith("  report: make report")
    digest = "sampled-v1:0123456789abcdef"
    compared = {"trained_against": digest, "evaluated": digest, "match": True}
    run.write_text(layout.EVAL_METRICS, json.dumps({**METRICS, "target_weights": compared}))
    lines = run_summary(config, str(tmp_path / "run"), run)
    assert f"  target weights: {digest} (the drafter's: {digest})" in lines
