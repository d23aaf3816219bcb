"""Acceptance measured inside a real serving engine (vLLM or SGLang), with the exported drafter.

One path for both engines: launch the target + drafter server, send every prompt as token ids one
at a time, read each request's speculative counters, stop; then (greedy only) launch the same server
without the drafter, decode the same prompts, stop, and compare token for token. The result is
gated on parity with the project's own loop (``check_engine_parity``): the number that matters is
the one the serving engine reproduces, not the one our loop measures.

Where the counters come from, and how they are read: ``evaluation.engine_counters``.
"""

from __future__ import annotations

import json
import os
import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from dflash_pipeline.engines.environments import EngineInstall
from dflash_pipeline.engines.launch import ManagedServer, ServerSpec
from dflash_pipeline.engines.limits import DrafterShape, EngineUnsupportedError, downgrades, refusals
from dflash_pipeline.evaluation.engine_requests import HUNG_AFTER_S, request_acceptance, request_plain
from dflash_pipeline.evaluation.lossless import compare_greedy, default_margin_tolerance, lossless_summary
from dflash_pipeline.evaluation.metrics import PromptResult
from dflash_pipeline.evaluation.engine_counters import (
    EngineResponseError,
)

log = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang")

# Measurement flags of the vLLM server, speculative and plain alike: a fixed seed; no prefix
# caching, so every prompt is prefilled from scratch as in the loop and the plain reference; and
# vLLM's neutral sampling defaults instead of the model's generation_config.json (which may set
# e.g. repetition_penalty that the loop does not apply). The target's stop tokens still come from
# generation_config.json.
VLLM_MEASUREMENT_ARGS = ("--seed", "0", "--no-enable-prefix-caching", "--generation-config", "vllm")

# Fields of the exported config.json that the engines read (docs/evaluation.md; vLLM 0.20.1
# qwen3_dflash.py / llm_base_proposer.py / gpu_model_runner.py; SGLang models/dflash.py).
DFLASH_CONFIG_FIELDS = (
    "mask_token_id",
    "target_layer_ids",
    "block_size",
    "causal",
    "use_swa",
    "swa_window_size",
    "use_aux_hidden_state",
)
TOP_LEVEL_FIELDS = (
    "eagle_aux_hidden_state_layer_ids",
    "block_size",
    "is_causal",
    "layer_types",
    "sliding_window",
    "rope_theta",
    "rope_parameters",
    "num_hidden_layers",
    "head_dim",
)


def serving_server_spec(
    engine: str,
    target: str | Path,
    drafter: str | Path,
    block_size: int,
    port: int,
    *,
    hybrid: bool,
    speculative: bool = True,
    tp: int = 1,
    mem_fraction: float | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    python: str | None = None,
    env: dict[str, str] | None = None,
    dtype: str | None = None,
    engine_version: str | None = None,
    temperature: float = 0.0,
) -> ServerSpec:
    """The server a measurement launches: target + DFlash drafter with B - 1 drafts per step, or
    with ``speculative=False`` the same server without the drafter (the plain greedy reference).

    Both engines get the same ``speculative`` settings (SGLang's names, B as num_draft_tokens);
    ``engines.launch`` maps them to each engine's flags (vLLM: num_speculative_tokens = B - 1).
    Hybrid targets only change SGLang (extra_buffer rollback of the GDN state after rejected
    drafts); vLLM rolls hybrid state back on its own. ``dtype`` is the loop's (both engines take
    ``--dtype``): vLLM's CPU build otherwise runs an fp32 checkpoint in bf16, whose greedy text
    differs from the fp32 loop's, and the two taus then measure different outputs (measured on
    the demo: 4.771 in bf16 against the loop's 4.500 in fp32, both lossless).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown serving engine {engine!r} ({', '.join(ENGINES)})")
    if block_size < 2:
        raise ValueError(f"block size must be at least 2, got {block_size}")
    settings = {}
    args: list[str] = list(VLLM_MEASUREMENT_ARGS) if engine == "vllm" else []
    if dtype:
        args += ["--dtype", dtype]
    if speculative:
        settings = {
            "algorithm": "DFLASH",
            "draft_model": str(drafter),
            "num_draft_tokens": block_size,
        }
        if engine == "vllm" and temperature > 0 and exported_shape(drafter).algorithm == "dflash2":
            # vLLM's DFlash2 selector walks its candidates by argmax unless told to sample
            # (config/speculative.py draft_sample_method, default "greedy"), where the loop and
            # SGLang sample from the selector's softmax: a sampled evaluation would compare two
            # proposal rules.
            settings["draft_sample_method"] = "probabilistic"
        if engine == "sglang":
            args += ["--speculative-dflash-block-size", str(block_size)]
            if hybrid:
                args += [sglang_mamba_flag(engine_version), "extra_buffer"]
    return ServerSpec(
        engine=engine,
        model=str(target),
        port=port,
        tp=tp,
        mem_fraction=mem_fraction,
        speculative=settings,
        extra_args=args + list(extra_args),
        python=python,
        env=env,
    )


# SGLang renamed --mamba-scheduler-strategy to --mamba-radix-cache-strategy in 0.5.14, kept the old
# name as a deprecated alias up to 0.5.19 and removed it in 0.5.20 (0.5.23 refuses it:
# "unrecognized arguments"); read from the released wheels, parsed by tests/test_sglang_args.py.
SGLANG_MAMBA_FLAG_RENAMED = "0.5.14"


def sglang_mamba_flag(version: str | None) -> str:
    """The flag that selects SGLang's mamba cache strategy in ``version`` (None: a current one)."""
    from packaging.version import InvalidVersion, Version

    try:
        old = version is not None and Version(version) < Version(SGLANG_MAMBA_FLAG_RENAMED)
    except InvalidVersion:
        old = False
    return "--mamba-scheduler-strategy" if old else "--mamba-radix-cache-strategy"


