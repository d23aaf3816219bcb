"""Engine settings measured on the run's own prompts before the long generation (rule `tune`).

Operators of a multi-day regeneration benchmark the target on one device first and set the
number of servers and the concurrency from what they see. This module does that measurement:
it replays a sample of the run's prompts, with the run's sampling and thinking settings, through
one launched server at each configured concurrency (and, where the target has an MTP head and the
engine serves it, once more with MTP as the server's speculative decoder), streaming every
response to time it, and records per setting the output tokens per second, the time to first
token and the per-token latency (percentiles), the finish reasons and the engine's memory. The
choice is the setting with the best throughput within the configured bounds.

A setting's replay is closed-loop, as vLLM's own serving benchmark does with a maximum
concurrency: every prompt of the sample is sent once, at most ``concurrency`` in flight. A
setting stops at its time budget; requests still running then are cut and their streamed tokens
count (``cut_at_budget`` says how many).

``generate`` takes the choice (``tuned_choice``) unless the config pins the concurrency or the
speculative settings; ``plan`` takes the measured tokens per second per GPU.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from dflash_pipeline.engines.client import CompletionsAdapter, SglangAdapter, Sampling

log = logging.getLogger(__name__)

RESULT_SCHEMA = 1
# Engines that serve a target's MTP head as their speculative decoder (SGLang's NEXTN, vLLM's
# "mtp" method); transformers serve does not.
MTP_ENGINES = frozenset({"sglang", "vllm"})
# The config keys that say a target has an MTP head (Qwen3.5/3.6 and Qwen3-Next:
# mtp_num_hidden_layers; DeepSeek-V3 and GLM: num_nextn_predict_layers), at the top level or in
# text_config of a multimodal checkpoint.
MTP_CONFIG_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
# Short requests sent before a server's first setting: compilation, CUDA graphs and caches
# warm up there, not in the first measured setting.
WARMUP_REQUESTS = 4
WARMUP_TOKENS = 16
MEMORY_SAMPLE_EVERY_S = 2.0


class TuneError(RuntimeError):
    """Tuning cannot run or its result cannot be used; the message says why."""


def tune_key(defining: dict) -> str:
    """Digest of what a tune result depends on (``defining``: ``tune_defining`` of the config)."""
    return hashlib.sha256(json.dumps(defining, sort_keys=True).encode()).hexdigest()[:16]


def tune_defining(config: dict) -> dict:
    """What defines a tune result: the target, the engine and its server, the generation settings
    a request carries, and the tune section. A change of any of these measures again; the
    operational keys of generation (intervals, retries, ...) do not."""
    gen, server = config["generation"], config["generation"]["server"]
    # Whether generate waits for tune, and what it uses without a result, change no measurement.
    tune = {k: v for k, v in config["tune"].items() if k not in ("enabled", "untuned_concurrency")}
    return {
        "model": config["target"]["model"],
        "engine": gen["engine"],
        "thinking": gen["thinking"],
        "max_new_tokens": gen["max_new_tokens"],
        "seed": gen["seed"],
        "sampling": gen["sampling"],
        "server": {k: server[k] for k in ("tp", "mem_fraction", "speculative", "extra_args")},
        "tune": tune,
    }


def has_mtp_head(model_dir: str) -> bool:
    """Whether the target's config declares MTP layers."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    for section in (cfg, cfg.get("text_config") or {}):
        if any(int(section.get(key) or 0) > 0 for key in MTP_CONFIG_KEYS):
            return True
    return False


def mtp_speculative(steps: int) -> dict:
    """The server's speculative settings for the target's own MTP head (SGLang names; vLLM's
    command translates them, ``engines.launch.vllm_speculative_config``)."""
    return {"algorithm": "NEXTN", "num_steps": steps, "eagle_topk": 1, "num_draft_tokens": steps + 1}


@dataclass(frozen=True)
class Variant:
    """One server configuration to measure: with or without MTP."""

    mtp: bool
    speculative: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "MTP" if self.mtp else "plain"


