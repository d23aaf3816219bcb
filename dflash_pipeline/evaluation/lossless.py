"""Lossless check: in greedy mode the loop must produce exactly the target's plain greedy decoding.

In fp32 any difference is a bug. In bf16/fp16, verifying a block in one forward and decoding one
token at a time may round differently, and where the target's top two logits are nearly tied the
argmax can flip; such a divergence is reported with the target's logit margin there and fails only
when that margin is above the configured tolerance (a clear choice decided differently means
the loop, not rounding, changed the output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Margins under which a divergence counts as rounding in reduced precision (logit units).
DEFAULT_MARGIN_TOLERANCE = {
    torch.float32: 0.0,
    torch.float64: 0.0,
    torch.bfloat16: 0.25,
    torch.float16: 0.1,
}


def default_margin_tolerance(dtype) -> float:
    """The tolerance of ``dtype`` (a torch dtype, or its name as engines take it: "bfloat16");
    0 for full precision and for None (an engine's own default dtype is not known here)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return DEFAULT_MARGIN_TOLERANCE.get(dtype, 0.0)


class LosslessError(AssertionError):
    """Greedy speculative output differs from plain greedy decoding beyond rounding."""


@dataclass(frozen=True)
class LosslessResult:
    equal: bool
    first_divergence: int | None  # index into the generated tokens
    loop_token: int | None
    plain_token: int | None
    margin: float | None  # target's top-1 minus top-2 logit at the divergence, plain decoding
    margin_tolerance: float

    @property
    def passed(self) -> bool:
        if self.equal:
            return True
        return self.margin is not None and self.margin <= self.margin_tolerance

    @property
    def verdict(self) -> str:
        if self.equal:
            return "exact"
        return "near_tie" if self.passed else "lost"

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "first_divergence": self.first_divergence,
            "loop_token": self.loop_token,
            "plain_token": self.plain_token,
            "margin": None if self.margin is None else round(self.margin, 6),
            "margin_tolerance": self.margin_tolerance,
        }


def compare_greedy(
    loop_tokens: list[int],
    plain_tokens: list[int],
    plain_margins: list[float],
    margin_tolerance: float,
) -> LosslessResult:
    """Find the first position where the two decodings differ (token, or one ending earlier)."""
    for index in range(max(len(loop_tokens), len(plain_tokens))):
        loop_token = loop_tokens[index] if index < len(loop_tokens) else None
        plain_token = plain_tokens[index] if index < len(plain_tokens) else None
        if loop_token != plain_token:
            margin = plain_margins[index] if index < len(plain_margins) else None
            return LosslessResult(False, index, loop_token, plain_token, margin, margin_tolerance)
    return LosslessResult(True, None, None, None, None, margin_tolerance)


def lossless_summary(results: dict[str, LosslessResult], margin_tolerance: float) -> dict:
    """The metrics JSON's ``lossless`` section for a greedy run."""
    failed = {pid: r.as_dict() for pid, r in results.items() if not r.passed}
    near = {pid: r.as_dict() for pid, r in results.items() if r.verdict == "near_tie"}
    return {
        "checked": True,
        "prompts": len(results),
        "exact": sum(r.equal for r in results.values()),
        "near_tie": len(near),
        "lost": len(failed),
        "near_ties": near,
        "failures": failed,
        "margin_tolerance": margin_tolerance,
        "passed": not failed,
    }


def failure_message(summary: dict) -> str:
    lines = [
        f"lossless check failed on {len(summary['failures'])} of {summary['prompts']} prompts: "
        "greedy speculative decoding changed the target's output (margin tolerance "
        f"{summary['margin_tolerance']})."
    ]
    for pid, fail in list(summary["failures"].items())[:10]:
        lines.append(
            f"  prompt {pid}: first divergence at generated token {fail['first_divergence']}: "
            f"loop {fail['loop_token']} vs plain {fail['plain_token']}, target margin "
            + (str(fail["margin"]) if fail["margin"] is not None else "unknown (none reported there)")
        )
    lines.append(
        "Usual causes: cache rollback after rejected drafts (hybrid GDN/linear-attention state), "
        "wrong positions for the verified block, a verify that reads logits one slot off."
    )
    return "\n".join(lines)
