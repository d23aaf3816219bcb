"""Step-time cost of checkpointing every 50 steps over a 200-step training window.

The same drafter training step as the training job (``optimizer_step``, fixed random taps) runs
``--windows`` consecutive windows of steps, once per mode from the same seed: with no checkpoint,
with the trainer's synchronous checkpoints (train.checkpoint_async false) and with its background
ones (the default), each written through the storage layer (a local folder, or ``--run-url
s3://...``) exactly as ``dflash_pipeline.training.trainer`` does: reserve the rank's page-locked
buffers after the first step, stage this rank's share at a checkpoint, write it in a thread,
commit the index at the first step boundary where the write is done, wait for it before the
next checkpoint. A window ends with its last step: the save begun there is written (and paid for)
during the next window, as in a job that trains on; the run's last save is waited for at its end
(``final_wait_s``, paid once per job at its segment end).

``cost``: the mean window's wall time over the no-checkpoint mode's, minus 1.
``cost_last_window_with_final_wait``: the last window plus that final wait, the cost of a job
that ends after it. ``cost_within_window``: the checkpoint steps' extra time (median checkpoint
step minus median plain step, plus waits) over the run's steps, from one run's own steps (robust
to a machine whose load changes between modes).

    python bench/checkpoint_cost.py --case tiny --out bench/results/checkpoint_cost-cpu.json
    python bench/checkpoint_cost.py --case qwen3.6-27b --share-of 8 --modes none async --windows 2 \
        --out bench/results/checkpoint_cost-h200.json

``--share-of N`` writes the share one rank of an N-GPU job writes (the state is replicated by DDP
and split over the ranks by bytes), so one GPU measures what each of 8 pays. Under torchrun the
ranks write their real shares together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import cpu_model, emit, provenance  # noqa: E402

from dflash_pipeline.core.storage import open_storage  # noqa: E402
from dflash_pipeline.model.config import DrafterConfig  # noqa: E402
from dflash_pipeline.model.drafter import DFlashDrafter  # noqa: E402
from dflash_pipeline.training.checkpoint import capture_rng  # noqa: E402
from dflash_pipeline.training.rolling_checkpoints import RollingCheckpoints  # noqa: E402
from dflash_pipeline.training.step import optimizer_step  # noqa: E402
from dflash_pipeline.training.distributed import Distributed  # noqa: E402
from dflash_pipeline.training.step import make_optimizer  # noqa: E402

TINY = {  # small enough for 3 x 200 steps on a busy 2-core machine
    "seq_len": 96,
    "num_anchors": 16,
    "drafter": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        block_size=4,
        mask_token_id=3,
        num_target_layers=8,
        target_layer_ids=[1, 5],
        rope_theta=1e4,
    ),
}


class ShareOf:
    """One rank of an N-rank job, alone: it writes that rank's share; the index names only it."""

    def __init__(self, world: int):
        self.rank, self.world = 0, world

    def gather_objects(self, obj):
        return [obj]

    def barrier(self) -> None:
        pass


def case_spec(name: str) -> dict:
    if name == "tiny":
        return TINY
    from train_step import CASES  # the GPU cases of bench/train_step.py

    return CASES[name]


def train_settings(spec: dict) -> dict:
    from train_step import train_defaults

    return {**train_defaults(), "num_anchors": spec.get("num_anchors", 512)}


