"""Divergence of a training run, judged step by step before the optimizer applies the step.

A run whose loss went NaN (a learning rate far too high, a broken batch, a bad kernel) goes on
"successfully" otherwise: every later segment trains NaN weights, and only the export refuses them,
GPU-days later. ``DivergenceGuard`` looks at each step's loss and gradient norm before the update:

- a non-finite loss or gradient norm, or
- a loss above ``max_loss_ratio`` times the mean of the last ``loss_window`` applied steps' losses
  (once that many are known)

is a diverged step. Up to ``max_skipped_steps`` of them per segment are skipped (the update is not
applied; the batch is spent), for the rare spike a healthy run survives; the next one halts the
run. The trainer then stops the segment without saving the state, halts the run
(``core.jobstate``) and names the step, the values and the last good checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """What one step's figures decide: ``apply`` the update, or not; ``halt`` the run."""

    apply: bool
    halt: bool = False
    reason: str | None = None  # why the step is not applied ("loss is not finite", ...)


APPLY = Verdict(apply=True)


class DivergenceGuard:
    """Judges each step (``judge``) from its loss and gradient norm; see the module's docstring.
    ``settings`` is the config's ``train.divergence`` section."""

    def __init__(self, settings: dict):
        self.max_loss_ratio = settings.get("max_loss_ratio")
        self.loss_window = int(settings.get("loss_window", 50))
        self.max_skipped_steps = int(settings.get("max_skipped_steps", 0))
        self.recent: deque[float] = deque(maxlen=max(1, self.loss_window))
        self.skipped = 0

    def seed(self, records: list[dict], count_skips: bool = True) -> None:
        """Take the losses (and, with ``count_skips``, the skips) of steps already done: this
        segment's before a resume, so that a resumed segment judges alike; the previous segment's
        for the running mean only (the skip budget is per segment)."""
        for record in records:
            if record.get("skipped"):
                self.skipped += 1 if count_skips else 0
            else:
                loss = record.get("total_loss", record.get("loss"))
                if isinstance(loss, (int, float)) and math.isfinite(loss):
                    self.recent.append(float(loss))

    def running_mean(self) -> float | None:
        """The mean loss of the window, once it is full (None before)."""
        if len(self.recent) < self.recent.maxlen:
            return None
        return sum(self.recent) / len(self.recent)

    def reason(self, loss: float, grad_norm: float) -> str | None:
        """Why these figures are a diverged step, or None."""
        if not math.isfinite(loss):
            return "loss is not finite"
        if not math.isfinite(grad_norm):
            return "gradient norm is not finite"
        mean = self.running_mean()
        if self.max_loss_ratio and mean is not None and mean > 0 and loss > self.max_loss_ratio * mean:
            return (
                f"loss is {loss / mean:.3g}x the mean {mean:.4g} of the last {len(self.recent)} steps "
                f"(train.divergence.max_loss_ratio {self.max_loss_ratio:g})"
            )
        return None

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        why = self.reason(loss, grad_norm)
        if why is None:
            self.recent.append(loss)
            return APPLY
        if self.skipped < self.max_skipped_steps:
            self.skipped += 1
            return Verdict(apply=False, reason=why)
        return Verdict(apply=False, halt=True, reason=why)
