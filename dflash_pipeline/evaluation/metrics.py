"""Acceptance metrics: per prompt, per prompt set and overall, in the metrics JSON's fixed format.

- tau (acceptance length): tokens committed per target verify step, A + 1 per step (the accepted
  drafts plus the target's own token), in [1, B]. A group's tau is its committed tokens over its
  verify steps (SGLang's ``spec_accept_length`` convention); ``tau_mean_of_prompts`` is the mean of
  the per-prompt values (the DFlash authors' benchmark convention).
- accept_hist: counts of verify steps that accepted A = 0..B-1 drafts.
- per_position: for draft position k = 1..B-1, the share of verify steps whose draft k was
  accepted (A >= k).
- speedup_estimate: time per generated token of plain decoding over that of the loop, measured on
  the same prompts with the same target (see ``SPEEDUP_METHOD``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from dflash_pipeline.evaluation.loop import PlainTrace, SpeculativeTrace

TAU_DEFINITION = (
    "tokens committed per target verify step (accepted drafts + the target's own token); "
    "a group's tau is its committed tokens over its verify steps"
)
SPEEDUP_METHOD = (
    "wall-clock seconds per generated token of plain one-token-per-forward decoding divided by "
    "that of the speculative loop (drafter included), same target, device, prompts and settings; "
    "prompt prefill counted in both"
)


@dataclass
class PromptResult:
    """One prompt's acceptance record; the unit every aggregate is built from."""

    id: str
    prompt_set: str
    block_size: int
    accept_hist: list[int] | None  # None when the engine did not report one
    committed_tokens: int  # tokens committed by verify steps
    verify_steps: int
    generated_tokens: int
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    seconds: float | None = None  # the loop's wall time
    plain_seconds: float | None = None  # plain decoding's wall time on the same prompt
    plain_tokens: int | None = None
    extra: dict | None = None  # e.g. the lossless verdict
    trajectory: str | None = None  # trajectory_digest of the generated tokens

    @classmethod
    def from_traces(
        cls,
        id: str,
        prompt_set: str,
        prompt_tokens: int,
        trace: SpeculativeTrace,
        plain: PlainTrace | None = None,
    ) -> PromptResult:
        return cls(
            id=id,
            prompt_set=prompt_set,
            block_size=trace.block_size,
            accept_hist=accept_histogram(trace.accepted_lengths, trace.block_size),
            committed_tokens=sum(a + 1 for a in trace.accepted_lengths),
            verify_steps=len(trace.accepted_lengths),
            generated_tokens=len(trace.tokens),
            prompt_tokens=prompt_tokens,
            finish_reason=trace.finish_reason,
            seconds=trace.seconds,
            plain_seconds=plain.seconds if plain else None,
            plain_tokens=len(plain.tokens) if plain else None,
        )

    @property
    def tau(self) -> float | None:
        return self.committed_tokens / self.verify_steps if self.verify_steps else None

    def as_dict(self) -> dict:
        row = {
            "id": self.id,
            "prompt_set": self.prompt_set,
            "tau": _round(self.tau),
            "accept_hist": self.accept_hist,
            "per_position": per_position_acceptance(self.accept_hist),
            "generated_tokens": self.generated_tokens,
            "verify_steps": self.verify_steps,
            "committed_tokens": self.committed_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "seconds": _round(self.seconds),
            "plain_seconds": _round(self.plain_seconds),
            "plain_tokens": self.plain_tokens,
            "trajectory": self.trajectory,
        }
        row.update(self.extra or {})
        return row


def trajectory_digest(tokens: Iterable[int], stop_token_ids: Iterable[int]) -> str:
    """A short digest of the generated tokens before the first stop token: two decodes of one
    prompt produced the same text iff their digests are equal (engines differ in whether they
    return the stop token itself, so it is left out)."""
    stop = set(stop_token_ids)
    kept = []
    for token in tokens:
        if token in stop:
            break
        kept.append(int(token))
    return hashlib.sha256(",".join(map(str, kept)).encode()).hexdigest()[:16]


def accept_histogram(accepted_lengths: list[int], block_size: int) -> list[int]:
    hist = [0] * block_size
    for accepted in accepted_lengths:
        if not 0 <= accepted < block_size:
            raise ValueError(f"accepted length {accepted} outside 0..{block_size - 1}")
        hist[accepted] += 1
    return hist


def per_position_acceptance(hist: list[int] | None) -> list[float] | None:
    """Share of steps whose draft k (k = 1..B-1) was accepted, i.e. A >= k."""
    if hist is None:
        return None
    steps = sum(hist)
    if not steps:
        return [0.0] * (len(hist) - 1)
    return [_round(sum(hist[k:]) / steps) for k in range(1, len(hist))]


def aggregate(results: list[PromptResult]) -> dict:
    """The summary keys of a group of prompts (overall, or one prompt set)."""
    steps = sum(r.verify_steps for r in results)
    committed = sum(r.committed_tokens for r in results)
    hists = [r.accept_hist for r in results]
    hist = None
    if results and all(h is not None for h in hists):
        width = max(len(h) for h in hists)
        hist = [sum(h[k] if k < len(h) else 0 for h in hists) for k in range(width)]
    taus = [r.tau for r in results if r.tau is not None]
    return {
        "tau": _round(committed / steps) if steps else None,
        "tau_mean_of_prompts": _round(sum(taus) / len(taus)) if taus else None,
        "accept_hist": hist,
        "per_position": per_position_acceptance(hist),
        "generated_tokens": sum(r.generated_tokens for r in results),
        "verify_steps": steps,
        "committed_tokens": committed,
        "prompts": len(results),
        "speedup_estimate": _round(speedup_estimate(results)),
    }


def speedup_estimate(results: list[PromptResult]) -> float | None:
    """Plain decoding's seconds per token over the loop's, summed over the group."""
    timed = [r for r in results if r.seconds and r.plain_seconds and r.plain_tokens]
    if not timed:
        return None
    loop_per_token = sum(r.seconds for r in timed) / sum(r.generated_tokens for r in timed)
    plain_per_token = sum(r.plain_seconds for r in timed) / sum(r.plain_tokens for r in timed)
    return plain_per_token / loop_per_token


def metrics_document(results: list[PromptResult], settings: dict, **sections) -> dict:
    """The metrics JSON: overall, per prompt set, per prompt, settings and extra sections."""
    sets: dict[str, list[PromptResult]] = {}
    for result in results:
        sets.setdefault(result.prompt_set, []).append(result)
    return {
        "overall": aggregate(results),
        "prompt_sets": {name: aggregate(group) for name, group in sorted(sets.items())},
        "per_prompt": [r.as_dict() for r in results],
        "settings": settings,
        "definitions": {"tau": TAU_DEFINITION, "speedup_estimate": SPEEDUP_METHOD},
        **sections,
    }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)