def variants(engine: str, model_dir: str, tune: dict, pinned_speculative: dict) -> tuple[list[Variant], str]:
    """The server configurations to measure, and one line saying why MTP is or is not among them.
    A speculative decoder pinned in the config is measured as configured, alone."""
    if pinned_speculative.get("algorithm"):
        return [
            Variant(False, dict(pinned_speculative))
        ], "speculative decoding pinned by generation.server.speculative"
    plain = [Variant(False)]
    if not tune["mtp"]:
        return plain, "MTP not measured (tune.mtp: false)"
    if not has_mtp_head(model_dir):
        return plain, "MTP not measured: the target has no MTP head"
    if engine not in MTP_ENGINES:
        return plain, f"MTP not measured: {engine} does not serve an MTP head"
    return plain + [Variant(True, mtp_speculative(tune["mtp_steps"]))], "measured with and without MTP"


# ---------------------------------------------------------------- streaming one request


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
            raise TuneError(f"HTTP {resp.status_code} from {url}{path}: {text}")
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
                raise TuneError(f"the engine sent an error in the stream: {str(data['error'])[:300]}")
            read_chunk(adapter, data, timing, time.monotonic())
    if timing.finish_reason == "cut":
        timing.finish_reason = "unknown"  # the stream ended without naming its reason


# ---------------------------------------------------------------- one setting


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
    if shutil.which("nvidia-smi") is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        pids = {root.pid, *(p.pid for p in root.children(recursive=True))}
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (psutil.Error, subprocess.SubprocessError, OSError):
        return None
    used = [
        float(mb)
        for app_pid, mb in (line.split(",") for line in out.splitlines() if "," in line)
        if int(app_pid) in pids
    ]
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
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(concurrency, 16))
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=30), limits=limits) as http:
        start = time.monotonic()
        deadline = start + budget_s

        async def one(prompt) -> None:
            async with semaphore:
                if time.monotonic() >= deadline:
                    return  # the budget is spent: not sent
                timing = Timing(sent=time.monotonic())
                timings.append(timing)
                try:
                    await stream_one(http, url, adapter, prompt, sampling, timing)
                except (httpx.HTTPError, TuneError) as err:
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
    await asyncio.to_thread(memory.sample)
    elapsed = end - start
    tokens = sum(t.tokens for t in timings)
    reasons: dict[str, int] = {}
    for t in timings:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    if failures and len(failures) == len(timings):
        raise TuneError(f"every request at concurrency {concurrency} failed; first: {failures[0]}")
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
    short = Sampling(**{**asdict(sampling), "max_new_tokens": WARMUP_TOKENS})
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30)) as http:
        await asyncio.gather(
            *(
                stream_one(http, url, adapter, p, short, Timing(sent=time.monotonic()))
                for p in prompts[:WARMUP_REQUESTS]
            )
        )


# ---------------------------------------------------------------- the choice


def bound_problems(setting: dict, bounds: dict) -> list[str]:
    """Which configured bounds a setting exceeds (p90 latencies, peak engine memory)."""
    problems = []
    tpot, ttft = setting.get("tpot_ms") or {}, setting.get("ttft_s") or {}
    memory = setting.get("engine_memory_mb") or {}
    if bounds.get("max_tpot_ms") is not None and tpot.get("p90", 0) > bounds["max_tpot_ms"]:
        problems.append(f"p90 per-token latency {tpot['p90']} ms > tune.max_tpot_ms {bounds['max_tpot_ms']}")
    if bounds.get("max_ttft_s") is not None and ttft.get("p90", 0) > bounds["max_ttft_s"]:
        problems.append(f"p90 time to first token {ttft['p90']} s > tune.max_ttft_s {bounds['max_ttft_s']}")
    used = memory.get("gpu") if memory.get("gpu") is not None else memory.get("rss")
    if bounds.get("max_memory_mb") is not None and used is not None and used > bounds["max_memory_mb"]:
        problems.append(f"engine memory {used} MB > tune.max_memory_mb {bounds['max_memory_mb']}")
    return problems


def choose(settings: list[dict], bounds: dict) -> dict:
    """The setting with the best throughput within the bounds (ties: the lower concurrency, then
    without MTP). When none is within them, the one with the lowest p90 per-token latency, said so."""
    for setting in settings:
        setting["out_of_bounds"] = bound_problems(setting, bounds)
    usable = [s for s in settings if not s["out_of_bounds"] and s["output_tokens"] > 0]
    if usable:
        best = max(usable, key=lambda s: (s["output_tokens_per_s"], -s["concurrency"], not s["mtp"]))
        why = "the best throughput within the bounds"
    else:
        measured = [s for s in settings if s["output_tokens"] > 0] or settings
        best = min(measured, key=lambda s: ((s.get("tpot_ms") or {}).get("p90", float("inf")), s["concurrency"]))
        why = "no setting met the bounds: the lowest p90 per-token latency"
    return {
        "concurrency": best["concurrency"],
        "mtp": best["mtp"],
        "speculative": best["speculative"],
        "output_tokens_per_s": best["output_tokens_per_s"],
        "tokens_per_s_per_gpu": best["tokens_per_s_per_gpu"],
        "why": why,
    }


