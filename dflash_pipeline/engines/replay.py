"""Replaying prompts against a serving engine and timing every streamed response (tune's
measurement, ``dflash_pipeline.engines.tuning`` decides from it).

A setting's replay is closed-loop, as vLLM's own serving benchmark does with a maximum
concurrency: every prompt of the sample is sent once, at most ``concurrency`` in flight. A
setting stops at its time budget; requests still running then are cut and their streamed tokens
count (``cut_at_budget`` says how many). Tokens are counted from the stream: vLLM's chunks carry
their token ids, SGLang's a cumulative count, and a final usage chunk (vLLM, transformers serve)
corrects the count; the time to first token and the per-token latency (TPOT: the time between
the first and the last token over the tokens between) are per request. The engine's memory is
the peak of its process tree's RSS and, on NVIDIA GPUs, of the GPU memory its processes hold.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import time
import dataclasses
from dataclasses import dataclass

import httpx

from dflash_pipeline.core.gpu_slots import nvidia_smi
from dflash_pipeline.engines.client import CompletionsAdapter, HttpPools, Sampling, SglangAdapter

# Short requests sent before a server's first setting: compilation, CUDA graphs and caches
# warm up there, not in the first measured setting.
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 16
MEMORY_SAMPLE_EVERY_S = 2.0


class ReplayError(RuntimeError):
    """The engine refused or broke the replay; the message says how."""


@dataclass
class Timing:
    """One streamed request: when it was sent, when its first and last tokens came."""

    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    finish_reason: str = "cut"

    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def stream_body(adapter, prompt_text: str, prompt_ids: list[int], sampling: Sampling) -> tuple[str, dict]:
    """The adapter's request with streaming on (token counts in the stream where the API has them)."""
    path, body = adapter.request(prompt_text, prompt_ids, sampling)
    body = {**body, "stream": True}
    if isinstance(adapter, CompletionsAdapter) and not adapter.strict:
        body["stream_options"] = {"include_usage": True}  # vLLM: a last chunk with the usage
    return path, body


def read_chunk(adapter, data: dict, timing: Timing, now: float) -> None:
    """Account one streamed chunk of either API into ``timing``."""
    if isinstance(adapter, SglangAdapter):
        meta = data.get("meta_info") or {}
        tokens = int(meta.get("completion_tokens") or 0)  # cumulative
        arrived = tokens - timing.tokens
        reason = meta.get("finish_reason")
        if reason:
            timing.finish_reason = reason.get("type", "unknown") if isinstance(reason, dict) else str(reason)
    else:
        choices = data.get("choices") or []
        choice = choices[0] if choices else {}
        if choice.get("token_ids") is not None:
            arrived = len(choice["token_ids"])
        else:
            arrived = 1 if choice.get("text") else 0
        if choice.get("finish_reason"):
            timing.finish_reason = choice["finish_reason"]
        usage = data.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            # The engine's own count, where it sends one, replaces the chunk count.
            arrived = max(0, int(usage["completion_tokens"]) - timing.tokens)
    if arrived > 0:
        if timing.first is None:
            timing.first = now
        timing.last = now
        timing.tokens += arrived


