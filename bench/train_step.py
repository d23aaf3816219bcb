"""Drafter training step on a GPU: the step alone (target taps given, as the reference was
measured) and the online step (the target's forward included), random bf16 weights.

Cases (the references are SpecForge's published step times on one H200):
- ``qwen3-8b``: 5-layer drafter of Qwen3-8B shape, S=3072, 512 anchors, block 16, batch 1;
  reference (SpecForge, flex attention, one H200): 0.180 s, 17.1k tok/s, 23.8 GiB.
- ``qwen3.6-27b``: the 27B example's drafter (hidden 5120, 4 sliding + 1 full layer, window 2048,
  vocab 248320), S=4096, 512 anchors; reference step 0.287 s, 36.9 GiB. Its online target is a
  Qwen3.5-style hybrid (3 Gated-DeltaNet : 1 attention, 64 layers) of the 27B shape.

    python bench/train_step.py --case qwen3-8b --out bench/results/train_step-qwen3-8b.json
    python bench/train_step.py --algorithm dflash dflash2 --out bench/results/train_step-dflash2-h200.json

``--target-quantization fp8`` runs the online step against the target quantized as
``train.target_quantization: fp8`` does it (``dflash_pipeline.model.quantized``: FP8 weight-only
decoder linears), the way a 27B target fits beside the drafter's step on an 80 GB card.

``--algorithm dflash2`` builds the DFlash2 drafter of the same shape with the schema's DFlash2
defaults (conv kernel/group, selector rank and top-K) and trains it with the selector term at
its full weight (the step after the warm-up).

Runs exactly the training job's ``optimizer_step`` (dflash_pipeline.training.step).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchlib import commit as bench_commit  # noqa: E402

from dflash_pipeline.model.config import DFLASH, DFLASH2, DFLASH2_KEYS, FULL, SLIDING, DrafterConfig  # noqa: E402
from dflash_pipeline.model.drafter import DFlashDrafter  # noqa: E402
from dflash_pipeline.training.step import optimizer_step  # noqa: E402
from dflash_pipeline.training.step import make_optimizer  # noqa: E402

PEAK_BF16_TFLOPS = 790.0  # measured dense bf16 peak of one H200

CASES = {
    "qwen3-8b": {
        "seq_len": 3072,
        "reference": {"step_s": 0.180, "tokens_per_s": 17100, "peak_gib": 23.8},
        "drafter": dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=5,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            block_size=16,
            mask_token_id=151669,
            num_target_layers=36,
            target_layer_ids=[1, 9, 17, 25, 33],
            rope_theta=1e6,
        ),
        "target": dict(
            kind="qwen3",
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ),
    },
    "qwen3.6-27b": {
        "seq_len": 4096,
        "reference": {"step_s": 0.287, "peak_gib": 36.9},
        "drafter": dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=5,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=248320,
            block_size=16,
            mask_token_id=248070,
            num_target_layers=64,
            target_layer_ids=[1, 16, 31, 46, 61],
            layer_types=[SLIDING] * 4 + [FULL],
            sliding_window=2048,
            rope_theta=1e7,
        ),
        "target": dict(
            kind="qwen3_5",
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            vocab_size=248320,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
        ),
    },
}


def drafter_step_flops(config: DrafterConfig, seq_len: int, num_blocks: int, supervised_rows: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward matmuls); attention
    counts only the visible keys (context before each anchor, on average S/2, plus the block)."""
    h, q_dim, kv_dim = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    queries = num_blocks * config.block_size
    per_layer_block = 2 * queries * (h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * config.intermediate_size)
    per_layer_context = 2 * seq_len * (2 * h * kv_dim)
    visible = seq_len / 2 + config.block_size
    visible_sliding = min(visible, config.sliding_window or visible)
    attention = 0.0
    for layer_type in config.layer_types:
        keys = visible_sliding if layer_type == SLIDING else visible
        attention += 2 * 2 * queries * keys * q_dim
    fc = 2 * seq_len * config.num_taps * h * h
    lm_head = 2 * supervised_rows * h * config.vocab_size
    forward = config.num_hidden_layers * (per_layer_block + per_layer_context) + attention + fc + lm_head
    return 3 * forward


def train_defaults() -> dict:
    """The `train` section's defaults, read from the schema (the GPU image lacks jsonschema)."""
    import yaml

    schema = yaml.safe_load((REPO / "dflash_pipeline" / "config" / "schema.yaml").read_text())
    return {k: v.get("default") for k, v in schema["properties"]["train"]["properties"].items()}


def target_config(spec: dict):
    """The transformers config of a case's target: dense Qwen3, or a Qwen3.5-style hybrid (3
    Gated-DeltaNet layers : 1 attention layer)."""
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**spec, max_position_embeddings=40960)
    from transformers import Qwen3_5TextConfig

    layers = spec["num_hidden_layers"]
    return Qwen3_5TextConfig(
        **spec,
        max_position_embeddings=40960,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )


def random_target(spec: dict, device, quantization: str | None = None):
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.model.quantized import quantize

    config = target_config(spec)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    # Linear by linear, as the training job's loader does: the peak is the bf16 model's size.
    return quantize(model, quantization)