def describe_device(gpus: int) -> str:
    """The device a setting ran on, in words: the GPU's name, else the CPU."""
    if gpus and shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split("\n")
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible:
                ids = [int(i) for i in visible.split(",") if i.strip().isdigit()]
                names = [names[i] for i in ids if i < len(names)] or names
            return f"{gpus} x {names[0].strip()}"
        except (subprocess.SubprocessError, OSError, ValueError):
            pass
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# ---------------------------------------------------------------- reading a result


@dataclass(frozen=True)
class TunedChoice:
    """What generate and plan take from a tune result."""

    concurrency: int
    speculative: dict
    tokens_per_s_per_gpu: float
    source: str  # one line: engine, setting, device, date

    @property
    def mtp(self) -> bool:
        return bool(self.speculative)


def read_tune_result(storage, key: str) -> TunedChoice | None:
    """The choice of the run's tune result (``layout.TUNE_RESULT``) for the current settings
    (``key``); None, said in one warning, when there is none or it was measured for others."""
    from dflash_pipeline.core import layout
    from dflash_pipeline.core.storage import StorageError

    try:
        result = json.loads(storage.read_text(layout.TUNE_RESULT))
    except StorageError:
        return None
    except ValueError as err:
        log.warning("%s is no JSON (%s): not used", storage.join(layout.TUNE_RESULT), err)
        return None
    try:
        return tuned_choice(result, key)
    except (TuneError, KeyError, TypeError, ValueError) as err:
        log.warning("the tune result %s is not used: %s", storage.join(layout.TUNE_RESULT), err)
        return None


def apply_choice(gen: dict, tuned: TunedChoice | None, untuned_concurrency: int) -> tuple[dict, str]:
    """The `generation` section a generate job runs with: a null concurrency takes the tuned one
    (per server: times its data-parallel ranks), else ``untuned_concurrency``; an unpinned
    speculative setting takes the tuned MTP choice. Returns it and one line saying where the
    concurrency came from."""
    gen = {**gen, "server": dict(gen.get("server") or {})}
    dp = int(gen["server"].get("dp") or 1)
    if gen.get("concurrency") is not None:
        line = f"concurrency {gen['concurrency']} (pinned by generation.concurrency)"
    elif tuned is not None:
        gen["concurrency"] = tuned.concurrency * dp
        line = f"concurrency {gen['concurrency']} ({tuned.source}" + (
            f"; x {dp} data-parallel ranks)" if dp > 1 else ")"
        )
    else:
        gen["concurrency"] = untuned_concurrency
        line = f"concurrency {untuned_concurrency} (tune.untuned_concurrency: no tune result for these settings)"
    pinned = (gen["server"].get("speculative") or {}).get("algorithm")
    if tuned is not None and tuned.mtp and not pinned:
        gen["server"]["speculative"] = dict(tuned.speculative)
        line += "; MTP on, as tune measured best"
    return gen, line


def tuned_choice(result: dict, key: str | None = None) -> TunedChoice:
    """The choice of a tune result; ``key`` (``tune_key`` of the current config) must match the
    one it was measured for."""
    if result.get("schema") != RESULT_SCHEMA or "choice" not in result:
        raise TuneError(f"not a tune result of schema {RESULT_SCHEMA}")
    if key is not None and result.get("key") != key:
        raise TuneError(
            "it was measured for other settings (target, engine, sampling or tune keys changed since); "
            "measure again with `snakemake --forcerun tune` (make tune)"
        )
    choice = result["choice"]
    mtp = ", MTP" if choice.get("speculative") else ""
    engine = (
        result["engine_version"]
        if " " in result["engine_version"]
        else f"{result['engine']} {result['engine_version']}"
    )
    source = (
        f"measured by tune: {engine} at concurrency {choice['concurrency']}{mtp} "
        f"on {result['device']}, {result['created_utc'][:10]}"
    )
    return TunedChoice(
        int(choice["concurrency"]), dict(choice.get("speculative") or {}), float(choice["tokens_per_s_per_gpu"]), source
    )
