"""What the status page shows of the run's training, evaluation, tune result, halt and lease: small documents built from
the objects the snapshot read (``status.snapshot``)."""

from __future__ import annotations

import re

from dflash_pipeline.core import layout
from dflash_pipeline.core.lease import describe_holder
from dflash_pipeline.evaluation.segment_tau import SegmentTauError, check_record
from dflash_pipeline.report import headline

# The page draws at most this many points per training curve (evenly thinned, last kept).
MAX_CURVE_POINTS = 600

# What a figure from before a forced rerun says beside its value, until the rerun measures it anew.
OLD_MARK = " (old: from before the rerun)"
# Progress a long job without telemetry logs, e.g. the demo target's build:
# "step 20/200, 1m05s elapsed, ~9m45s left".
LOG_STEP = re.compile(r"\bstep (\d+)/(\d+)\b")
LOG_LEFT = re.compile(r"~(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)? left\b")


def evaluation_summary(metrics, old: bool = False) -> dict | None:
    """``old``: from before a forced rerun (``evaluation_is_old``), until evaluate writes anew."""
    if not isinstance(metrics, dict) or not isinstance(metrics.get("overall"), dict):
        return None
    overall = metrics["overall"]
    return {
        "old": old,
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


def headline_summary(
    metrics,
    generate_records: list[dict],
    gpu_hours: float | None,
    evaluate_engine: str | None = None,
    old: bool = False,
) -> dict:
    """The page's headline strip (report/headline.py), the report's figures from the same
    sources: τ, lossless, speed-up from the metrics; samples and tokens from the generate shards'
    counts; GPU-hours from the job benchmarks in the run root (the snapshot sums them). ``old``:
    the metrics are from before a forced rerun (``evaluation_is_old``); their rows say so."""
    samples, tokens = headline.generated_counts(generate_records)
    figures = headline.headline(
        metrics,
        samples=samples,
        tokens=tokens,
        gpu_hours=gpu_hours,
        gpu_hours_of=headline.GPU_HOURS_OF,
        evaluate_engine=evaluate_engine,
    )
    rows = headline.headline_rows(figures)
    if old:
        for row in rows:
            if row["key"] in OLD_FIGURES and row["text"] not in (None, headline.NOT_CONFIGURED):
                row["text"] += OLD_MARK
    return {**figures, "old": old, "rows": rows}


# The headline's figures that evaluate measures (the others are counts of the run so far).
OLD_FIGURES = ("tau_loop", "tau_engine", "lossless", "speedup")


def evaluation_is_old(eval_mtime: float | None, train_complete: bool, newer_than_eval: list[float]) -> bool:
    """Evaluate's metrics are from before a forced rerun while training is being redone (a
    segment not done again yet) or anything evaluate reads (a segment's manifest, the exported
    drafter) was written after them."""
    if eval_mtime is None:
        return False
    return not train_complete or any(t > eval_mtime for t in newer_than_eval)


def log_progress(lines: list[str]) -> dict:
    """Steps and the time left from the last log line that states them (a job without
    telemetry that logs its progress); {} when no line does."""
    for line in reversed(lines):
        step, left = LOG_STEP.search(line), LOG_LEFT.search(line)
        if not step:
            continue
        done, total = int(step[1]), int(step[2])
        found = {"samples_done": done, "samples_total": total}
        if total:
            found["percent"] = round(100.0 * done / total, 2)
        if left and any(left.groups()):
            hours, minutes, seconds = (int(g or 0) for g in left.groups())
            found["eta_s"] = float(hours * 3600 + minutes * 60 + seconds)
        return found
    return {}


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


def training_summary(segments: dict[int, dict], segment_taus: dict[int, tuple[object, float]] | None = None) -> dict:
    """The training section of the page: per segment its state, rate and τ in the loop (rule
    segment_tau's record with its mtime, in ``segment_taus``), the curves (thinned)."""
    points, rows, taus = [], [], []
    # Segments form a chain: one after a segment not done (again) is from an earlier run (a
    # forced rerun redoes them in order), so its points would join the new curve to the old.
    redoing = False
    for segment in range(max(segments) + 1 if segments else 0):
        seg = segments.get(segment)
        if seg is None:  # nothing of it yet: the ones after it cannot be this run's
            redoing = True
            continue
        tele = seg.get("telemetry.json") or {}
        old = redoing
        if not old:
            points.extend(seg.get(layout.TRAIN_METRICS) or [])
        redoing = redoing or not seg.get("done")
        tau = segment_tau(seg, (segment_taus or {}).get(segment), old)
        if tau is not None:
            taus.append({"segment": layout.segment_name(segment), "step": tau["step"], "tau": tau["tau"]})
        rows.append(
            {
                "segment": layout.segment_name(segment),
                "done": bool(seg.get("done")) and not old,
                "state": "old, from before the rerun"
                if old
                else ("done" if seg.get("done") else tele.get("state", "planned")),
                "step": tele.get("step"),
                "steps_done": tele.get("steps_done"),
                "steps_total": tele.get("steps_total"),
                "tokens_per_s": tele.get("tokens_per_s"),
                "eta_s": tele.get("eta_s"),
                "tau": None if tau is None else tau["tau"],
            }
        )
    points.sort(key=lambda p: p.get("step", 0))
    keys = ("step", "loss", "accuracy", "accept_len", "selector_accept_len", "tokens_per_s", "lr")
    curve = [{k: p.get(k) for k in keys} for p in thin_points(points)]
    # Which drafter is training: each step records it (metrics before DFlash2 existed: dflash).
    algorithm = next((p["algorithm"] for p in reversed(points) if p.get("algorithm")), "dflash" if points else None)
    return {
        "segments": rows,
        "curve": curve,
        "steps_logged": len(points),
        "algorithm": algorithm,
        "segment_taus": taus,
    }


def segment_tau(seg: dict, found: tuple[object, float] | None, old: bool) -> dict | None:
    """A done segment's τ record, if it is this segment's: written after its manifest (a record
    from before a rerun of the segment is not) and valid (``evaluation.segment_tau.check_record``)."""
    if found is None or old or not seg.get("done"):
        return None
    record, written_at = found
    if written_at < seg.get("manifest_at", 0):
        return None
    try:
        return check_record(record, "segment tau")
    except SegmentTauError:
        return None


def stage_rate(running: list[dict], stage: str) -> float | None:
    """Tokens/s of a stage's running jobs together (None: none of them says)."""
    rows = [r for r in running if r["stage"] == stage and r["tokens_per_s"] is not None]
    return round(sum(r["tokens_per_s"] for r in rows), 2) if rows else None


def running_row(stage, rule, shard, job, tele, now: float, log_tail: list[str]) -> dict:
    """A running job's row: its telemetry, else the progress its log's steps show (the demo
    target's build has no telemetry), and the log's last lines."""
    tele = tele or log_progress(log_tail)
    total = tele.get("samples_total")
    done = tele.get("samples_done")
    percent = round(100.0 * done / total, 2) if total and done is not None else None
    started = job.started_at if job is not None else None
    return {
        "stage": stage,
        "rule": rule,
        "shard": layout.shard_name(shard) if shard is not None else None,
        "jobid": job.jobid if job is not None else None,
        "samples_done": done,
        "samples_total": total,
        "percent": percent,
        "tokens_per_s": tele.get("tokens_per_s"),
        "eta_s": tele.get("eta_s"),
        "errors": tele.get("errors"),
        "elapsed_s": round(now - started, 1) if started else tele.get("elapsed_s"),
        "updated_at": tele.get("updated_at"),
        "log_tail": log_tail,
    }


def failed_row(stage, rule, shard, job, tele, log_tail: list[str]) -> dict:
    """A failed job's row: Snakemake's message and the log's last lines."""
    return {
        "stage": stage,
        "rule": rule,
        "shard": layout.shard_name(shard) if shard is not None else None,
        "jobid": job.jobid if job is not None else None,
        "message": (job.message if job is not None else "") or "",
        "at": job.ended_at if job is not None else (tele or {}).get("updated_at"),
        "log_tail": log_tail,
    }
