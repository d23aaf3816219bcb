"""Plots and tables of the HTML report (``snakemake --report report.html``).

Each stage's report rule hands this module the stage's small outputs (summaries, stats, shard
tables, benchmark TSVs) and gets back SVG figures that the rule flags with ``report()`` (the HTML
tables are ``dflash_pipeline.report.tables``). Loading (``summarize_*``) and drawing (``plot_*``) are separate, so the numbers can
be tested without looking at pictures. Histograms use fixed bins, so a run of a million samples
is summarized shard by shard in constant memory.

Training: ``write_training_report`` reads the ``metrics.jsonl`` of every training segment;
evaluation: ``write_evaluation_report`` reads ``evaluate-metrics.json``.

Its length (over 400 lines): one loader and one plot per report section, kept together so the
figures' look (colours, bins, units) is decided in one place.
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import read_train_metrics

# Fixed histogram bins: tokens (as the tokenize stats) and characters.
TOKEN_EDGES = [0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
CHAR_EDGES = [0, 1, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
SHARD_NUMBER = re.compile(r"(\d{5})")


ALGORITHM_NAMES = {"dflash": "DFlash", "dflash2": "DFlash2"}


def histogram(values: Iterable[int], edges: list[int]) -> list[int]:
    """Counts per bin; bin k holds edges[k] <= v < edges[k+1], the last bin is open-ended."""
    counts = [0] * len(edges)
    for v in values:
        k = len(edges) - 1
        while k > 0 and v < edges[k]:
            k -= 1
        counts[k] += 1
    return counts


def bin_labels(edges: list[int]) -> list[str]:
    labels = [f"{lo}–{hi - 1}" if hi - lo > 1 else str(lo) for lo, hi in zip(edges, edges[1:])]
    return labels + [f"≥{edges[-1]}"]


def shard_label(path: str | Path) -> str:
    match = SHARD_NUMBER.search(Path(path).name)
    return match.group(1) if match else Path(path).stem


def read_json(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from err


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise ValueError(f"{path}, line {n}: not JSON ({err})") from err
    return rows


def read_benchmark_seconds(path: str | Path) -> float:
    """Wall-clock seconds of a job from its Snakemake benchmark TSV (column ``s``)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    if not rows or "s" not in rows[0]:
        raise ValueError(f"{path}: not a Snakemake benchmark file (no column 's')")
    return float(rows[-1]["s"])


# ---------------------------------------------------------------- summaries (plain numbers)


def summarize_generated(path: str | Path) -> dict:
    """Per-shard numbers of a generated shard: lengths as fixed-bin histograms, finish reasons."""
    table = pq.ParquetFile(path).read(
        columns=[
            "turns.list.element.finish_reason",
            "turns.list.element.completion_tokens",
            "messages.list.element.role",
            "messages.list.element.content",
            "messages.list.element.reasoning_content",
            "error",
        ]
    )
    finish, completion, thinking, answer = Counter(), [], [], []
    for turns in table.column("turns").to_pylist():
        for turn in turns or []:
            finish[turn["finish_reason"] or "none"] += 1
            completion.append(turn["completion_tokens"] or 0)
    for messages in table.column("messages").to_pylist():
        for message in messages or []:
            if message["role"] == "assistant":
                thinking.append(len(message["reasoning_content"] or ""))
                answer.append(len(message["content"] or ""))
    errors = sum(e is not None for e in table.column("error").to_pylist())
    return {
        "shard": shard_label(path),
        "samples": table.num_rows,
        "turns": len(completion),
        "errors": errors,
        "completion_tokens": sum(completion),
        "finish_reasons": dict(finish),
        "completion_histogram": histogram(completion, TOKEN_EDGES),
        "thinking_chars_histogram": histogram(thinking, CHAR_EDGES),
        "answer_chars_histogram": histogram(answer, CHAR_EDGES),
    }


