"""Acceptance measured inside SGLang: launch it with the exported drafter, read each reply's counters.

SGLang (``--speculative-algorithm DFLASH``) reports per request, in ``meta_info``:
``completion_tokens``, ``spec_verify_ct`` (target verify steps) and, in recent versions, a histogram
of drafts accepted per step (``spec_correct_drafts_histogram``; older ones call it
``spec_accept_histogram``). tau = completion_tokens / spec_verify_ct, as SGLang's own
``spec_accept_length``; note that its completion tokens include the first token, which prefill
produced without a verify step, so on short replies it reads slightly above the loop's tau.
Hybrid (GDN) targets need ``--mamba-scheduler-strategy extra_buffer`` for correct state rollback
(dflash-spec.md §6, pitfall 9).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.engines.client import EngineClient, Sampling, SglangAdapter
from dflash_pipeline.engines.launch import ManagedServer, ServerSpec
from dflash_pipeline.evaluation.metrics import PromptResult

HISTOGRAM_FIELDS = ("spec_correct_drafts_histogram", "spec_accept_histogram")


class SglangResponseError(ValueError):
    pass


def sglang_server_spec(
    target: str | Path,
    drafter: str | Path,
    block_size: int,
    port: int,
    *,
    hybrid: bool,
    tp: int = 1,
    mem_fraction: float | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
) -> ServerSpec:
    """The server the evaluation launches: target + DFlash drafter, B - 1 drafts per step."""
    args = ["--speculative-dflash-block-size", str(block_size)]
    if hybrid:
        args += ["--mamba-scheduler-strategy", "extra_buffer"]
    return ServerSpec(
        engine="sglang",
        model=str(target),
        port=port,
        tp=tp,
        mem_fraction=mem_fraction,
        speculative={
            "algorithm": "DFLASH",
            "draft_model": str(drafter),
            "num_draft_tokens": block_size,
        },
        extra_args=args + list(extra_args),
    )


def target_is_hybrid(config) -> bool:
    """Whether a target config has linear-attention (GDN) layers."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or [])


@dataclass(frozen=True)
class SpecAcceptance:
    completion_tokens: int
    verify_steps: int
    accept_hist: list[int] | None
    finish_reason: str
    output_ids: list[int] | None


def acceptance_from_response(
    data: dict, block_size: int, source: str = "response"
) -> SpecAcceptance:
    """Read one ``/generate`` reply's speculative counters; errors say what is missing."""
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise SglangResponseError(f"{source}: SGLang reply has no meta_info object")
    for key in ("completion_tokens", "spec_verify_ct"):
        if not isinstance(meta.get(key), int):
            hint = (
                " (the server runs without speculative decoding: check --speculative-algorithm)"
                if key == "spec_verify_ct"
                else ""
            )
            raise SglangResponseError(f"{source}: meta_info.{key} missing or not an integer{hint}")
    hist = next((meta[k] for k in HISTOGRAM_FIELDS if meta.get(k)), None)
    if hist is not None:
        if not all(isinstance(c, int) and c >= 0 for c in hist) or len(hist) > block_size:
            raise SglangResponseError(
                f"{source}: acceptance histogram {hist} is not {block_size} or fewer counts"
            )
        hist = list(hist) + [0] * (block_size - len(hist))
        if sum(hist) != meta["spec_verify_ct"]:
            raise SglangResponseError(
                f"{source}: acceptance histogram counts {sum(hist)} steps, spec_verify_ct says "
                f"{meta['spec_verify_ct']}"
            )
    reason = meta.get("finish_reason") or {}
    return SpecAcceptance(
        completion_tokens=meta["completion_tokens"],
        verify_steps=meta["spec_verify_ct"],
        accept_hist=hist,
        finish_reason=reason.get("type", "unknown") if isinstance(reason, dict) else str(reason),
        output_ids=data.get("output_ids"),
    )


def prompt_result(
    prompt_id: str, prompt_set: str, prompt_tokens: int, acceptance: SpecAcceptance, block_size: int
) -> PromptResult:
    return PromptResult(
        id=prompt_id,
        prompt_set=prompt_set,
        block_size=block_size,
        accept_hist=acceptance.accept_hist,
        committed_tokens=acceptance.completion_tokens,
        verify_steps=acceptance.verify_steps,
        generated_tokens=acceptance.completion_tokens,
        prompt_tokens=prompt_tokens,
        finish_reason=acceptance.finish_reason,
    )


class _RawSglangAdapter(SglangAdapter):
    """SGLang's ``/generate`` request, with the whole reply kept (meta_info included)."""

    def parse(self, data: dict) -> dict:
        return data


async def _request_all(client: EngineClient, requests, sampling: Sampling, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt_ids):
        async with gate:
            return await client.complete("", prompt_ids, sampling)

    return await asyncio.gather(*(one(ids) for ids in requests))


def request_acceptance(
    url: str,
    prompts: list[tuple[str, str, list[int]]],
    block_size: int,
    *,
    max_new_tokens: int,
    temperature: float,
    concurrency: int = 1,
    alive=None,
) -> list[PromptResult]:
    """Send every (id, prompt_set, prompt_ids) to a running SGLang server's ``/generate`` and
    read each reply's acceptance counters. Concurrency 1 by default: batch-1 acceptance, as the
    transformers loop measures it."""
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature)
    client = EngineClient([url], _RawSglangAdapter(), alive=alive)

    async def run():
        async with client:
            return await _request_all(client, [p[2] for p in prompts], sampling, concurrency)

    replies = asyncio.run(run())
    return [
        prompt_result(
            pid,
            pset,
            len(ids),
            acceptance_from_response(reply, block_size, f"prompt {pid}"),
            block_size,
        )
        for (pid, pset, ids), reply in zip(prompts, replies)
    ]


def measure_with_sglang(
    spec: ServerSpec,
    prompts: list[tuple[str, str, list[int]]],
    block_size: int,
    *,
    max_new_tokens: int,
    temperature: float,
    log_dir: str | Path,
    concurrency: int = 1,
    startup_timeout: float = 1800,
) -> list[PromptResult]:
    """Launch the server, measure every prompt, stop the server."""
    log_dir = Path(log_dir)
    with ManagedServer(
        spec, log_dir / "sglang.log", log_dir, startup_timeout=startup_timeout
    ) as server:
        return request_acceptance(
            spec.url,
            prompts,
            block_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            concurrency=concurrency,
            alive=server.alive,
        )
