"""The speculative counters of one request, read from what a serving engine reports.

Where the counters come from:

- SGLang (``--speculative-algorithm DFLASH``) reports per request, in ``meta_info``:
  ``completion_tokens``, ``spec_verify_ct`` (target verify steps) and, in recent versions, a
  histogram of drafts accepted per step (``spec_correct_drafts_histogram``; older ones call it
  ``spec_accept_histogram``) and ``spec_num_correct_drafts``. Committed tokens are counted as the
  loop counts them: A + 1 per verify step (the histogram's sum of (A + 1) x count, else
  ``spec_num_correct_drafts`` + ``spec_verify_ct``), drafts accepted past a stop token or the
  token limit included. Not ``completion_tokens`` (SGLang's own ``spec_accept_length``), which adds
  the token prefill produced without a verify step and is cut at the stop token and the limit: on
  the demo's 160-token replies that moves a prompt's tau by +3% to -15%. Hybrid (GDN)
  targets need the ``extra_buffer`` mamba cache strategy for correct state rollback
  (``Cache.crop`` restores only the convolution window; see runner.py).
- vLLM (``--speculative-config '{"method": "dflash", ...}'``) has no per-request counters, only
  server-wide Prometheus counters on ``/metrics`` (vllm/v1/spec_decode/metrics.py,
  ``SpecDecodingProm``; labels ``engine``, ``model_name``, plus ``position`` on the per-position
  one). With requests sent one at a time, the difference of the counters around a request is that
  request's: every verify step of it is one draft, A accepted drafts add A to the accepted count
  and 1 to each position < A. So verify steps = delta drafts, committed tokens = delta accepted +
  delta drafts (A + 1 per step), and the count of steps with A >= k is the delta of position k - 1.
  Like the loop, the counters include drafts accepted past a stop token or the token limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SGLANG_HISTOGRAM_FIELDS = ("spec_correct_drafts_histogram", "spec_accept_histogram")

# vLLM 0.20.1, vllm/v1/spec_decode/metrics.py (SpecDecodingProm): Counter names as declared;
# the exposition text adds ``_total``. Summed over label sets (engine index, model name).
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class EngineResponseError(ValueError):
    """A reply or metrics page lacks the counters the measurement needs; names the prompt."""


@dataclass(frozen=True)
class SpecAcceptance:
    """One request's speculative counters, engine-independent."""

    committed_tokens: int  # tokens committed by verify steps
    verify_steps: int
    generated_tokens: int
    accept_hist: list[int] | None
    finish_reason: str
    output_ids: list[int] | None
    extra: dict = field(default_factory=dict)


def acceptance_from_response(data: dict, block_size: int, source: str = "response") -> SpecAcceptance:
    """Read one SGLang ``/generate`` reply's speculative counters; errors say what is missing."""
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineResponseError(f"{source}: SGLang reply has no meta_info object")
    for key in ("completion_tokens", "spec_verify_ct"):
        if not isinstance(meta.get(key), int):
            hint = (
                " (the server runs without speculative decoding: check --speculative-algorithm)"
                if key == "spec_verify_ct"
                else ""
            )
            raise EngineResponseError(f"{source}: meta_info.{key} missing or not an integer{hint}")
    hist = next((meta[k] for k in SGLANG_HISTOGRAM_FIELDS if meta.get(k)), None)
    if hist is not None:
        if not all(isinstance(c, int) and c >= 0 for c in hist) or len(hist) > block_size:
            raise EngineResponseError(f"{source}: acceptance histogram {hist} is not {block_size} or fewer counts")
        hist = list(hist) + [0] * (block_size - len(hist))
        if sum(hist) != meta["spec_verify_ct"]:
            raise EngineResponseError(
                f"{source}: acceptance histogram counts {sum(hist)} steps, spec_verify_ct says {meta['spec_verify_ct']}"
            )
    if hist is not None:
        committed = sum((accepted + 1) * count for accepted, count in enumerate(hist))
    elif isinstance(meta.get("spec_num_correct_drafts"), int):
        committed = meta["spec_num_correct_drafts"] + meta["spec_verify_ct"]
    else:
        # SGLang before the per-request draft counts: its own accept length's numerator.
        committed = meta["completion_tokens"]
    return SpecAcceptance(
        committed_tokens=committed,
        verify_steps=meta["spec_verify_ct"],
        generated_tokens=meta["completion_tokens"],
        accept_hist=hist,
        finish_reason=_sglang_finish_reason(meta),
        output_ids=data.get("output_ids"),
    )


