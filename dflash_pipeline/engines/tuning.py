"""Engine settings measured on the run's own prompts before the long generation (rule `tune`).

Operators of a multi-day regeneration benchmark the target on one device first and set the
number of servers and the concurrency from what they see. This module does that measurement:
it replays a sample of the run's prompts, with the run's sampling and thinking settings, through
one launched server at each configured concurrency (and, where the target has an MTP head and the
engine serves it, once more with MTP as the server's speculative decoder), streaming every
response to time it, and records per setting the output tokens per second, the time to first
token and the per-token latency (percentiles), the finish reasons and the engine's memory. The
choice is the setting with the best throughput within the configured bounds.

The measurement itself is ``dflash_pipeline.engines.replay``; this module decides what to measure
and what the measurement means.

``generate`` takes the choice (``read_tune_result``, ``apply_choice``) unless the config pins the
concurrency or the speculative settings; ``plan`` takes the measured tokens per second per GPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

RESULT_SCHEMA = 1
# Engines that serve a target's MTP head as their speculative decoder (SGLang's NEXTN, vLLM's
# "mtp" method); transformers serve does not.
MTP_ENGINES = frozenset({"sglang", "vllm"})
# The config keys that say a target has an MTP head (Qwen3.5/3.6 and Qwen3-Next:
# mtp_num_hidden_layers; DeepSeek-V3, GLM and MiMo: num_nextn_predict_layers), at the top level or
# in text_config of a multimodal checkpoint. dflash_pipeline.demo.mtp_target builds a tiny MiMo one.
MTP_CONFIG_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


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


def tune_gpus(config: dict) -> int:
    """A tune job's GPUs: one server's tensor parallelism (none on a CPU run)."""
    return config["generation"]["server"]["tp"] if config["generation"]["gpus_per_job"] else 0


def generate_waits_for_tune(storage) -> bool:
    """Whether generate jobs take the tune result as their (``ancient()``) input: when it exists,
    or when no generate shard exists yet. A run whose shards were generated before it had a
    result keeps them: tune then runs beside, and measuring again never reruns a finished shard."""
    from dflash_pipeline.core import layout

    return storage.exists(layout.TUNE_RESULT) or not storage.any_under(f"{layout.OUTPUTS_DIR}/generate-")


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
        if self.mtp:
            return "MTP"
        return f"pinned {self.speculative['algorithm']}" if self.speculative else "plain"


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
