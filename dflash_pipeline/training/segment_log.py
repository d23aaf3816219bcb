"""The segment's metrics (metrics.jsonl, one object per step) and telemetry, and what the end of
each step decides (``step_boundary``): the bookkeeping around the training loop."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import write_telemetry
from dflash_pipeline.core.storage import Storage


class MetricsLog:
    """metrics.jsonl (one object per step) and telemetry.json in the segment's progress area,
    rewritten as whole objects (S3 has no append) every few seconds."""

    def __init__(self, storage: Storage, segment: int, steps: tuple[int, int], every_s: float):
        self.storage = storage
        self.prefix = layout.train_progress_prefix(segment)
        self.segment = segment
        self.steps = steps
        self.every_s = every_s
        self.records: list[dict] = []
        self.last_flush = 0.0
        self.started = time.time()

    def resume_from(self, step: int) -> None:
        key = self.prefix + layout.TRAIN_METRICS
        if self.storage.exists(key):
            lines = self.storage.read_text(key).splitlines()
            self.records = [r for r in map(json.loads, filter(None, lines)) if r["step"] < step]

    def add(self, record: dict) -> None:
        self.records.append(record)
        if time.time() - self.last_flush >= self.every_s:
            self.flush("running")

    def flush(self, state: str) -> None:
        text = "".join(json.dumps(r) + "\n" for r in self.records)
        self.storage.write_text(self.prefix + layout.TRAIN_METRICS, text)
        last = self.records[-1] if self.records else {}
        done = (last.get("step", self.steps[0] - 1) + 1) - self.steps[0]
        total = self.steps[1] - self.steps[0]
        rate = last.get("steps_per_s")
        write_telemetry(
            self.storage,
            self.prefix,
            {"stage": "train", "segment": self.segment},
            {
                "state": state,
                "step": last.get("step"),
                "steps_done": done,
                "steps_total": total,
                "tokens_per_s": last.get("tokens_per_s"),
                "eta_s": round((total - done) / rate, 1) if rate else None,
            },
        )
        self.last_flush = time.time()


@dataclass(frozen=True)
class Boundary:
    """What the end of a step decides; every rank decides alike (``step_boundary`` of flags
    OR-ed over the ranks)."""

    commit: bool  # the background save in flight finished on every rank: it becomes the latest
    reserve: bool  # the job's first step: the background saves' buffers are allocated now
    stop: str | None  # why the segment stops here ("SIGTERM", "driver gone"); None: it goes on
    last: bool  # the segment's last step: its final checkpoint follows
    save: bool  # a periodic checkpoint is due (never at the last step, nor when stopping)


def step_boundary(
    step: int,
    steps: tuple[int, int],
    every: int,
    *,
    first: bool,
    checkpoint_async: bool,
    pending: bool,
    writing: bool,
    stop: bool,
    orphaned: bool,
) -> Boundary:
    """The decisions once ``step`` steps are done in a segment of ``steps`` [start, end) that
    checkpoints every ``every`` steps. ``first``: the job's first step; ``pending``: a background
    save is in flight, ``writing``: still written on some rank; ``stop``: a SIGTERM on some rank,
    ``orphaned``: the driver is gone (a SIGTERM names the stop when both came)."""
    start, end = steps
    last = step >= end
    why = "SIGTERM" if stop else "driver gone" if orphaned else None
    return Boundary(
        commit=pending and not writing,
        reserve=checkpoint_async and first,
        stop=why,
        last=last,
        save=why is None and not last and (step - start) % every == 0,
    )