def generation_throughput(
    summaries: list[dict], benchmark_seconds: dict[str, float], telemetry: dict[str, dict] | None = None
) -> list[dict]:
    """Tokens per second per shard: over the whole job (engine start included, from the
    benchmark) and over the generation phase alone (the job's own telemetry, where kept)."""
    telemetry = telemetry or {}
    rows = []
    for s in summaries:
        seconds = benchmark_seconds.get(s["shard"])
        tele = telemetry.get(s["shard"]) or {}
        rows.append(
            {
                "shard": s["shard"],
                "completion_tokens": s["completion_tokens"],
                "job_seconds": seconds,
                "job_tokens_per_s": s["completion_tokens"] / seconds if seconds else None,
                "generation_tokens_per_s": tele.get("tokens_per_s"),
            }
        )
    return rows


def storage_by_stage(objects: Iterable) -> dict[str, int]:
    """Bytes per stage (shard objects by stage, other outputs by kind, other folders by name)."""
    use: Counter = Counter()
    for obj in objects:
        use[layout.storage_category(obj.key)] += obj.size
    return dict(sorted(use.items(), key=lambda kv: -kv[1]))


def _sum_lists(lists: Iterable[list[int]]) -> list[int]:
    total: list[int] = []
    for counts in lists:
        total = [a + b for a, b in zip(total, counts)] if total else list(counts)
    return total


# ---------------------------------------------------------------- drawing


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Text stays text in the SVG (smaller, searchable); a fixed hash salt keeps ids stable.
    plt.rcParams.update({"figure.dpi": 100, "font.size": 9, "svg.fonttype": "none", "svg.hashsalt": "dflash-report"})
    return plt


def _save(fig, out: str | Path) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # metadata Date None: the same data gives the same file (reports diff cleanly).
    fig.savefig(out, metadata={"Date": None} if str(out).endswith(".svg") else None)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_xticks([])
    ax.set_yticks([])


def _stacked_per_shard(ax, shards, series: dict, ylabel, colors=None, legend_size=None) -> None:
    """One stacked bar per shard, one colour per series (reasons of finish, of degeneracy)."""
    xs = list(range(len(shards)))
    bottom = [0] * len(shards)
    for name, values in series.items():
        ax.bar(xs, values, bottom=bottom, label=name, color=(colors or {}).get(name))
        bottom = [a + b for a, b in zip(bottom, values)]
    ax.set_xticks(xs, shards, rotation=45 if len(xs) > 8 else 0)
    ax.set_xlabel("shard")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)


def _bars(ax, labels, values, title, ylabel=None, color="#3b7dd8", rotate=False):
    if not labels:
        return _empty(ax, f"{title}: none")
    ax.bar(range(len(labels)), values, color=color)
    ax.set_xticks(range(len(labels)), labels, rotation=45 if rotate else 0, ha="right" if rotate else "center")
    ax.set_title(title)
    if ylabel:
        ax.set_ylabel(ylabel)


