"""τ while it trains: one training segment's checkpoint measured in the speculative-decoding loop.

Rule ``segment_tau`` runs this for each segment once its checkpoint is published, as a job of its
own that the next segment does not wait for. The drafter is built from the checkpoint's weights
(no export), the target decodes the first ``train.segment_eval.prompts`` held-out prompts through
evaluate's loop (``evaluation.transformers_loop.decode_prompts``: its seeds, one per prompt, and
stop tokens), and the acceptance length τ is aggregated as evaluate's metrics are
(``evaluation.metrics.aggregate``: committed tokens over verify steps). Plain decoding, the lossless check and the parity gates are evaluate's business:
a segment's job measures τ only, so it costs one speculative decode of a small fixed budget.

One small JSON object per segment (``layout.segment_tau_key``); the report's training figure and
the status page read them back with ``read_segment_taus``, and the plan counts their cost with
``segment_tau_cost``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import StorageError

# What the plan assumes of a segment's job before one was measured: every new token costs a
# target forward (τ = 1, the worst case) that reads all of the target's weights at this rate
# (batch-1 decoding is bound by memory bandwidth; an H100's HBM3 gives ~3.35 TB/s at its peak),
# plus loading the target once at the load rate.
ASSUMED_WEIGHT_READ_BYTES_PER_S = 2.0e12
ASSUMED_LOAD_BYTES_PER_S = 1.0e9


class SegmentTauError(ValueError):
    """A segment's record cannot be read or holds no valid τ; the message names the object."""


def checkpoint_proposer(storage, manifest: dict, manifest_path: str, target_model):
    """The drafter of the segment ``manifest`` describes, from its checkpoint's weights in the run
    root ``storage``, as the loop's proposer beside ``target_model`` (its embedding and LM head,
    on its device and in its dtype)."""
    from dflash_pipeline.model.config import DrafterConfig
    from dflash_pipeline.model.drafter import DFlashDrafter
    from dflash_pipeline.model.inference import DFlashProposer
    from dflash_pipeline.model.target import target_embeddings
    from dflash_pipeline.training.checkpoint import load_model_weights

    prefix = manifest["checkpoint_prefix"]
    weights = load_model_weights(storage, prefix)
    if weights is None:
        raise FileNotFoundError(f"{manifest_path}: no checkpoint at {storage.join(prefix)}")
    config = DrafterConfig.from_zlab(manifest["drafter_config"], source=manifest_path)
    drafter = DFlashDrafter(config)
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{storage.join(prefix)}: the checkpoint's tensors differ from the drafter's: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    embed, head = target_embeddings(target_model)
    drafter = drafter.to(device=embed.device, dtype=embed.dtype)
    return DFlashProposer(drafter, embed, head)


def measure(target_dir: str, model, proposer, prompts, options) -> list:
    """Each prompt decoded speculatively once, as a ``PromptResult``: through evaluate's loop
    (``transformers_loop.decode_prompts``), so with its seeds and stop tokens."""
    from transformers import AutoTokenizer

    from dflash_pipeline.evaluation.runner import loop_target
    from dflash_pipeline.evaluation.transformers_loop import decode_prompts, render_prompts

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    runner, stop = loop_target(model, tokenizer, proposer.target_layer_ids)
    prompt_ids = render_prompts(tokenizer, prompts, options.thinking)
    return [
        result for _, result, *_ in decode_prompts(runner, proposer, prompts, prompt_ids, stop, options, plain=False)
    ]


def segment_record(segment: int, manifest: dict, results: list, settings: dict, seconds: float) -> dict:
    """The object rule segment_tau writes: the segment, its last step, τ over its prompts (as
    evaluate's ``overall``), each prompt's τ, the budget and how long the job measured."""
    from dflash_pipeline.evaluation.metrics import aggregate

    overall = aggregate(results)
    record = {
        "segment": segment,
        # The segment's last optimizer step, as its metrics number it (steps [start, end)).
        "step": manifest["steps"][1] - 1 if manifest.get("steps") else None,
        "tau": overall["tau"],
        "tau_mean_of_prompts": overall["tau_mean_of_prompts"],
        "block_size": results[0].block_size if results else None,
        "prompts": overall["prompts"],
        "verify_steps": overall["verify_steps"],
        "committed_tokens": overall["committed_tokens"],
        "generated_tokens": overall["generated_tokens"],
        "per_prompt": [{"id": r.id, "tau": r.as_dict()["tau"]} for r in results],
        "loss": (manifest.get("last_metrics") or {}).get("loss"),
        "settings": settings,
        "seconds": round(seconds, 3),
    }
    check_record(record, f"segment {layout.segment_name(segment)}")
    return record


def check_record(record: object, where: str) -> dict:
    """``record`` if it holds a τ the loop can give (finite, 1 <= τ <= its block size), else
    SegmentTauError naming ``where``."""
    if not isinstance(record, dict):
        raise SegmentTauError(f"{where}: not a JSON object")
    tau = record.get("tau")
    if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not math.isfinite(tau):
        raise SegmentTauError(f"{where}: tau {tau!r} is not a finite number")
    block = record.get("block_size")
    if tau < 1 or (isinstance(block, int) and tau > block):
        raise SegmentTauError(f"{where}: tau {tau} is outside [1, {block or 'B'}] (accepted drafts + 1 per step)")
    return record


