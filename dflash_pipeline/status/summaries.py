"""What the status page shows of the run's training, evaluation, tune result, halt and lease: small documents built from
the objects the snapshot read (``status.snapshot``)."""

from __future__ import annotations

from dflash_pipeline.core import layout
from dflash_pipeline.core.lease import describe_holder
from dflash_pipeline.report import headline

# The page draws at most this many points per training curve (evenly thinned, last kept).
MAX_CURVE_POINTS = 600


def evaluation_summary(metrics) -> dict | None:
    if not isinstance(metrics, dict) or not isinstance(metrics.get("overall"), dict):
        return None
    overall = metrics["overall"]
    return {
        "tau": overall.get("tau"),
        "per_position": overall.get("per_position", []),
        "speedup_estimate": overall.get("speedup_estimate"),
        "prompt_sets": prompt_set_taus(metrics),
        "engine": engine_summary(metrics),
        "algorithm": (metrics.get("settings") or {}).get("algorithm", "dflash"),
    }


def prompt_set_taus(section: dict) -> dict:
    return {
        name: values.get("tau")
        for name, values in (section.get("prompt_sets") or {}).items()
        if isinstance(values, dict)
    }


def engine_summary(metrics: dict) -> dict | None:
    """The serving engine's measurement beside the loop's (evaluate.engine vllm or sglang)."""
    engine = metrics.get("engine")
    if not isinstance(engine, dict) or not isinstance(engine.get("overall"), dict):
        return None
    lossless = engine.get("lossless") or {}
    return {
        "name": engine.get("name"),
        "version": engine.get("version"),
        "tau": engine["overall"].get("tau"),
        "prompt_sets": prompt_set_taus(engine),
        "lossless": lossless.get("passed") if lossless.get("checked") else None,
        "parity": metrics.get("engine_parity"),
    }


def headline_summary(metrics, generate_records: list[dict], jobs) -> dict:
    """The page's headline strip (report/headline.py): τ, lossless, speed-up from the metrics;
    samples and tokens from the generate shards' counts; GPU-hours from the finished jobs of the
    Snakemake run the page follows (their wall time times their ``gpu`` resource)."""
    samples, tokens = headline.generated_counts(generate_records)
    finished = [j for j in jobs if j.state == "done" and j.gpus and j.started_at and j.ended_at]
    gpu_hours = sum((j.ended_at - j.started_at) * j.gpus for j in finished) / 3600 if finished else None
    figures = headline.headline(
        metrics,
        samples=samples,
        tokens=tokens,
        gpu_hours=gpu_hours,
        gpu_hours_of="this Snakemake run's finished jobs",
    )
    return {**figures, "rows": headline.headline_rows(figures)}


def tune_summary(result) -> dict | None:
    """The engine settings tune measured (``outputs/tune-result.json``): the choice and how many
    settings it was chosen from."""
    if not isinstance(result, dict) or not isinstance(result.get("choice"), dict):
        return None
    choice = result["choice"]
    return {
        "concurrency": choice.get("concurrency"),
        "mtp": bool(choice.get("mtp")),
        "tokens_per_s_per_gpu": choice.get("tokens_per_s_per_gpu"),
        "why": choice.get("why"),
        "engine": result.get("engine_version"),
        "device": result.get("device"),
        "measured_at_utc": result.get("created_utc"),
        "settings": len(result.get("settings") or []),
    }


def halt_summary(halt) -> dict | None:
    """What the page shows of the run's halt (``_progress/HALT.json``)."""
    if halt is None:
        return None
    if not isinstance(halt, dict):
        halt = {"cause": "unreadable halt object"}
    return {k: halt.get(k) for k in ("stage", "unit", "shard", "cause", "halted_at_utc")}


def lease_summary(lease, now: float) -> dict | None:
    """What the page shows of the run lease (``_progress/LEASE.json``): its holder, and whether
    it has expired (a driver that stopped without releasing it; the next one takes it over)."""
    if lease is None:
        return None
    if not isinstance(lease, dict):
        return {"holder": "unreadable lease object", "expired": True}
    try:
        expired = float(lease["expires_at"]) <= now
    except (KeyError, TypeError, ValueError):
        expired = True
    return {"holder": describe_holder(lease), "expired": expired}


def thin_points(points: list[dict], limit: int = MAX_CURVE_POINTS) -> list[dict]:
    """At most ``limit`` points, evenly spaced, always keeping the first and last."""
    if len(points) <= limit:
        return points
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def training_summary(segments: dict[int, dict]) -> dict:
    """The training section of the page: per segment its state and rate, the curves (thinned)."""
    points, rows = [], []
    for segment in sorted(segments):
        seg = segments[segment]
        points.extend(seg.get(layout.TRAIN_METRICS) or [])
        tele = seg.get("telemetry.json") or {}
        rows.append(
            {
                "segment": layout.segment_name(segment),
                "done": bool(seg.get("done")),
                "state": "done" if seg.get("done") else tele.get("state", "planned"),
                "step": tele.get("step"),
                "steps_done": tele.get("steps_done"),
                "steps_total": tele.get("steps_total"),
                "tokens_per_s": tele.get("tokens_per_s"),
                "eta_s": tele.get("eta_s"),
            }
        )
    points.sort(key=lambda p: p.get("step", 0))
    keys = ("step", "loss", "accuracy", "accept_len", "selector_accept_len", "tokens_per_s", "lr")
    curve = [{k: p.get(k) for k in keys} for p in thin_points(points)]
    # Which drafter is training: each step records it (metrics before DFlash2 existed: dflash).
    algorithm = next((p["algorithm"] for p in reversed(points) if p.get("algorithm")), "dflash" if points else None)
    return {"segments": rows, "curve": curve, "steps_logged": len(points), "algorithm": algorithm}
