"""Parity gate: the acceptance length simulated in training against the one of the real loop.

Training measures a teacher-forced acceptance length on held-out data; the real loop measures tau
with the served template, the exported checkpoint and the target's own outputs. A drafter that is
right in one and wrong in the other shows a gap; above the tolerance the gate fails with the usual
causes, so nobody trusts a training number the serving loop does not reproduce (dflash-spec.md
§6: train accuracy is not evidence of a working drafter).
"""

from __future__ import annotations

DEFAULT_TOLERANCE = 0.15

CAUSES_LOOP_BELOW = (
    "chat template or thinking mode differs between training data and evaluation prompts",
    "target layer ids off by one (tap = output of layer id = HF hidden_states[id + 1])",
    "RoPE fields of the exported drafter differ from training (rope_theta, scaling, partial factor)",
    "weights skipped or renamed on export/load (missing tensors load as random)",
    "sliding-window drafter layers run as full attention (or the reverse)",
    "mask token id or block size in the exported config differ from training",
    "the loop's target differs from the one that produced the training data (checkpoint, dtype)",
)
CAUSES_LOOP_ABOVE = (
    "the simulation ran on other data than the evaluation prompts (held-out split, prompt sets)",
    "the simulation counts acceptance differently (positions, block size, loss-mask positions)",
)


class ParityError(AssertionError):
    """The loop's tau and the simulated tau disagree beyond the tolerance."""


# A gap exactly at the tolerance passes; this absorbs the rounding of the division.
_GAP_EPSILON = 1e-9


def relative_gap(reference: float, measured: float, tolerance: float, what: str) -> tuple[float, bool]:
    """(measured - reference) / reference and whether its size is within the tolerance
    (inclusive); ``what`` names the reference in the error for a non-positive one."""
    if reference <= 0:
        raise ValueError(f"{what} must be positive, got {reference}")
    gap = (measured - reference) / reference
    return gap, abs(gap) <= tolerance + _GAP_EPSILON


def parity_report(
    simulated_tau: float, loop_tau: float, tolerance: float = DEFAULT_TOLERANCE
) -> dict:
    """Both numbers side by side; ``gap`` is (loop - simulated) / simulated."""
    gap, passed = relative_gap(simulated_tau, loop_tau, tolerance, "simulated tau")
    return {
        "simulated_tau": round(simulated_tau, 4),
        "loop_tau": round(loop_tau, 4),
        "gap": round(gap, 4),
        "tolerance": tolerance,
        "passed": passed,
    }


def check_parity(
    simulated_tau: float, loop_tau: float, tolerance: float = DEFAULT_TOLERANCE
) -> dict:
    """The report, or ParityError naming the gap and where to look."""
    report = parity_report(simulated_tau, loop_tau, tolerance)
    if report["passed"]:
        return report
    below = report["gap"] < 0
    causes = CAUSES_LOOP_BELOW if below else CAUSES_LOOP_ABOVE
    raise ParityError(
        f"acceptance parity failed: the real loop's tau {loop_tau:.3f} is "
        f"{abs(report['gap']):.0%} {'below' if below else 'above'} the simulated tau "
        f"{simulated_tau:.3f} from training (tolerance {tolerance:.0%}). Usual causes:\n"
        + "\n".join(f"  - {cause}" for cause in causes)
    )