def run_segment_tau(
    run_url: str,
    segment: int,
    manifest_path: str,
    target_dir: str,
    prompts_url: str,
    out: str | Path,
    settings: dict,
    thinking: bool,
    device: str = "auto",
) -> dict:
    """Measure segment ``segment`` (its manifest at ``manifest_path``) on the held-out prompts of
    ``prompts_url`` (the run's ingested prompts) and write its record to ``out`` atomically."""
    from dflash_pipeline.core.storage import open_storage, write_atomically
    from dflash_pipeline.evaluation.prompts import read_eval_prompts
    from dflash_pipeline.evaluation.transformers_loop import eval_options, resolve_device_dtype
    from dflash_pipeline.model.target import load_target

    started = time.monotonic()
    manifest = json.loads(Path(manifest_path).read_text())
    # Evaluate's options but for the budget: its seeds (the evaluate job leaves them at their
    # default), its temperature, the device's dtype; no warm-up, nothing here is timed.
    options = eval_options(settings, thinking=thinking, device=device, warmup=False)
    prompts = read_eval_prompts(prompts_url, settings["prompts"], split="heldout")
    # The target the segment trained against: its taps came from the quantized one where
    # train.target_quantization says (the rule passes it in the settings).
    model = load_target(target_dir, *resolve_device_dtype(options), options.target_quantization)
    proposer = checkpoint_proposer(open_storage(run_url), manifest, manifest_path, model)
    results = measure(target_dir, model, proposer, prompts, options)
    record = segment_record(segment, manifest, results, settings, time.monotonic() - started)
    with write_atomically(out) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    return record


def read_segment_taus(storage, segments: Iterable[int]) -> dict[int, dict]:
    """The records of ``segments`` in the run root ``storage`` that exist, by segment; a record
    that does not parse or holds no valid τ raises SegmentTauError naming its object."""
    found = {}
    for segment in segments:
        key = layout.segment_tau_key(segment)
        try:
            text = storage.read_text(key)
        except StorageError:
            continue
        try:
            record = json.loads(text)
        except ValueError as err:
            raise SegmentTauError(f"{storage.join(key)}: not JSON ({err})") from None
        found[segment] = check_record(record, storage.join(key))
    return found


def segment_tau_cost(config: dict, weight_bytes: int | None, measured_seconds: list[float] = ()) -> dict:
    """What rule segment_tau costs a run of ``config`` (a validated config): jobs, tokens decoded,
    and hours on the devices training uses (GPU-hours with GPUs, else hours of the CPU), from the
    mean of ``measured_seconds`` (finished segments' records) when there are any, else from the
    assumption above over the target's ``weight_bytes``."""
    train = config["train"]
    budget = train["segment_eval"]
    jobs = train["segments"] if budget["enabled"] else 0
    tokens = budget["prompts"] * budget["max_new_tokens"]
    gpus = min(1, train["gpus_per_job"])
    if measured_seconds:
        seconds = sum(measured_seconds) / len(measured_seconds)
        source = f"{len(measured_seconds)} measured segment(s)"
    elif weight_bytes:
        seconds = weight_bytes / ASSUMED_LOAD_BYTES_PER_S + tokens * weight_bytes / ASSUMED_WEIGHT_READ_BYTES_PER_S
        source = (
            "assumed: one target forward per token (τ = 1) reading its weights at "
            f"{ASSUMED_WEIGHT_READ_BYTES_PER_S / 1e12:.0f} TB/s, and its load at {ASSUMED_LOAD_BYTES_PER_S / 1e9:.0f} GB/s"
        )
    else:
        seconds, source = None, "unknown: the target's weights are not there to size it"
    hours = jobs * seconds / 3600 if seconds is not None else None
    return {
        "jobs": jobs,
        "prompts": budget["prompts"],
        "max_new_tokens": budget["max_new_tokens"],
        "tokens_per_job": tokens if jobs else 0,
        "gpus_per_job": gpus,
        "seconds_per_job": {"value": seconds, "source": source},
        "gpu_hours": hours * max(gpus, 1) if hours is not None else None,
    }


def cost_line(cost: dict, on_cpu: bool = False) -> str:
    """The plan's line for ``segment_tau_cost``'s figures."""
    seconds = cost["seconds_per_job"]
    if not cost["jobs"]:
        return "  segment τ          off (train.segment_eval.enabled: false)"
    hours = "?" if cost["gpu_hours"] is None else f"{cost['gpu_hours']:,.2f}"
    each = "?" if seconds["value"] is None else f"{seconds['value']:,.0f} s"
    unit = "hours on the CPU" if on_cpu else "GPU-hours"
    return (
        f"  segment τ          {cost['jobs']} jobs of {cost['prompts']} prompts x {cost['max_new_tokens']} tokens: "
        f"{hours} {unit}, {each} each ({seconds['source']}); beside training, not in its way"
    )


def measured_seconds(storage, segments: Iterable[int]) -> list[float]:
    """The ``seconds`` of the finished segments' records (for the plan); unreadable ones skipped."""
    try:
        records = read_segment_taus(storage, segments)
    except SegmentTauError:
        return []
    return [float(r["seconds"]) for r in records.values() if isinstance(r.get("seconds"), (int, float))]
