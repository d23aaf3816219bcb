"""The project's own speculative-decoding loop over a set of prompts, with the target in
transformers: the options of an evaluation (``EvalOptions``, defaults from the config schema),
the prompts rendered with the target's chat template, each decoded speculatively and plainly, and
the lossless verdicts. ``stages.evaluate`` drives it (and the serving engines beside it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

from dflash_pipeline.core.config import schema_defaults

log = logging.getLogger(__name__)

# The `evaluate` section's defaults (dflash_pipeline/config/schema.yaml): the options and the CLI show these.
DEFAULTS = schema_defaults("evaluate")


@dataclass
class EvalOptions:
    max_new_tokens: int = DEFAULTS["max_new_tokens"]
    temperature: float = float(DEFAULTS["temperature"])
    block_size: int | None = None  # default: the drafter's
    thinking: bool = True
    seed: int = 0
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    lossless_margin: float | None = DEFAULTS["lossless_margin"]  # None: by dtype (0 in fp32)
    engine: str = DEFAULTS["engine"]  # transformers | vllm | sglang (the loop, and that engine too)
    limit: int | None = None  # evaluate only the first N prompts
    split: str | None = None  # only rows of this split ("heldout" in the prepare stage's parquet)
    simulated_tau: float | None = None  # training's teacher-forced tau, for the parity gate
    parity_tolerance: float = DEFAULTS["parity_tolerance"]
    # The serving engine's tau against the loop's.
    engine_parity_tolerance: float = DEFAULTS["engine_parity_tolerance"]
    warmup: bool = True
    engine_port: int | None = None  # None: a free port
    engine_tp: int = 1
    engine_mem_fraction: float | None = DEFAULTS["engine_mem_fraction"]
    engine_extra_args: tuple[str, ...] = tuple(DEFAULTS["engine_extra_args"])
    engine_hung_after_s: float = DEFAULTS["engine_hung_after_s"]
    runtime_dir: str | None = None  # the engine's log and pid files (default: beside --out)
    # How the serving engine is launched: the `engines` config section ({engine: {python, env}}).
    engines: dict | None = None
    # A running plain server of the engine with the same target: the lossless reference.
    engine_reference_url: str | None = DEFAULTS["engine_reference_url"]
    # A drafter exported against other target weights: refuse, or warn and evaluate.
    target_mismatch: str = DEFAULTS["target_mismatch"]
    # The target measured against, quantized as training's can be (model.quantized).
    target_quantization: str | None = DEFAULTS["target_quantization"]


# The `evaluate` section's names that differ from the options'.
SECTION_NAMES = {"max_prompts": "limit"}


def eval_options(values: Mapping, **chosen) -> EvalOptions:
    """The options of an evaluation, the only way they are built: from ``values`` (the `evaluate`
    section's keys, as the job's settings or the command line's arguments name them; keys that
    are no option are ignored, missing ones take their defaults) and ``chosen`` (options by name,
    over ``values``; an unknown name is a TypeError)."""
    names = {field.name for field in fields(EvalOptions)}
    picked = {SECTION_NAMES.get(key, key): value for key, value in values.items()}
    picked = {key: value for key, value in picked.items() if key in names} | chosen
    if "engine_extra_args" in picked:
        picked["engine_extra_args"] = tuple(picked["engine_extra_args"])
    return EvalOptions(**picked)


def resolve_device_dtype(options: EvalOptions):
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = options.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    try:
        torch_dtype = getattr(torch, dtype)
        assert isinstance(torch_dtype, torch.dtype)
    except (AttributeError, AssertionError):
        raise ValueError(f"--dtype {dtype!r} is not a torch dtype (float32, bfloat16, float16)") from None
    return torch.device(device), torch_dtype


def render_prompts(tokenizer, prompts, thinking: bool) -> list[list[int]]:
    from dflash_pipeline.data.chat import render_prompt

    rendered = []
    for prompt in prompts:
        text = render_prompt(tokenizer, prompt.messages, thinking)
        rendered.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rendered


def loop_settings(options: EvalOptions, stop, index: int, max_new_tokens: int | None = None):
    """How the loop decodes prompt ``index``: ``options``' budget (or ``max_new_tokens``) and
    temperature, stopping at ``stop``, sampling with the seed ``options.seed + index`` (one seed
    per prompt: sampled runs are reproducible and prompts independent)."""
    from dflash_pipeline.evaluation.loop import DecodeSettings

    return DecodeSettings(max_new_tokens or options.max_new_tokens, options.temperature, stop, options.seed + index)


def decode_prompts(runner, proposer, prompts, prompt_ids, stop, options: EvalOptions, plain: bool) -> Iterator[tuple]:
    """Each of ``prompts`` (rendered as ``prompt_ids``) decoded speculatively by ``proposer``
    against ``runner``'s target, and with ``plain`` also plainly, under ``loop_settings``: yields
    ``(prompt, result, settings, trace, plain_trace)`` in order, ``result`` its acceptance (a
    ``PromptResult`` with the trajectory's digest), ``plain_trace`` None without ``plain``. The
    evaluate job's loop and each training segment's τ decode prompts through this one function."""
    from dflash_pipeline.evaluation.loop import plain_decode, speculative_decode
    from dflash_pipeline.evaluation.metrics import PromptResult, trajectory_digest

    for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        settings = loop_settings(options, stop, index)
        trace = speculative_decode(runner, proposer, ids, settings)
        plain_trace = plain_decode(runner, ids, settings) if plain else None
        result = PromptResult.from_traces(prompt.id, prompt.prompt_set, len(ids), trace, plain_trace)
        result.trajectory = trajectory_digest(trace.tokens, stop)
        yield prompt, result, settings, trace, plain_trace


def run_transformers_loop(target, drafter, prompts, options: EvalOptions, load_proposer, model=None):
    from transformers import AutoTokenizer

    from dflash_pipeline.evaluation.lossless import (
        default_margin_tolerance,
        compare_greedy,
        lossless_summary,
    )
    from dflash_pipeline.evaluation.loop import plain_decode, speculative_decode
    from dflash_pipeline.evaluation.runner import loop_target
    from dflash_pipeline.model.target import load_target

    if load_proposer is None:
        # Imported here: the drafter package is only needed by this engine.
        from dflash_pipeline.model.inference import load_proposer

    device, dtype = resolve_device_dtype(options)
    tokenizer = AutoTokenizer.from_pretrained(target)
    if model is None:
        model = load_target(target, device, dtype)
    proposer = load_proposer(drafter, model)
    if options.block_size is not None:
        if options.block_size < 2:
            raise ValueError(f"--block-size must be at least 2, got {options.block_size}")
        proposer.block_size = options.block_size
    runner, stop = loop_target(model, tokenizer, proposer.target_layer_ids)
    prompt_ids = render_prompts(tokenizer, prompts, options.thinking)
    margin = options.lossless_margin
    if margin is None:
        margin = default_margin_tolerance(dtype)

    if options.warmup:
        # Kernel selection and allocator growth would otherwise be billed to the first prompt.
        warm = loop_settings(options, stop, 0, min(8, options.max_new_tokens))
        speculative_decode(runner, proposer, prompt_ids[0], warm)
        plain_decode(runner, prompt_ids[0], warm)

    results, verdicts = [], {}
    decoded = decode_prompts(runner, proposer, prompts, prompt_ids, stop, options, plain=True)
    for index, (prompt, result, settings, trace, plain) in enumerate(decoded):
        if settings.greedy:
            verdict = compare_greedy(trace.tokens, plain.tokens, plain.margins, margin)
            verdicts[prompt.id] = verdict
            result.extra = {"lossless": verdict.as_dict()}
        results.append(result)
        log.info(
            "prompt %d/%d %s: tau %s, %d tokens in %d verify steps%s",
            index + 1,
            len(prompts),
            prompt.id,
            None if result.tau is None else round(result.tau, 3),
            result.generated_tokens,
            result.verify_steps,
            f", lossless {verdicts[prompt.id].verdict}" if prompt.id in verdicts else "",
        )
    if verdicts:
        lossless = lossless_summary(verdicts, margin)
    else:
        lossless = {
            "checked": False,
            "reason": "sampled verification (temperature > 0): outputs match the target in "
            "distribution, not token for token",
        }
    resolved = {
        "algorithm": getattr(getattr(proposer, "config", None), "algorithm", "dflash"),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": proposer.block_size,
        "target_layer_ids": list(proposer.target_layer_ids),
        "target_rollback": ("snapshot+rerun (hybrid linear-attention target)" if runner.is_hybrid else "crop"),
        "stop_token_ids": sorted(stop),
    }
    return results, {"lossless": lossless}, resolved