def run_case(
    name: str, mode: str, steps: int, warmup: int, attention: str, anchors: int,
    profile: bool = False, algorithm: str = DFLASH, quantization: str | None = None,
) -> dict:  # fmt: skip
    case = CASES[name]
    device = torch.device("cuda")
    torch.manual_seed(0)
    settings = {**train_defaults(), "num_anchors": anchors, "algorithm": algorithm}
    dflash2 = {key: settings[key] for key in DFLASH2_KEYS} if algorithm == DFLASH2 else {}
    config = DrafterConfig(**case["drafter"], dtype="bfloat16", algorithm=algorithm, **dflash2)
    seq_len = case["seq_len"]
    target = taps_fn = None
    if mode == "online":
        from dflash_pipeline.model.taps import TargetTaps

        target = random_target(case["target"], device, quantization)
        torch.cuda.empty_cache()
        target_gib = torch.cuda.memory_allocated(device) / 2**30
        taps_fn = TargetTaps(target, config.target_layer_ids)
        embed = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
    else:
        embed = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
        head = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    drafter = DFlashDrafter(config).to(device)
    optimizer = make_optimizer(drafter, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    # A realistic sequence: a prompt of 10% then a supervised response.
    input_ids = torch.randint(0, config.vocab_size - 1000, (1, seq_len), device=device)
    loss_mask = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    loss_mask[:, seq_len // 10 :] = 1
    fixed_taps = None
    if mode == "drafter":
        fixed_taps = torch.randn(1, seq_len, config.num_taps * config.hidden_size, device=device, dtype=torch.bfloat16)
    times, target_times = [], []
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if mode == "online":
            taps = taps_fn(input_ids)
            torch.cuda.synchronize()
            target_times.append(time.perf_counter() - start)
        else:
            taps = fixed_taps
        out = optimizer_step(
            drafter,
            optimizer,
            scheduler,
            taps,
            input_ids,
            loss_mask,
            embed,
            head,
            settings,
            torch.Generator().manual_seed(step),
            attention,
        )
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step == warmup - 1:
            torch.cuda.reset_peak_memory_stats(device)
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for step in range(2):
                taps = taps_fn(input_ids) if mode == "online" else fixed_taps
                optimizer_step(
                    drafter,
                    optimizer,
                    scheduler,
                    taps,
                    input_ids,
                    loss_mask,
                    embed,
                    head,
                    settings,
                    torch.Generator().manual_seed(step),
                    attention,
                )
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
    measured = times[warmup:]
    step_s = sum(measured) / len(measured)
    rows = int(out.blocks.supervised.sum())
    flops = drafter_step_flops(config, seq_len, int(out.blocks.keep.sum()), rows)
    drafter_s = step_s - (sum(target_times[warmup:]) / steps if target_times else 0.0)
    result = {
        "case": name,
        "algorithm": algorithm,
        **dflash2,
        "mode": mode,
        "attention": attention,
        "seq_len": seq_len,
        "num_anchors": anchors,
        "block_size": config.block_size,
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "step_s": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in measured],
        "tokens_per_s": round(seq_len / step_s, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        "drafter_tflops_per_step": round(flops / 1e12, 2),
        "mfu_drafter": round(flops / drafter_s / (PEAK_BF16_TFLOPS * 1e12), 3),
        "loss": round(out.loss.loss.item(), 4),
        "reference": case["reference"],
    }
    if mode == "online":
        result["target_quantization"] = quantization
        result["target_resident_gib"] = round(target_gib, 2)
    if out.selector is not None:
        result["selector_loss"] = round(out.selector.loss.item(), 4)
    if target_times:
        target_s = sum(target_times[warmup:]) / steps
        result["target_forward_s"] = round(target_s, 4)
        result["target_tokens_per_s"] = round(seq_len / target_s, 1)
    del target, taps_fn, drafter, optimizer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), nargs="+", default=sorted(CASES))
    parser.add_argument("--mode", choices=["drafter", "online"], nargs="+", default=["drafter", "online"])
    parser.add_argument("--algorithm", choices=[DFLASH, DFLASH2], nargs="+", default=[DFLASH])
    parser.add_argument("--attention", choices=["flex", "sdpa"], default="flex")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--target-quantization", choices=["fp8"], help="the online target's quantization (train.target_quantization)"
    )
    parser.add_argument("--profile", action="store_true", help="print the top kernels of two more steps")
    parser.add_argument("--out")
    args = parser.parse_args()
    commit = bench_commit()
    records = []
    for case in args.case:
        for algorithm in args.algorithm:
            for mode in args.mode:
                try:
                    record = run_case(
                        case, mode, args.steps, args.warmup, args.attention, args.anchors,
                        args.profile, algorithm, args.target_quantization,
                    )  # fmt: skip
                except Exception as err:  # record it and go on with the other cases
                    record = {
                        "case": case,
                        "algorithm": algorithm,
                        "mode": mode,
                        "error": f"{type(err).__name__}: {err}"[:2000],
                    }
                    torch.cuda.empty_cache()
                print(json.dumps(record), flush=True)
                records.append(record)
                write_summary(args.out, commit, records)


def write_summary(out, commit, records) -> None:
    summary = {
        "benchmark": "train_step",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "commit": commit,
        "date": dt.date.today().isoformat(),
        "results": records,
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