def plot_prompts(summary: dict, quarantine: list[dict], out: str | Path) -> None:
    """Samples per shard (training and held-out) and the reasons rows were quarantined."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    per_shard = summary.get("samples_per_shard", [])
    heldout = summary.get("heldout_per_shard", [0] * len(per_shard))
    train = [a - b for a, b in zip(per_shard, heldout)]
    xs = range(len(per_shard))
    left.bar(xs, train, label="training", color="#3b7dd8")
    left.bar(xs, heldout, bottom=train, label="held out", color="#f0a030")
    if len(per_shard) <= 24:
        left.set_xticks(list(xs), [f"{i:05d}" for i in xs], rotation=45, ha="right")
    left.set_xlabel("shard")
    left.set_ylabel("samples")
    left.set_title(f"{summary.get('samples', 0)} samples in {len(per_shard)} shards")
    left.legend()
    reasons = Counter(r.get("reason", "unknown") for r in quarantine)
    labels, values = zip(*reasons.most_common()) if reasons else ((), ())
    _bars(right, list(labels), list(values), f"quarantined rows ({len(quarantine)})", "rows", "#d64545", True)
    _save(fig, out)


def plot_generation_throughput(rows: list[dict], out: str | Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(rows) + 3), 3.4))
    if not rows:
        _empty(ax, "no generated shards")
    else:
        xs = list(range(len(rows)))
        width = 0.4
        ax.bar(
            [x - width / 2 for x in xs],
            [r["job_tokens_per_s"] or 0 for r in rows],
            width,
            label="whole job (engine start included)",
            color="#8fb3e8",
        )
        ax.bar(
            [x + width / 2 for x in xs],
            [r["generation_tokens_per_s"] or 0 for r in rows],
            width,
            label="generation phase",
            color="#3b7dd8",
        )
        ax.set_xticks(xs, [r["shard"] for r in rows], rotation=45 if len(rows) > 8 else 0)
        ax.set_xlabel("shard")
        ax.set_ylabel("completion tokens / s")
        ax.legend()
    ax.set_title("Generation throughput per shard")
    _save(fig, out)


def plot_generation_lengths(summaries: list[dict], out: str | Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [
        ("completion_histogram", TOKEN_EDGES, "response length (completion tokens per turn)"),
        ("thinking_chars_histogram", CHAR_EDGES, "thinking length (characters)"),
        ("answer_chars_histogram", CHAR_EDGES, "answer length (characters, after thinking)"),
    ]
    for ax, (key, edges, title) in zip(axes, panels):
        counts = _sum_lists(s[key] for s in summaries)
        if not counts or not sum(counts):
            _empty(ax, f"{title}: no data")
            continue
        last = max(i for i, c in enumerate(counts) if c) + 1
        _bars(ax, bin_labels(edges)[:last], counts[:last], title, "turns", rotate=True)
    _save(fig, out)


def plot_finish_reasons(summaries: list[dict], out: str | Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(summaries) + 3), 3.4))
    reasons = sorted({r for s in summaries for r in s["finish_reasons"]})
    if not reasons:
        _empty(ax, "no generated turns")
    else:
        series = {r: [s["finish_reasons"].get(r, 0) for s in summaries] for r in reasons}
        colors = {"stop": "#2e9d5b", "length": "#f0a030", "error": "#d64545"}
        _stacked_per_shard(ax, [s["shard"] for s in summaries], series, "turns", colors)
    ax.set_title("Finish reasons per shard")
    _save(fig, out)


def plot_supervised_histogram(stats: list[dict], out: str | Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    if not stats:
        _empty(ax, "no tokenized shards")
    else:
        edges = stats[0]["supervised_histogram"]["edges"]
        for s in stats:
            if s["supervised_histogram"]["edges"] != edges:
                raise ValueError(f"shard {s.get('shard')}: supervised histogram bins differ from the others")
        counts = _sum_lists(s["supervised_histogram"]["counts"] for s in stats)
        last = max((i for i, c in enumerate(counts) if c), default=0) + 1
        total = sum(s.get("supervised_tokens_total", 0) for s in stats)
        _bars(
            ax,
            bin_labels(edges)[:last],
            counts[:last],
            f"Supervised tokens per sequence ({total:,} in all)",
            "sequences",
            rotate=True,
        )
    _save(fig, out)


def plot_degenerate_reasons(stats: list[dict], out: str | Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(stats) + 3), 3.4))
    reasons = sorted({r for s in stats for r in s.get("reasons", {})})
    labels = [shard_label(s.get("shard", "")) for s in stats]
    if not reasons:
        _empty(ax, f"no degenerate samples in {len(stats)} shards")
    else:
        series = {r: [s.get("reasons", {}).get(r, 0) for s in stats] for r in reasons}
        _stacked_per_shard(ax, labels, series, "samples", legend_size=7)
    ax.set_title("Degenerate-sample reasons per shard")
    _save(fig, out)


def plot_storage(use: dict[str, int], out: str | Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = list(use)
    biggest = max(use.values(), default=0)
    exponent = max((e for e in range(5) if biggest >= 1024**e), default=0)
    unit = ["B", "KiB", "MiB", "GiB", "TiB"][exponent]
    scaled = [v / 1024**exponent for v in use.values()]
    total = sum(use.values()) / 1024**exponent
    _bars(ax, labels, scaled, f"Storage per stage ({total:,.2f} {unit} in all)", unit, "#6a5acd", True)
    positive = [v for v in scaled if v > 0]
    if positive and max(positive) / min(positive) > 1000:
        ax.set_yscale("log")  # hidden states and logs differ by orders of magnitude
    _save(fig, out)


def plot_training_curves(points: list[dict], out: str | Path, segment_taus: list[dict] = ()) -> None:
    """Loss, accuracy, simulated acceptance length, learning rate, tokens/s against the step,
    and the last step's accuracy per draft position; with ``segment_taus`` (rule segment_tau's
    records), each segment's τ in the loop beside the loss, at the segment's last step."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.4))
    algorithm = next((p["algorithm"] for p in reversed(points) if p.get("algorithm")), "dflash")
    fig.suptitle(f"drafter: {ALGORITHM_NAMES.get(algorithm, algorithm)}")
    panels = [
        ("loss", "loss"),
        ("accuracy", "accuracy"),
        ("accept_len", "simulated acceptance length"),
        ("lr", "learning rate"),
        ("tokens_per_s", "tokens / s"),
    ]
    # DFlash2: beside the logits' argmax, the selector's teacher-forced walk (what it proposes).
    extra = {"accuracy": "selector_accuracy", "accept_len": "selector_accept_len"}
    for ax, (key, title) in zip(axes.flat, panels):
        xy = [(p["step"], p[key]) for p in points if p.get(key) is not None]
        if not xy:
            _empty(ax, f"{title}: no data")
            continue
        ax.plot(*zip(*xy), color="#3b7dd8", linewidth=1.2, label="logits argmax")
        walk = [(p["step"], p[extra[key]]) for p in points if p.get(extra.get(key, "")) is not None]
        if walk:
            ax.plot(*zip(*walk), color="#d8663b", linewidth=1.2, label="selector walk")
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
    if segment_taus:
        _segment_taus_beside(axes.flat[0], segment_taus)
    ax = axes.flat[5]
    last = next((p["accuracy_per_position"] for p in reversed(points) if p.get("accuracy_per_position")), None)
    if last:
        _bars(ax, [str(i + 1) for i in range(len(last))], last, "accuracy per draft position (last step)")
        ax.set_xlabel("position in block")
    else:
        _empty(ax, "accuracy per position: no data")
    _save(fig, out)


