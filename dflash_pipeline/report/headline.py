"""The run's headline figures: τ (the loop's, and the serving engine's where evaluate measured
one), the lossless verdict with its counts, the estimated speed-up, samples, tokens and
GPU-hours. One computation for both places that show them: the report's first page
(``write_headline_table``, rule ``report_headline``) and the live status page (its snapshot's
``headline``, drawn by ``status/assets/app.js``). A figure not measured yet is None, shown as
"not measured yet" in the report and "—" on the status page."""

from __future__ import annotations

import csv
import html
from pathlib import Path


NOT_MEASURED = "not measured yet"
# A figure the run's config never measures (the serving engine's τ where evaluate runs only the
# transformers loop): not "not measured yet", which promises it.
NOT_CONFIGURED = "not configured"


def lossless_counts(section) -> dict | None:
    """A ``lossless`` section (evaluation/lossless.py's shape) as the headline shows it: None when
    absent; ``checked`` False (a sampled run) keeps its reason."""
    if not isinstance(section, dict):
        return None
    if not section.get("checked"):
        return {"checked": False, "reason": section.get("reason") or "not checked"}
    failures = section.get("failures") or {}
    near = section.get("near_ties") or {}
    lost = section.get("lost", len(failures))
    return {
        "checked": True,
        "passed": bool(section.get("passed", not lost)),
        "prompts": section.get("prompts"),
        "exact": section.get("exact"),
        "near_tie": section.get("near_tie", len(near)),
        "lost": lost,
    }


def headline(
    metrics: dict | None,
    samples: int | None = None,
    tokens: int | None = None,
    gpu_hours: float | None = None,
    gpu_hours_of: str | None = None,
    evaluate_engine: str | None = None,
) -> dict:
    """The headline figures from evaluate's metrics JSON (None before evaluate wrote it) and the
    run's counts. ``lossless`` is the verdict over the loop's and the engine's checks: "lost"
    when either lost a token, "passed" when every check run passed, None when none was run.
    ``evaluate_engine`` (the config's ``evaluate.engine``) "transformers" says no serving engine
    is configured to measure τ: its figure is "not configured", not "not measured yet"."""
    metrics = metrics if isinstance(metrics, dict) else {}
    overall = metrics.get("overall") if isinstance(metrics.get("overall"), dict) else {}
    engine = metrics.get("engine") if isinstance(metrics.get("engine"), dict) else {}
    engine_overall = engine.get("overall") if isinstance(engine.get("overall"), dict) else {}
    checks = {"loop": lossless_counts(metrics.get("lossless")), "engine": lossless_counts(engine.get("lossless"))}
    checked = [c for c in checks.values() if c and c["checked"]]
    verdict = None
    if checked:
        verdict = "passed" if all(c["passed"] for c in checked) else "lost"
    return {
        "tau_loop": overall.get("tau"),
        "tau_engine": engine_overall.get("tau"),
        "engine": engine.get("name"),
        "lossless": verdict,
        "lossless_checks": checks,
        "speedup": overall.get("speedup_estimate"),
        "samples": samples,
        "tokens": tokens,
        "gpu_hours": gpu_hours,
        # Which jobs the GPU-hours count (the job records there are where they are taken).
        "gpu_hours_of": gpu_hours_of,
        "engine_configured": evaluate_engine != "transformers",
    }


def lossless_text(counts: dict | None) -> str | None:
    """E.g. "passed: 3 prompts, 2 exact, 1 near tie, 0 lost", "LOST: …", or why it was not checked."""
    if counts is None:
        return None
    if not counts["checked"]:
        return f"not checked ({counts['reason']})"
    ties = counts["near_tie"]
    return (
        f"{'passed' if counts['passed'] else 'LOST'}: {_count(counts['prompts'])} prompts, "
        f"{_count(counts['exact'])} exact, {_count(ties)} near {'tie' if ties == 1 else 'ties'}, "
        f"{_count(counts['lost'])} lost"
    )


def headline_rows(figures: dict) -> list[dict]:
    """The figures as rows ``{key, label, text}``; ``text`` None for a figure not measured yet."""
    checks = figures["lossless_checks"]
    engine = figures.get("engine") or "engine"
    lossless = None
    if figures["lossless"] is not None or any(checks.values()):
        parts = [
            f"{who}: {text}"
            for who, text in (("loop", lossless_text(checks["loop"])), (engine, lossless_text(checks["engine"])))
            if text
        ]
        lossless = "; ".join(parts)
    return [
        {"key": "tau_loop", "label": "τ (loop)", "text": _fixed(figures["tau_loop"], 2)},
        {
            "key": "tau_engine",
            "label": f"τ ({engine})",
            "text": _fixed(figures["tau_engine"], 2)
            if figures["tau_engine"] is not None or figures.get("engine_configured", True)
            else NOT_CONFIGURED,
        },
        {"key": "lossless", "label": "lossless", "text": lossless},
        {
            "key": "speedup",
            "label": "speed-up (estimated)",
            "text": None if figures["speedup"] is None else f"{_fixed(figures['speedup'], 2)}×",
        },
        {"key": "samples", "label": "samples", "text": _count(figures["samples"])},
        {"key": "tokens", "label": "tokens", "text": _count(figures["tokens"])},
        {
            "key": "gpu_hours",
            "label": f"GPU-hours ({figures['gpu_hours_of']})" if figures.get("gpu_hours_of") else "GPU-hours",
            "text": _fixed(figures["gpu_hours"], 2),
        },
    ]