def _sglang_finish_reason(meta: dict) -> str:
    reason = meta.get("finish_reason") or {}
    return reason.get("type", "unknown") if isinstance(reason, dict) else str(reason)


@dataclass(frozen=True)
class VllmCounters:
    """vLLM's speculative-decoding counters at one moment, summed over engines."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: dict[int, float]


def parse_vllm_metrics(text: str, source: str = "/metrics") -> VllmCounters:
    """The four spec-decode counters from a ``/metrics`` exposition text, summed over label sets
    (one per engine index with data parallelism), the per-position one kept per ``position``."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {VLLM_DRAFTS: 0.0, VLLM_DRAFT_TOKENS: 0.0, VLLM_ACCEPTED: 0.0}
    seen: set[str] = set()
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
                seen.add(sample.name)
            elif sample.name == VLLM_ACCEPTED_PER_POS:
                position = int(sample.labels["position"])
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
    missing = sorted(set(totals) - seen)
    if missing:
        raise EngineResponseError(
            f"{source}: no {', '.join(missing)} counters (the server runs without speculative "
            "decoding, or with --disable-log-stats)"
        )
    return VllmCounters(totals[VLLM_DRAFTS], totals[VLLM_DRAFT_TOKENS], totals[VLLM_ACCEPTED], per_pos)


def _count(value: float, what: str, source: str) -> int:
    """A counter delta as a count: integral and not negative (a restarted server fails here)."""
    if value < 0 or abs(value - round(value)) > 1e-6:
        raise EngineResponseError(f"{source}: {what} changed by {value}, not a count")
    return int(round(value))


def acceptance_histogram_from_counters(
    before: VllmCounters, after: VllmCounters, block_size: int, source: str = "request"
) -> tuple[int, int, int, list[int]]:
    """(verify steps, accepted drafts, draft tokens, histogram over A = 0..B-1) of the request
    between two readings. Steps with A >= k number delta position k - 1; with A >= 0 all steps."""
    steps = _count(after.drafts - before.drafts, "drafts", source)
    accepted = _count(after.accepted - before.accepted, "accepted tokens", source)
    draft_tokens = _count(after.draft_tokens - before.draft_tokens, "draft tokens", source)
    positions = sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))
    if positions != list(range(len(positions))) or len(positions) > block_size - 1:
        raise EngineResponseError(
            f"{source}: per-position counters cover positions {positions}, expected at most 0..{block_size - 2}"
        )
    at_least = [steps] + [
        _count(
            after.accepted_per_pos.get(k, 0.0) - before.accepted_per_pos.get(k, 0.0),
            f"accepted tokens at position {k}",
            source,
        )
        for k in positions
    ]
    at_least += [0] * (block_size + 1 - len(at_least))
    hist = [at_least[a] - at_least[a + 1] for a in range(block_size)]
    if any(c < 0 for c in hist) or sum(at_least[1:]) != accepted:
        raise EngineResponseError(
            f"{source}: per-position accepted counts {at_least[1:]} are inconsistent with "
            f"{steps} drafts and {accepted} accepted tokens"
        )
    return steps, accepted, draft_tokens, hist


def acceptance_from_counters(
    data: dict,
    before: VllmCounters,
    after: VllmCounters,
    block_size: int,
    source: str = "request",
) -> SpecAcceptance:
    """One vLLM ``/v1/completions`` reply with the counter readings around it."""
    choice = vllm_choice(data, source)
    steps, accepted, draft_tokens, hist = acceptance_histogram_from_counters(before, after, block_size, source)
    return SpecAcceptance(
        committed_tokens=accepted + steps,
        verify_steps=steps,
        generated_tokens=len(choice["token_ids"]),
        accept_hist=hist,
        finish_reason=choice.get("finish_reason") or "unknown",
        output_ids=list(choice["token_ids"]),
        extra={"draft_tokens": draft_tokens},
    )


def vllm_choice(data: dict, source: str) -> dict:
    choices = data.get("choices")
    if not choices or not isinstance(choices[0].get("token_ids"), list):
        raise EngineResponseError(
            f"{source}: vLLM reply has no choices[0].token_ids (the request must set return_token_ids)"
        )
    return choices[0]