def target_is_hybrid(config) -> bool:
    """Whether a target config has linear-attention (GDN) layers."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return "linear_attention" in (getattr(text, "layer_types", None) or [])


# --- the drafter's config ------------------------------------------------------------------------


def drafter_fields(drafter_dir: str | Path) -> dict:
    """The config.json fields an engine reads from the exported drafter, None where absent.

    Kept with the measurement so a parity failure names what the engine was given: an absent
    mask token id or SWA field is often the whole explanation.
    """
    path = Path(drafter_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json (not an exported drafter folder)") from None
    dflash = config.get("dflash_config") or {}
    fields = {f"dflash_config.{key}": dflash.get(key) for key in DFLASH_CONFIG_FIELDS}
    fields.update({key: config.get(key) for key in TOP_LEVEL_FIELDS})
    return fields


def drafter_block_size(drafter_dir: str | Path) -> int:
    """B as the engines read it: ``dflash_config.block_size`` first, then the top level."""
    fields = drafter_fields(drafter_dir)
    block_size = fields["dflash_config.block_size"] or fields["block_size"]
    if not block_size:
        raise ValueError(f"{drafter_dir}/config.json has no block_size (top level or dflash_config)")
    return block_size


def engine_version(engine: str, url: str, installed: str | None = None) -> str | None:
    """The running server's version: vLLM ``/version``, SGLang ``/get_server_info``; else
    ``installed`` (the version read from the engine's environment)."""
    path = "/version" if engine == "vllm" else "/get_server_info"
    try:
        resp = httpx.get(url + path, timeout=30)
        version = resp.json().get("version") if resp.status_code == 200 else None
        if version:
            return str(version)
    except (httpx.HTTPError, ValueError):
        pass
    return installed


def exported_shape(drafter: str | Path) -> DrafterShape:
    """What decides whether an engine serves the exported drafter, from its config.json."""
    return DrafterShape.from_exported_config(json.loads((Path(drafter) / "config.json").read_text()))


def check_served(
    engine: str, version: str | None, build: str, drafter: str | Path, env: dict[str, str] | None = None
) -> None:
    """EngineUnsupportedError (one line) when the engine-limits table says ``engine``
    ``version`` cannot serve the exported drafter, or would serve it as something less under a
    setting of ``env`` (the server's environment; this process's by default)."""
    shape = exported_shape(drafter)
    refused = refusals(engine, version, build, shape) + downgrades(
        engine, version, shape, env if env is not None else os.environ
    )
    if refused:
        raise EngineUnsupportedError(f"{Path(drafter) / 'config.json'}: {refused[0]}")


def reference_server_model(url: str) -> str:
    """The model a running OpenAI-compatible server serves (``/v1/models``); raises
    EngineResponseError when it does not answer."""
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        raise EngineResponseError(f"reference server {url}: no model list at /v1/models ({err})") from None


# --- lossless ------------------------------------------------------------------------------------

ENGINE_LOSSLESS_METHOD = (
    "token equality of the speculative server's greedy output against the same engine's plain "
    "greedy server; at a divergence, the plain server's top-2 logprob difference there (the "
    "target's logit margin) decides: a near tie within the margin tolerance is rounding in "
    "reduced precision, a larger margin is a lost token"
)


def engine_lossless(
    outputs: dict[str, list[int]],
    plain_outputs: dict[str, list[int]],
    plain_margins: dict[str, list[float | None]],
    margin_tolerance: float,
) -> tuple[dict, dict]:
    """(lossless section in lossless.py's shape, verdict dict per prompt id): exact, near tie or
    lost per prompt, judged as the loop judges its own divergences. A divergence where the engine
    gave no margin is lost (nothing shows it was a tie)."""
    verdicts = {
        pid: compare_greedy(outputs[pid], plain_outputs[pid], plain_margins.get(pid) or [], margin_tolerance)
        for pid in outputs
    }
    summary = lossless_summary(verdicts, margin_tolerance)
    summary["method"] = ENGINE_LOSSLESS_METHOD
    return summary, {pid: v.as_dict() for pid, v in verdicts.items()}


# --- one measurement -----------------------------------------------------------------------------


@dataclass
class EngineMeasurement:
    """What one engine measured: acceptance per prompt, outputs, the lossless check, and what it
    ran (version, the drafter fields it read) for the parity gate's message."""

    engine: str
    engine_version: str | None
    results: list[PromptResult]
    outputs: dict[str, list[int]]
    plain_outputs: dict[str, list[int]]
    lossless: dict
    drafter_fields: dict

    def settings(self) -> dict:
        """The keys the metrics JSON's settings should carry."""
        return {
            "engine": self.engine,
            "engine_version": self.engine_version,
            "drafter_fields": self.drafter_fields,
        }


def measure_in_engine(
    engine: str,
    target: str | Path,
    drafter: str | Path,
    prompts: list[tuple[str, str, list[int]]],
    block_size: int,
    *,
    max_new_tokens: int,
    temperature: float,
    log_dir: str | Path,
    port: int,
    hybrid: bool,
    seed: int | None = None,
    tp: int = 1,
    mem_fraction: float | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    startup_timeout: float = 1800,
    install: EngineInstall | None = None,
    env: dict[str, str] | None = None,
    reference_url: str | None = None,
    dtype: str | None = None,
    margin_tolerance: float | None = None,
    hung_after_s: float = HUNG_AFTER_S,
) -> EngineMeasurement:
    """Launch the speculative server (``install``: the engine environment it runs from), check
    that the version it reports serves the drafter, measure every prompt, stop it; in greedy mode
    decode the same prompts on a plain server (``reference_url``: one already running with the
    same target, else launched on the same port) and compare, a divergence tolerated where the
    target's margin there is at most ``margin_tolerance`` (None: the dtype's default, as the
    loop's). A server silent for ``hung_after_s`` (not even its health check answers) stops it."""
    fields = drafter_fields(drafter)
    configured = fields["dflash_config.block_size"] or fields["block_size"]
    if configured and configured != block_size:
        log.warning("measuring with block size %d; the drafter was exported with %d", block_size, configured)
    log_dir = Path(log_dir)
    build = install.build if install else "gpu"

    def spec(speculative: bool) -> ServerSpec:
        return serving_server_spec(
            engine,
            target,
            drafter,
            block_size,
            port,
            hybrid=hybrid,
            speculative=speculative,
            tp=tp,
            mem_fraction=mem_fraction,
            extra_args=extra_args,
            python=install.python if install else None,
            env=env,
            dtype=dtype,
            engine_version=install.version if install else None,
            temperature=temperature,
        )

    speculative = spec(True)
    with ManagedServer(
        speculative, log_dir / f"{engine}-speculative.log", log_dir, startup_timeout=startup_timeout
    ) as server:
        version = engine_version(engine, speculative.url, install.version if install else None)
        check_served(engine, version, build, drafter, speculative.env)
        results, outputs = request_acceptance(
            engine,
            speculative.url,
            prompts,
            block_size,
            model=str(target),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            alive=server.alive,
            hung_after_s=hung_after_s,
            raw_metrics_dir=log_dir,
        )
    plain_outputs: dict[str, list[int]] = {}
    if temperature > 0:
        lossless = {
            "checked": False,
            "reason": "sampled (temperature > 0): outputs match the target in distribution, not token for token",
        }
    else:
        plain_outputs, plain_seconds, plain_margins = _plain_reference(
            engine,
            spec(False),
            prompts,
            target,
            max_new_tokens,
            seed,
            log_dir,
            startup_timeout,
            reference_url,
            hung_after_s,
        )
        if margin_tolerance is None:
            margin_tolerance = default_margin_tolerance(dtype)
        lossless, verdicts = engine_lossless(outputs, plain_outputs, plain_margins, margin_tolerance)
        if reference_url:
            lossless["reference"] = reference_url
        for result in results:
            result.plain_seconds = plain_seconds[result.id]
            result.plain_tokens = len(plain_outputs[result.id])
            result.extra = {**(result.extra or {}), "lossless": verdicts[result.id]}
    return EngineMeasurement(engine, version, results, outputs, plain_outputs, lossless, fields)


def _plain_reference(
    engine,
    plain: ServerSpec,
    prompts,
    target,
    max_new_tokens,
    seed,
    log_dir,
    startup_timeout,
    reference_url,
    hung_after_s,
) -> tuple[dict[str, list[int]], dict[str, float], dict[str, list[float | None]]]:
    """Greedy outputs (and seconds, margins) of the target without the drafter: from the running server at
    ``reference_url`` (it must serve the same target), else from a plain server launched here."""
    if reference_url:
        served = reference_server_model(reference_url)
        if served != str(target):
            raise EngineResponseError(
                f"reference server {reference_url} serves {served!r}, not the target {str(target)!r}"
            )
        return request_plain(
            engine,
            reference_url.rstrip("/"),
            prompts,
            model=str(target),
            max_new_tokens=max_new_tokens,
            seed=seed,
            hung_after_s=hung_after_s,
        )
    with ManagedServer(plain, log_dir / f"{engine}-plain.log", log_dir, startup_timeout=startup_timeout) as server:
        return request_plain(
            engine,
            plain.url,
            prompts,
            model=str(target),
            max_new_tokens=max_new_tokens,
            seed=seed,
            alive=server.alive,
            hung_after_s=hung_after_s,
        )
