"""Requests to a serving engine during a measurement: every prompt sent as token ids, one at a
time (vLLM's counters are server-wide: the difference around one request is that request's),
its reply and speculative counters read into a ``SpecAcceptance`` (``engine_counters``), and the
plain server's greedy outputs for the lossless check.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.engines.client import CompletionsAdapter, EngineClient, Sampling, SglangAdapter, unless_hung
from dflash_pipeline.evaluation.engine_counters import (
    EngineResponseError,
    SpecAcceptance,
    VllmCounters,
    acceptance_from_counters,
    acceptance_from_response,
    parse_vllm_metrics,
    vllm_choice,
)
from dflash_pipeline.evaluation.metrics import PromptResult

log = logging.getLogger(__name__)

# A server silent this long stops the evaluation (the `evaluate` section's default).
HUNG_AFTER_S = schema_defaults("evaluate")["engine_hung_after_s"]


def prompt_result(
    prompt_id: str, prompt_set: str, prompt_tokens: int, acceptance: SpecAcceptance, block_size: int
) -> PromptResult:
    return PromptResult(
        id=prompt_id,
        prompt_set=prompt_set,
        block_size=block_size,
        accept_hist=acceptance.accept_hist,
        committed_tokens=acceptance.committed_tokens,
        verify_steps=acceptance.verify_steps,
        generated_tokens=acceptance.generated_tokens,
        prompt_tokens=prompt_tokens,
        finish_reason=acceptance.finish_reason,
        extra=dict(acceptance.extra) or None,
    )


# --- requests ------------------------------------------------------------------------------------


# Top logprobs asked of the plain server per generated token: the first two give the target's
# logit margin there (log-softmax shifts every logit by the same amount, so the difference of two
# logprobs is the difference of their logits), which tells a near tie from a lost token.
MARGIN_TOP_LOGPROBS = 2


class _RawSglangAdapter(SglangAdapter):
    """SGLang's ``/generate`` request, with the whole reply kept (meta_info included); with
    ``margins`` the top two logprobs of every generated token are asked back."""

    def __init__(self, margins: bool = False):
        self.margins = margins

    def request(self, prompt_text: str, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict]:
        path, body = super().request(prompt_text, prompt_ids, sampling)
        if self.margins:
            body.update(return_logprob=True, top_logprobs_num=MARGIN_TOP_LOGPROBS)
        return path, body

    def parse(self, data: dict) -> dict:
        return data


class _VllmTokenIdsAdapter(CompletionsAdapter):
    """vLLM's ``/v1/completions`` with the prompt as token ids (exactly what the loop decodes, no
    re-tokenization) and the generated token ids asked back; the whole reply kept."""

    def __init__(self, model: str, margins: bool = False):
        super().__init__(model, strict=False, token_ids=True)
        self.margins = margins

    def request(self, prompt_text: str, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict]:
        path, body = super().request(prompt_text, prompt_ids, sampling)
        if self.margins:
            # Keys "token_id:<id>": two tokens that decode to the same text stay two entries.
            body.update(logprobs=MARGIN_TOP_LOGPROBS, return_tokens_as_token_ids=True)
        return path, body

    def parse(self, data: dict) -> dict:
        return data


def _adapter(engine: str, model: str, margins: bool = False):
    return _RawSglangAdapter(margins) if engine == "sglang" else _VllmTokenIdsAdapter(model, margins)


def output_ids(engine: str, data: dict, source: str = "reply") -> list[int]:
    """The generated token ids of a reply (from either server kind)."""
    if engine == "vllm":
        return list(vllm_choice(data, source)["token_ids"])
    ids = data.get("output_ids")
    if not isinstance(ids, list):
        raise EngineResponseError(f"{source}: SGLang reply has no output_ids")
    return ids


def top2_margins(engine: str, data: dict, source: str = "reply") -> list[float | None]:
    """The target's logit margin (top-1 minus top-2 logprob) at every generated token of a reply
    that asked for top logprobs; None where the engine gave fewer than two finite values.

    vLLM: ``choices[0].logprobs.top_logprobs``, one {token: logprob} dict per token (the sampled
    token is added when outside the top k, so a dict may hold k + 1). SGLang:
    ``meta_info.output_top_logprobs``, one list of (logprob, token id, text) per token."""
    if engine == "vllm":
        per_token = (vllm_choice(data, source).get("logprobs") or {}).get("top_logprobs")
        values = [list((entry or {}).values()) for entry in per_token or []]
    else:
        per_token = (data.get("meta_info") or {}).get("output_top_logprobs")
        values = [[item[0] for item in entry or [] if item] for entry in per_token or []]
    if per_token is None:
        raise EngineResponseError(f"{source}: the {engine} reply has no top logprobs (asked for {MARGIN_TOP_LOGPROBS})")
    return [_margin(v) for v in values]


def _margin(logprobs: list) -> float | None:
    finite = sorted((float(v) for v in logprobs if v is not None and math.isfinite(float(v))), reverse=True)
    return finite[0] - finite[1] if len(finite) >= 2 else None


@dataclass
class _Reply:
    data: dict
    seconds: float
    before: VllmCounters | None = None
    after: VllmCounters | None = None


async def _read_counters(http: httpx.AsyncClient, url: str, keep: Path | None = None) -> VllmCounters:
    """vLLM's counters now; with ``keep``, the raw exposition text is saved there too (the first
    prompt's are kept beside the engine log: what a parsing test is checked against)."""
    resp = await http.get(url + "/metrics")
    resp.raise_for_status()
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(resp.text)
    return parse_vllm_metrics(resp.text, f"{url}/metrics")