def _segment_taus_beside(ax, records: list[dict]) -> None:
    """τ per segment (the loop's, on held-out prompts) on a second axis of the loss panel, each
    point labelled with its value: the drafter's real acceptance as training goes."""
    xy = sorted((r["step"], r["tau"]) for r in records if r.get("step") is not None)
    if not xy:
        return
    right = ax.twinx()
    right.plot(*zip(*xy), color="#2e9d5b", marker="o", markersize=4, linewidth=1.2, label="τ per segment (loop)")
    for step, tau in xy:
        right.annotate(f"τ {tau:.2f}", (step, tau), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    right.set_ylabel("τ (loop, held-out)", color="#2e9d5b")
    low, high = min(t for _, t in xy), max(t for _, t in xy)
    right.set_ylim(min(1.0, low), high + max(0.5, 0.2 * (high - low)))
    ax.set_title("loss, and τ per segment")
    right.legend(fontsize=7, loc="upper right")


def plot_acceptance(metrics: dict, out: str | Path) -> None:
    """Acceptance rate per draft position (overall and per prompt set), the accepted-length
    histogram, and the mean acceptance length τ per prompt set."""
    if not isinstance(metrics.get("overall"), dict):
        raise ValueError("evaluation metrics have no 'overall' section")
    plt = _pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.6))
    overall = metrics["overall"]
    sets = {k: v for k, v in (metrics.get("prompt_sets") or {}).items() if isinstance(v, dict)}
    for name, values, style in [("overall", overall, "-")] + [(k, v, "--") for k, v in sets.items()]:
        rates = values.get("per_position") or []
        left.plot(range(1, len(rates) + 1), rates, style, marker="o", markersize=3, label=name)
    left.set_title("acceptance rate per draft position")
    left.set_xlabel("position")
    left.set_ylim(0, 1.02)
    left.legend(fontsize=7)
    hist = overall.get("accept_hist") or []
    _bars(middle, [str(i) for i in range(len(hist))], hist, "accepted draft tokens per verify step", "steps")
    middle.set_xlabel("accepted length")
    algorithm = (metrics.get("settings") or {}).get("algorithm", "dflash")
    fig.suptitle(f"drafter: {ALGORITHM_NAMES.get(algorithm, algorithm)}", fontsize=9)
    names = ["overall", *sets]
    taus = [overall.get("tau") or 0] + [sets[k].get("tau") or 0 for k in sets]
    engine = metrics.get("engine") if isinstance(metrics.get("engine"), dict) else None
    if engine is None:
        _bars(right, names, taus, f"acceptance length τ (overall {overall.get('tau') or 0:.2f})", "τ", "#2e9d5b", True)
    else:
        # The loop's τ and the serving engine's side by side: the gap the engine parity gate checks.
        engine_sets = engine.get("prompt_sets") or {}
        served = [engine["overall"].get("tau") or 0] + [(engine_sets.get(k) or {}).get("tau") or 0 for k in sets]
        xs = list(range(len(names)))
        right.bar([x - 0.2 for x in xs], taus, 0.4, label="loop", color="#2e9d5b")
        right.bar(
            [x + 0.2 for x in xs],
            served,
            0.4,
            label=f"{engine.get('name')} {engine.get('version') or ''}",
            color="#3b7dd8",
        )
        right.set_xticks(xs, names, rotation=45)
        right.set_ylabel("τ")
        right.legend(fontsize=7)
        right.set_title(
            f"acceptance length τ: loop {overall.get('tau') or 0:.2f}, "
            f"{engine.get('name')} {engine['overall'].get('tau') or 0:.2f}"
        )
    _save(fig, out)