def run_window(mode: str, args, spec: dict, device, group, storage) -> dict:
    torch.manual_seed(0)
    config = DrafterConfig(**spec["drafter"], dtype="bfloat16")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    seq_len = spec["seq_len"]
    settings = train_settings(spec)
    drafter = DFlashDrafter(config).to(device)
    optimizer = make_optimizer(drafter, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    embed = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=dtype) * 0.02
    head = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=dtype) * 0.02
    input_ids = torch.randint(0, config.vocab_size - 16, (1, seq_len), device=device)
    loss_mask = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    loss_mask[:, seq_len // 10 :] = 1
    taps = torch.randn(1, seq_len, config.num_taps * config.hidden_size, device=device, dtype=dtype)
    attention = "flex" if device.type == "cuda" else "sdpa"
    rolling = RollingCheckpoints(storage, f"bench-{mode}/")
    pending = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def state(step):
        return {
            "step": step,
            "model": drafter.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }

    def step_once(step):
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

    for step in range(args.warmup):
        step_once(step)
        if step == 0 and mode == "async":  # as the trainer: once the optimizer state exists
            rolling.reserve(state(step), group)
    sync()
    times, checkpoint_steps, waits, stage_s, write_s, windows_s = [], [], [], [], [], []
    window_start = run_start = time.perf_counter()
    for i in range(1, args.steps * args.windows + 1):
        started = time.perf_counter()
        step_once(args.warmup + i)
        sync()
        if pending is not None and pending.done():
            write_s.append(pending.write_s)
            rolling.commit(pending, group)
            pending = None
        if mode != "none" and i % args.every == 0:
            checkpoint_steps.append(i)
            if pending is not None:  # at most one save in flight, as in the trainer
                wait_start = time.perf_counter()
                rolling.commit(pending, group)
                waits.append(time.perf_counter() - wait_start)
                write_s.append(pending.write_s)
                pending = None
            stage_start = time.perf_counter()
            if mode == "sync":
                rolling.save(state(i), capture_rng(device), group)
            else:
                pending = rolling.begin(state(i), capture_rng(device), group)
            stage_s.append(time.perf_counter() - stage_start)  # sync: the whole save
        times.append(time.perf_counter() - started)
        if i % args.every == 0:  # progress of a long GPU window
            print(f"{mode} step {i}/{args.steps * args.windows} {time.perf_counter() - run_start:.1f} s", flush=True)
        if i % args.steps == 0:
            # A window ends with its last step; the save begun there is written during the next
            # window (and paid there), as in a job that trains on.
            windows_s.append(time.perf_counter() - window_start)
            window_start = time.perf_counter()
    end_wait = 0.0
    if pending is not None:  # the run's last save, committed once training stops
        wait_start = time.perf_counter()
        rolling.commit(pending, group)
        end_wait = time.perf_counter() - wait_start
        write_s.append(pending.write_s)
    window_s = statistics.mean(windows_s)
    plain = [t for i, t in enumerate(times, 1) if i not in checkpoint_steps]
    on_checkpoint = [t for i, t in enumerate(times, 1) if i in checkpoint_steps]
    shard_bytes = sum(o.size for o in storage.list(f"bench-{mode}/step-"))
    rolling.clear()
    return {
        "mode": mode,
        "windows_s": [round(w, 3) for w in windows_s],
        "window_s": round(window_s, 3),
        "mean_step_s": round(window_s / args.steps, 5),
        "median_plain_step_s": round(statistics.median(plain), 5),
        "median_checkpoint_step_s": round(statistics.median(on_checkpoint), 5) if on_checkpoint else None,
        "waits_for_previous_s": [round(w, 3) for w in waits],
        "final_wait_s": round(end_wait, 3),
        # On the training thread: copying this rank's share off the GPU (async) or the whole
        # save (sync); in the background: serializing, hashing and storing it.
        "stage_s": [round(t, 3) for t in stage_s],
        "background_write_s": [round(t, 3) for t in write_s],
        "checkpoints": len(checkpoint_steps),
        "bytes_per_checkpoint_this_rank": shard_bytes,
        "state_params": sum(p.numel() for p in drafter.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="tiny", help="tiny (CPU) or a case of bench/train_step.py")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--windows", type=int, default=1, help="consecutive windows of --steps steps")
    parser.add_argument("--share-of", type=int, default=1, help="write one rank's share of an N-rank job")
    parser.add_argument("--run-url", help="where checkpoints go (default: a temp folder)")
    parser.add_argument("--modes", nargs="+", default=["none", "sync", "async"])
    parser.add_argument("--out")
    args = parser.parse_args()
    dist = Distributed.from_env()
    if torch.cuda.is_available():
        device = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        device, name = torch.device("cpu"), f"CPU: {cpu_model()} ({torch.get_num_threads()} threads)"
    group = dist if dist.world > 1 else (ShareOf(args.share_of) if args.share_of > 1 else dist)
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-bench-") as tmp:
        storage = open_storage(args.run_url or tmp)
        results = []
        for mode in args.modes:
            results.append(run_window(mode, args, case_spec(args.case), device, group, storage))
            print(json.dumps(results[-1]), flush=True)  # each window as it ends (a long GPU case)
    base = next((r for r in results if r["mode"] == "none"), None)
    for r in results:
        if base:
            r["cost"] = round(r["window_s"] / base["window_s"] - 1, 4)
            # Pessimistic: the last window with the wait for its last save, i.e. a job that
            # stops after it (a segment end, where the trainer writes its final checkpoint anyway).
            r["cost_last_window_with_final_wait"] = round(
                (r["windows_s"][-1] + r["final_wait_s"]) / base["windows_s"][-1] - 1, 4
            )
        # The same from one window's own step times, immune to the load changing between
        # windows: what the checkpoint steps took beyond a plain step, over the window.
        if r["median_checkpoint_step_s"] is not None:
            extra = r["checkpoints"] * (r["median_checkpoint_step_s"] - r["median_plain_step_s"])
            extra += sum(r["waits_for_previous_s"]) + r["final_wait_s"]
            steps = args.steps * args.windows
            r["cost_within_window"] = round(extra / (steps * r["median_plain_step_s"]), 4)
    if dist.is_main:
        emit(
            {
                "benchmark": "checkpoint_cost",
                **provenance(name),
                "torch": torch.__version__,
                "case": args.case,
                "steps": args.steps,
                "windows": args.windows,
                "checkpoint_every_steps": args.every,
                "ranks": dist.world if dist.world > 1 else args.share_of,
                "storage": "s3" if (args.run_url or "").startswith("s3://") else "local folder",
                "target": "cost <= 0.10 on the GPU (async)",
                "results": results,
            },
            args.out,
            indent=1,
        )


if __name__ == "__main__":
    main()