async def stream_one(
    http: httpx.AsyncClient, url: str, adapter, prompt: tuple[str, list[int]], sampling: Sampling, timing: Timing
) -> None:
    path, body = stream_body(adapter, prompt[0], prompt[1], sampling)
    async with http.stream("POST", url + path, json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")[:300]
            raise ReplayError(f"HTTP {resp.status_code} from {url}{path}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            try:
                data = json.loads(payload)
            except ValueError:
                continue
            if "error" in data:
                raise ReplayError(f"the engine sent an error in the stream: {str(data['error'])[:300]}")
            read_chunk(adapter, data, timing, time.monotonic())
    if timing.finish_reason == "cut":
        timing.finish_reason = "unknown"  # the stream ended without naming its reason


def percentiles(values: list[float], scale: float = 1.0) -> dict | None:
    """p50, p90 and p99 (nearest rank), scaled; None without values."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered) - 1e-9))) - 1]

    return {f"p{int(q * 100)}": round(rank(q) * scale, 4) for q in (0.5, 0.9, 0.99)}


def process_tree_rss_mb(pid: int) -> float | None:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


def gpu_memory_mb(pid: int) -> float | None:
    """GPU memory held by the server's processes (nvidia-smi), None without NVIDIA GPUs."""
    import psutil

    apps = nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    if not apps:
        return None
    try:
        root = psutil.Process(pid)
        pids = {root.pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return None
    used = [float(mb) for app_pid, mb in (line.split(",") for line in apps if "," in line) if int(app_pid) in pids]
    return round(sum(used), 1) if used else None


@dataclass
class MemoryWatch:
    """The peak memory of a server's process tree while a setting runs."""

    pid: int | None
    rss_mb: float | None = None
    gpu_mb: float | None = None

    def sample(self) -> None:
        if self.pid is None:
            return
        for attr, value in (("rss_mb", process_tree_rss_mb(self.pid)), ("gpu_mb", gpu_memory_mb(self.pid))):
            if value is not None:
                setattr(self, attr, max(value, getattr(self, attr) or 0.0))

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(MEMORY_SAMPLE_EVERY_S)


async def measure_setting(
    url: str,
    adapter,
    prompts: list[tuple[str, list[int]]],
    sampling: Sampling,
    concurrency: int,
    budget_s: float,
    server_pid: int | None = None,
    request_timeout_s: float = 1800,
) -> dict:
    """Replay every prompt once with at most ``concurrency`` in flight; the figures of the setting."""
    timings: list[Timing] = []
    semaphore = asyncio.Semaphore(concurrency)
    memory = MemoryWatch(server_pid)
    failures: list[str] = []
    # Several small connection pools: one pool of hundreds of connections costs the client more
    # CPU per request than the engine does at high concurrency (``HttpPools``).
    pools = HttpPools(httpx.Timeout(request_timeout_s, connect=30))
    try:
        start = time.monotonic()
        deadline = start + budget_s

        async def one(prompt) -> None:
            async with semaphore:
                if time.monotonic() >= deadline:
                    return  # the budget is spent: not sent
                timing = Timing(sent=time.monotonic())
                timings.append(timing)
                try:
                    with pools.lease() as http:
                        await stream_one(http, url, adapter, prompt, sampling, timing)
                except (httpx.HTTPError, ReplayError) as err:
                    timing.finish_reason = "error"
                    failures.append(f"{type(err).__name__}: {err}")

        watcher = asyncio.create_task(memory.run())
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        try:
            done, pending = await asyncio.wait(tasks, timeout=budget_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            watcher.cancel()
        end = time.monotonic()
    finally:
        await pools.aclose()
    await asyncio.to_thread(memory.sample)
    elapsed = end - start
    tokens = sum(t.tokens for t in timings)
    reasons: dict[str, int] = {}
    for t in timings:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    if failures and len(failures) == len(timings):
        raise ReplayError(f"every request at concurrency {concurrency} failed; first: {failures[0]}")
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "completed": sum(t.finish_reason not in ("cut", "error") for t in timings),
        "cut_at_budget": reasons.get("cut", 0),
        "errors": len(failures),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else 0.0,
        "ttft_s": percentiles([t.ttft() for t in timings if t.ttft() is not None]),
        "tpot_ms": percentiles([t.tpot() for t in timings if t.tpot() is not None], 1000.0),
        "finish_reasons": dict(sorted(reasons.items())),
        "engine_memory_mb": {"rss": memory.rss_mb, "gpu": memory.gpu_mb},
        "first_error": failures[0] if failures else None,
    }


async def warm_up(url: str, adapter, prompts: list[tuple[str, list[int]]], sampling: Sampling) -> None:
    """A few short requests, unmeasured."""
    short = dataclasses.replace(sampling, max_new_tokens=WARMUP_TOKENS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as http:
        await asyncio.gather(
            *(
                stream_one(http, url, adapter, p, short, Timing(sent=time.monotonic()))
                for p in prompts[:WARMUP_REQUESTS]
            )
        )


def describe_device(gpus: int) -> str:
    """The device a setting ran on, in words: the GPU's name, else the CPU."""
    names = nvidia_smi("--query-gpu=name", "--format=csv,noheader") if gpus else None
    if names:
        visible = [int(i) for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i.strip().isdigit()]
        names = [names[i] for i in visible if i < len(names)] or names
        return f"{gpus} x {names[0]}"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