# ---------------------------------------------------------------- for the train and evaluate rules


def write_training_report(
    run_url: str, segments: Iterable[int], out: str | Path, segment_taus: Iterable[str | Path] = ()
) -> None:
    """The training figure (caption report/training.rst) from the ``metrics.jsonl`` that each
    training segment keeps in the run's ``_progress/`` (read-only), with the τ of each segment's
    record in ``segment_taus`` (rule segment_tau's outputs)."""
    from dflash_pipeline.evaluation.segment_tau import check_record

    taus = [check_record(read_json(path), str(path)) for path in segment_taus]
    from dflash_pipeline.core.storage import ReadOnlyStorage
    from dflash_pipeline.core.storage import StorageError

    run = ReadOnlyStorage.open(run_url)
    points, missing = [], []
    for segment in segments:
        key = layout.train_progress_prefix(segment) + layout.TRAIN_METRICS
        try:
            points.extend(read_train_metrics(run.read_text(key)))
        except StorageError:
            missing.append(run.url + "/" + key)
    if not points:
        raise ValueError(f"no training step recorded; missing: {', '.join(missing) or 'none'}")
    plot_training_curves(sorted(points, key=lambda p: p["step"]), out, taus)


def write_evaluation_report(eval_metrics: str | Path, out: str | Path) -> None:
    """The acceptance figure (caption report/acceptance.rst) from outputs/evaluate-metrics.json:
    flag it ``report(..., caption="../report/acceptance.rst", category="5. Evaluation")``."""
    plot_acceptance(read_json(eval_metrics), out)