async def _settled_counters(
    http: httpx.AsyncClient,
    url: str,
    before: VllmCounters,
    min_committed: int,
    source: str,
    tries: int = 20,
) -> VllmCounters:
    """The reading after a request. vLLM records a step's counters before the reply leaves, so
    the first reading should do; should it ever lag (fewer committed tokens than the reply's
    tokens after the prefill one), it is read again briefly rather than charged to the next
    prompt, and a warning says so if it never catches up."""
    for attempt in range(tries + 1):
        after = await _read_counters(http, url)
        committed = (after.accepted - before.accepted) + (after.drafts - before.drafts)
        if committed >= min_committed:
            return after
        if attempt < tries:
            await asyncio.sleep(0.05)
    log.warning(
        "%s: vLLM's counters show %d committed tokens for %d generated after the first; "
        "steps without drafts, or counters recorded late (then charged to the next prompt)",
        source,
        committed,
        min_committed,
    )
    return after


async def _decode_all(
    engine: str,
    url: str,
    prompts: list[tuple[str, str, list[int]]],
    sampling_for,
    *,
    model: str,
    counters: bool,
    concurrency: int,
    alive,
    hung_after_s: float,
    raw_metrics_dir: Path | None = None,
    margins: bool = False,
) -> list[_Reply]:
    """Send every prompt; with ``counters`` read vLLM's /metrics around each request (then one
    at a time: the counters are server-wide). A server silent for ``hung_after_s`` stops it."""
    if counters and concurrency != 1:
        raise ValueError("vLLM's counters are server-wide: measure with concurrency 1")
    gate = asyncio.Semaphore(concurrency)
    client = EngineClient([url], _adapter(engine, model, margins), alive=alive)
    async with client, httpx.AsyncClient(timeout=60) as http:

        def keep(when: str) -> Path | None:
            return raw_metrics_dir / f"vllm-metrics-{when}.txt" if raw_metrics_dir else None

        async def one(index: int, ids: list[int]) -> _Reply:
            async with gate:
                first = index == 0
                before = await _read_counters(http, url, keep("before") if first else None) if counters else None
                start = time.perf_counter()
                data = await client.complete("", ids, sampling_for(index))
                reply = _Reply(data, time.perf_counter() - start, before)
                if counters:
                    source = f"prompt {prompts[index][0]}"
                    tokens = len(output_ids(engine, data, source))
                    reply.after = await _settled_counters(http, url, before, tokens - 1, source)
                    if first and raw_metrics_dir:
                        await _read_counters(http, url, keep("after"))
                return reply

        every = asyncio.gather(*(one(i, p[2]) for i, p in enumerate(prompts)))
        return await unless_hung(every, [url], hung_after_s, "evaluate.engine_hung_after_s")


def _sampling_for(max_new_tokens: int, temperature: float, seed: int | None):
    """One seed per prompt, as the loop: sampled runs reproducible, prompts independent."""

    def sampling(index: int) -> Sampling:
        return Sampling(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=None if seed is None else seed + index,
        )

    return sampling


def request_acceptance(
    engine: str,
    url: str,
    prompts: list[tuple[str, str, list[int]]],
    block_size: int,
    *,
    model: str,
    max_new_tokens: int,
    temperature: float,
    seed: int | None = None,
    concurrency: int = 1,
    alive=None,
    hung_after_s: float = HUNG_AFTER_S,
    raw_metrics_dir: Path | None = None,
) -> tuple[list[PromptResult], dict[str, list[int]]]:
    """Send every (id, prompt_set, prompt_ids) to a running speculative server and read each
    request's acceptance; returns the per-prompt results and the generated token ids by id.
    Concurrency 1 by default: batch-1 acceptance, as the loop measures it (vLLM requires it)."""
    replies = asyncio.run(
        _decode_all(
            engine,
            url,
            prompts,
            _sampling_for(max_new_tokens, temperature, seed),
            model=model,
            counters=engine == "vllm",
            concurrency=concurrency,
            alive=alive,
            hung_after_s=hung_after_s,
            raw_metrics_dir=raw_metrics_dir,
        )
    )
    results, outputs = [], {}
    for (pid, pset, ids), reply in zip(prompts, replies):
        source = f"prompt {pid}"
        if engine == "vllm":
            acceptance = acceptance_from_counters(reply.data, reply.before, reply.after, block_size, source)
        else:
            acceptance = acceptance_from_response(reply.data, block_size, source)
        result = prompt_result(pid, pset, len(ids), acceptance, block_size)
        result.seconds = reply.seconds
        results.append(result)
        outputs[pid] = output_ids(engine, reply.data, source)
    return results, outputs


def request_plain(
    engine: str,
    url: str,
    prompts: list[tuple[str, str, list[int]]],
    *,
    model: str,
    max_new_tokens: int,
    seed: int | None = None,
    alive=None,
    hung_after_s: float = HUNG_AFTER_S,
) -> tuple[dict[str, list[int]], dict[str, float], dict[str, list[float | None]]]:
    """Greedy-decode every prompt on a server without the drafter: token ids, seconds and the
    target's logit margin at every generated token (``top2_margins``), by prompt id."""
    replies = asyncio.run(
        _decode_all(
            engine,
            url,
            prompts,
            _sampling_for(max_new_tokens, 0.0, seed),
            model=model,
            counters=False,
            concurrency=1,
            alive=alive,
            hung_after_s=hung_after_s,
            margins=True,
        )
    )
    outputs = {p[0]: output_ids(engine, r.data, f"prompt {p[0]}") for p, r in zip(prompts, replies)}
    margins = {p[0]: top2_margins(engine, r.data, f"prompt {p[0]}") for p, r in zip(prompts, replies)}
    return outputs, {p[0]: r.seconds for p, r in zip(prompts, replies)}, margins