def gpu_hours_from_benchmarks(benchmarks: dict[str, int]) -> float | None:
    """GPU-hours of finished jobs from their Snakemake benchmark files (``{path: gpus}``): each
    job's wall seconds (column ``s``, summed over its repeats) times its GPUs. None when no file
    holds a row."""
    seconds, found = 0.0, False
    for path, gpus in benchmarks.items():
        try:
            with open(path, newline="") as fh:
                for row in csv.DictReader(fh, delimiter="\t"):
                    seconds += float(row["s"]) * gpus
                    found = True
        except (OSError, KeyError, ValueError):
            continue  # a job without a benchmark (not run by this workflow): nothing to count
    return round(seconds / 3600, 4) if found else None


def generated_counts(records: list[dict]) -> tuple[int | None, int | None]:
    """(samples, tokens) the target generated, from the generate shards' final counts (their
    telemetry, or the stage's totals object): what the status page's throughput sums too."""
    if not records:
        return None, None
    return (
        sum(int(r.get("samples_done") or 0) for r in records),
        sum(int(r.get("tokens_generated") or 0) for r in records),
    )


def write_headline_table(figures: dict, out: str | Path) -> None:
    """The report's first item: one row per headline figure. A page without html/head/body tags
    and with its style scoped to its table, so the report's landing page can include it as it
    is (report/workflow.rst)."""
    rows = "".join(
        f"<tr><th>{html.escape(r['label'])}</th>"
        f"<td class='headline-{r['key']}'>{html.escape(r['text'] or NOT_MEASURED)}</td></tr>"
        for r in headline_rows(figures)
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(
        f"<!doctype html><meta charset='utf-8'><title>Headline figures</title><style>{_STYLE}</style>"
        f"<table class='headline'>{rows}</table>\n"
    )


_STYLE = (
    "table.headline{border-collapse:collapse;font:13px system-ui,sans-serif;margin:6px 0}"
    "table.headline td,table.headline th{border:1px solid #ccd;padding:3px 8px;text-align:left}"
    "table.headline th{background:#eef1f5}"
)


def _fixed(value, digits: int) -> str | None:
    return None if value is None else f"{float(value):.{digits}f}"


def _count(value) -> str | None:
    return None if value is None else f"{int(value):,}"


# Which jobs GPU-hours count, in both places that show them (report and status page).
GPU_HOURS_OF = "job benchmarks: tune, generate, extract, train, segment_tau, evaluate"


def gpus_per_rule(config: dict) -> dict[str, int]:
    """The GPUs each GPU rule's job holds, by the run's config: tune one server's tensor
    parallelism, generate and train their ``gpus_per_job``, extract, segment_tau and evaluate one
    GPU of training's. Read from the config by the report job and the status page, so editing
    ``gpus_per_job`` (an operational key) reruns nothing."""
    generation, train = config["generation"]["gpus_per_job"], config["train"]["gpus_per_job"]
    return {
        "tune": config["generation"]["server"]["tp"] if generation else 0,
        "generate": generation,
        "extract": min(1, train),
        "train": train,
        "segment_tau": min(1, train),
        "evaluate": min(1, train),
    }


def benchmark_rule(path: str) -> str:
    """The rule of a benchmark file, by its name (``benchmark.<rule>[-<shard or segment>].tsv``)."""
    return Path(path).name.removeprefix("benchmark.").split(".")[0].split("-")[0]


def benchmark_seconds(text: str) -> float:
    """A Snakemake benchmark file's wall seconds (column ``s``, summed over its repeats)."""
    return sum(float(row["s"]) for row in csv.DictReader(text.splitlines(), delimiter="\t"))


def benchmark_gpus(paths: list[str], config: dict) -> dict[str, int]:
    """{benchmark file: the GPUs its job held} (``gpus_per_rule``; 0 for a rule without GPUs)."""
    per_rule = gpus_per_rule(config)
    return {path: per_rule.get(benchmark_rule(path), 0) for path in paths}
