"""The report's numbers and figures, from files in the formats the stages write."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.report import figures as report
from dflash_pipeline.report import tables
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA
from dflash_pipeline.core.storage import ObjectInfo


def svg_text(path: Path) -> str:
    """All text of an SVG figure (matplotlib keeps text as text: svg.fonttype none)."""
    root = ET.parse(path).getroot()
    return " ".join(t for t in root.itertext() if t.strip())


def generated_row(i: int, thinking: str, answer: str, tokens: int, finish: str) -> dict:
    return {
        "id": f"s{i}",
        "shard": 3,
        "split": "train",
        "error": None,
        "fingerprint": "f",
        "messages": [
            {"role": "user", "content": "q", "reasoning_content": None},
            {"role": "assistant", "content": answer, "reasoning_content": thinking},
        ],
        "turns": [
            {
                "message_index": 1,
                "finish_reason": finish,
                "think_closed": finish == "stop",
                "prompt_tokens": 5,
                "completion_tokens": tokens,
                "output_ids": list(range(tokens)),
            }
        ],
        "prompt_tokens": 5,
        "completion_tokens": tokens,
    }


@pytest.fixture
def generated(tmp_path) -> Path:
    rows = [
        generated_row(0, "a" * 40, "yes", 20, "stop"),
        generated_row(1, "", "b" * 100, 300, "length"),
        generated_row(2, "c" * 40, "no", 40, "stop"),
    ]
    path = tmp_path / "generated-00003.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATED_SCHEMA), path)
    return path


def test_histogram_bins_are_half_open_and_the_last_is_open_ended():
    assert report.histogram([0, 7, 8, 15, 16, 10**6], [0, 8, 16]) == [2, 2, 2]
    assert report.bin_labels([0, 8, 16]) == ["0–7", "8–15", "≥16"]


def test_generated_shard_summary_counts_lengths_and_finish_reasons(generated):
    s = report.summarize_generated(generated)
    assert (s["shard"], s["samples"], s["turns"], s["errors"]) == ("00003", 3, 3, 0)
    assert s["finish_reasons"] == {"stop": 2, "length": 1}
    assert s["completion_tokens"] == 360
    edges = report.TOKEN_EDGES
    assert s["completion_histogram"][edges.index(16)] == 1 and s["completion_histogram"][edges.index(256)] == 1
    assert s["thinking_chars_histogram"][0] == 1  # the one empty thinking block
    assert sum(s["answer_chars_histogram"]) == 3


def test_throughput_per_shard_uses_the_benchmark_and_the_telemetry(generated, tmp_path):
    bench = tmp_path / "benchmark.generate-00003.tsv"
    bench.write_text("s\th:m:s\tmax_rss\n12.0\t0:00:12\t100\n")
    s = report.summarize_generated(generated)
    [row] = report.generation_throughput(
        [s], {"00003": report.read_benchmark_seconds(bench)}, {"00003": {"tokens_per_s": 55.0}}
    )
    assert row["job_tokens_per_s"] == pytest.approx(30.0) and row["generation_tokens_per_s"] == 55.0
    out = tmp_path / "throughput.svg"
    report.plot_generation_throughput([row], out)
    assert "Generation throughput per shard" in svg_text(out) and "00003" in svg_text(out)


def test_a_file_that_is_not_a_benchmark_is_named(tmp_path):
    bad = tmp_path / "x.tsv"
    bad.write_text("a\tb\n1\t2\n")
    with pytest.raises(ValueError, match="x.tsv: not a Snakemake benchmark"):
        report.read_benchmark_seconds(bad)


def test_generation_figures_show_lengths_and_finish_reasons(generated, tmp_path):
    s = report.summarize_generated(generated)
    report.plot_generation_lengths([s, s], tmp_path / "lengths.svg")
    report.plot_finish_reasons([s], tmp_path / "finish.svg")
    assert "thinking length" in svg_text(tmp_path / "lengths.svg")
    text = svg_text(tmp_path / "finish.svg")
    assert "length" in text and "stop" in text


def test_prompt_figure_and_quarantine_table(tmp_path):
    summary = {
        "rows_read": 10,
        "samples": 7,
        "heldout_samples": 1,
        "duplicates_dropped": 1,
        "bad_rows": 2,
        "bad_fraction": 0.2,
        "samples_per_shard": [4, 3],
        "heldout_per_shard": [1, 0],
    }
    quarantine = [
        {"file": "d.jsonl", "row": 3, "reason": "malformed_json", "detail": "<b>x</b>"},
        {"file": "d.jsonl", "row": 5, "reason": "unknown_role", "detail": "narrator"},
    ]
    report.plot_prompts(summary, quarantine, tmp_path / "prompts.svg")
    assert "quarantined rows (2)" in svg_text(tmp_path / "prompts.svg")
    tables.write_quarantine_table(summary, quarantine, tmp_path / "q.html")
    page = (tmp_path / "q.html").read_text()
    assert "malformed_json" in page and "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page


def tokenize_stats(shard: str, reasons: dict, counts: list[int]) -> dict:
    return {
        "shard": f"generate-{shard}.parquet",
        "samples": 10,
        "sequences_out": 9,
        "degenerate_samples": sum(reasons.values()),
        "degenerate_fraction": 0.1,
        "reasons": reasons,
        "truncated_sequences": 0,
        "supervised_tokens_total": 500,
        "tokens_total": 900,
        "supervised_histogram": {"edges": report.TOKEN_EDGES, "counts": counts},
    }


def test_tokenization_figures_sum_histograms_and_stack_reasons(tmp_path):
    counts = [0] * len(report.TOKEN_EDGES)
    counts[3] = 4
    stats = [tokenize_stats("00000", {"empty_response": 1}, counts), tokenize_stats("00001", {}, counts)]
    report.plot_supervised_histogram(stats, tmp_path / "sup.svg")
    assert "(1,000 in all)" in svg_text(tmp_path / "sup.svg")
    report.plot_degenerate_reasons(stats, tmp_path / "deg.svg")
    assert "empty_response" in svg_text(tmp_path / "deg.svg")
    tables.write_tokenization_table(stats, tmp_path / "tok.html")
    assert "<td>00000</td>" in (tmp_path / "tok.html").read_text()
    stats[1]["supervised_histogram"]["edges"] = [0, 1]
    with pytest.raises(ValueError, match="generate-00001.parquet: supervised histogram bins differ"):
        report.plot_supervised_histogram(stats, tmp_path / "sup.svg")


def test_storage_by_stage_groups_shards_outputs_and_folders(tmp_path):
    objects = [
        ObjectInfo("outputs/generate-00000.parquet", 100, 0),
        ObjectInfo("outputs/generate-00001.parquet", 50, 0),
        ObjectInfo("outputs/tokenize-00000.stats.json", 7, 0),
        ObjectInfo("outputs/benchmark.generate-00000.tsv", 3, 0),
        ObjectInfo("_progress/generate/shard-00000/telemetry.json", 9, 0),
        ObjectInfo("logs/x.log", 2, 0),
    ]
    use = report.storage_by_stage(objects)
    assert use == {"generate": 150, "_progress": 9, "tokenize": 7, "benchmark": 3, "logs": 2}
    report.plot_storage(use, tmp_path / "storage.svg")
    assert "Storage per stage (171.00 B in all)" in svg_text(tmp_path / "storage.svg")


def test_training_curves_from_the_segments_metrics_in_the_run(tmp_path):
    from dflash_pipeline.core import layout
    from dflash_pipeline.core.storage import LocalStorage

    run = LocalStorage(tmp_path / "run")
    for segment, steps in ((0, range(1, 4)), (1, range(4, 7))):
        run.write_text(
            layout.train_progress_prefix(segment) + layout.TRAIN_METRICS,
            "".join(
                json.dumps(
                    {
                        "segment": segment,
                        "step": s,
                        "loss": 2.0 / s,
                        "accuracy": 0.1 * s,
                        "accuracy_per_position": [0.9, 0.5, 0.2],
                        "accept_len": 1 + 0.2 * s,
                        "tokens_per_s": 1000.0,
                        "lr": 1e-4,
                        "gpu_mem_gib": None,
                        "time": float(s),
                    }
                )
                + "\n"
                for s in steps
            ),
        )
    report.write_training_report(str(tmp_path / "run"), [1, 0], tmp_path / "train.svg")
    text = svg_text(tmp_path / "train.svg")
    assert "simulated acceptance length" in text and "accuracy per draft position (last step)" in text
    with pytest.raises(ValueError, match="no training step recorded; missing: .*segment-0002/metrics.jsonl"):
        report.write_training_report(str(tmp_path / "run"), [2], tmp_path / "t.svg")


def test_acceptance_figure_per_position_and_prompt_set(tmp_path):
    metrics = {
        "overall": {
            "tau": 2.4,
            "accept_hist": [3, 2, 1, 4],
            "per_position": [0.8, 0.5, 0.3],
            "generated_tokens": 100,
            "verify_steps": 10,
            "speedup_estimate": 2.0,
        },
        "prompt_sets": {
            "math": {"tau": 2.9, "per_position": [0.9, 0.7, 0.4]},
            "chat": {"tau": 1.8, "per_position": [0.6, 0.3, 0.1]},
        },
        "per_prompt": [],
    }
    (tmp_path / "evaluate-metrics.json").write_text(json.dumps(metrics))
    report.write_evaluation_report(tmp_path / "evaluate-metrics.json", tmp_path / "acc.svg")
    text = svg_text(tmp_path / "acc.svg")
    assert "acceptance length τ (overall 2.40)" in text and "math" in text and "chat" in text
    with pytest.raises(ValueError, match="no 'overall'"):
        report.plot_acceptance({"prompt_sets": {}}, tmp_path / "x.svg")


def test_figures_name_the_algorithm_and_draw_the_selector_walk(tmp_path):
    from dflash_pipeline.core import layout
    from dflash_pipeline.core.storage import LocalStorage

    run = LocalStorage(tmp_path / "run")
    run.write_text(
        layout.train_progress_prefix(0) + layout.TRAIN_METRICS,
        "".join(
            json.dumps(
                {
                    "segment": 0,
                    "step": s,
                    "algorithm": "dflash2",
                    "loss": 2.0 / s,
                    "accuracy": 0.1 * s,
                    "accuracy_per_position": [0.9, 0.5, 0.2],
                    "accept_len": 1 + 0.2 * s,
                    "selector_accuracy": 0.12 * s,
                    "selector_accept_len": 1 + 0.25 * s,
                    "tokens_per_s": 1000.0,
                    "lr": 1e-4,
                    "time": float(s),
                }
            )
            + "\n"
            for s in range(1, 4)
        ),
    )
    report.write_training_report(str(tmp_path / "run"), [0], tmp_path / "train.svg")
    text = svg_text(tmp_path / "train.svg")
    assert "drafter: DFlash2" in text and "selector walk" in text and "logits argmax" in text
    metrics = {
        "overall": {"tau": 2.4, "accept_hist": [3, 2, 1, 4], "per_position": [0.8, 0.5, 0.3]},
        "prompt_sets": {},
        "per_prompt": [],
        "settings": {"algorithm": "dflash2"},
    }
    report.plot_acceptance(metrics, tmp_path / "acc.svg")
    assert "drafter: DFlash2" in svg_text(tmp_path / "acc.svg")
    report.plot_acceptance({**metrics, "settings": {}}, tmp_path / "acc1.svg")
    assert "drafter: DFlash" in svg_text(tmp_path / "acc1.svg")


def test_the_tune_table_lists_every_setting_and_marks_the_choice(tmp_path):
    def setting(concurrency, tps, mtp=False, out=()):
        return {
            "concurrency": concurrency, "mtp": mtp, "output_tokens_per_s": tps, "tokens_per_s_per_gpu": tps,
            "ttft_s": {"p50": 0.1, "p90": 0.2, "p99": 0.3}, "tpot_ms": {"p50": 20.0, "p90": 30.0, "p99": 40.0},
            "requests": 8, "cut_at_budget": 0, "finish_reasons": {"stop": 6, "length": 2},
            "engine_memory_mb": {"rss": 900.0, "gpu": None}, "out_of_bounds": list(out),
        }  # fmt: skip

    result = {
        "engine_version": "0.5.17", "device": "1 x NVIDIA H200", "created_utc": "2026-12-05T10:00:00Z",
        "prompts": 8, "max_new_tokens": 64, "mtp": "measured with and without MTP",
        "bounds": {"max_tpot_ms": 35, "max_ttft_s": None, "max_memory_mb": None},
        "settings": [setting(16, 900.0), setting(64, 2000.0, out=["p90 per-token latency 40 ms > 35"]),
                     setting(16, 1500.0, mtp=True)],
        "choice": {"concurrency": 16, "mtp": True, "why": "the best throughput within the bounds"},
    }  # fmt: skip
    tables.write_tune_table(result, tmp_path / "tune.html")
    page = (tmp_path / "tune.html").read_text()
    rows = page.split("<tr>")[1:]
    chosen = [r for r in rows if "<td>chosen</td>" in r]
    assert len(chosen) == 1 and "<td>yes</td><td>16</td><td>1500.0</td>" in chosen[0]
    assert "p90 per-token latency 40 ms &gt; 35" in page and "max_tpot_ms 35" in page
    assert "concurrency 16 with MTP: the best throughput within the bounds" in page


def test_the_report_landing_page_shows_the_headline_figures(tmp_path):
    """report/workflow.rst rendered as Snakemake renders it (Jinja with the report's files, then
    docutils) includes the headline table; its category sorts first."""
    from types import SimpleNamespace

    from docutils.core import publish_parts
    from jinja2 import Environment

    from dflash_pipeline.report import headline

    metrics = {
        "overall": {"tau": 2.5, "speedup_estimate": 1.8},
        "lossless": {"checked": True, "prompts": 3, "exact": 2, "near_tie": 1, "lost": 0, "passed": True},
    }
    table = tmp_path / "report-headline.html"
    headline.write_headline_table(headline.headline(metrics, samples=10, tokens=2000), table)
    repo = Path(__file__).resolve().parent.parent
    files = [SimpleNamespace(target=table.name, path=table)]
    config = {"run": "demo", "num_shards": 2, "target": {"model": "m"}}
    source = (repo / "report/workflow.rst").read_text()
    text = Environment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    page = publish_parts(
        text.render(snakemake=SimpleNamespace(config=config), categories={}, files=files), writer_name="html"
    )["html_body"]
    for shown in ("τ (loop)", "2.50", "passed: 3 prompts, 2 exact, 1 near tie, 0 lost", "1.80×", "2,000"):
        assert shown in page, shown
    assert "not measured yet" in page  # the engine's τ, GPU-hours
    categories = re.findall(r'category="([^"]+)"', (repo / "rules/report.smk").read_text())
    assert sorted(categories)[0] == "0. Headline"
