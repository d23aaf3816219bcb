"""Peak host memory (RSS) of the `export` job for a drafter of the given case, from a checkpoint
with random weights and AdamW moments written by the training code (``save_checkpoint``).

Two ways are measured, each in a fresh process: ``export`` (``stages.export.export_drafter``: the
model tensors only, memory-mapped; shapes from the meta device) and ``full_load`` (what export
did before: ``load_checkpoint``, every tensor of the checkpoint, optimizer moments included,
plus an fp32 drafter built to read shapes). ``--mem-mb`` compares with the rule's mem_mb.

    python bench/export_memory.py --case tiny
    python bench/export_memory.py --case qwen3.6-27b --workdir /tmp/export-bench \
        --out bench/results/export_memory-27b.json
    # on a machine with less memory than the 21 GB checkpoint: export only, moments from disk
    python bench/export_memory.py --case qwen3.6-27b --workdir /tmp/export-bench --modes export \
        --moments-on-disk --out bench/results/export_memory-27b.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import cpu_model, emit, provenance  # noqa: E402

from dflash_pipeline.model.config import DrafterConfig  # noqa: E402

PREFIX = "checkpoints/segment-0000/"


def spec(case: str) -> dict:
    from checkpoint_cost import case_spec

    return case_spec(case)["drafter"]


def zeros_on_disk(like: torch.Tensor, path: Path) -> torch.Tensor:
    """A tensor of zeros shaped like ``like``, backed by a sparse file instead of memory."""
    path.touch()
    os.truncate(path, like.numel() * like.element_size())
    return torch.from_file(str(path), shared=True, size=like.numel(), dtype=like.dtype).view(like.shape)


def write_checkpoint(case: str, workdir: Path, moments_on_disk: bool = False) -> dict:
    """The checkpoint and the segment manifest export reads, with random values. With
    ``moments_on_disk`` AdamW's moments are zeros mapped from sparse files: the writer then holds
    only the weights in memory (the 27B case's 21 GB checkpoint is written on a 24 GB machine);
    export reads no moment, so its figure is the same."""
    from dflash_pipeline.core.storage import open_storage
    from dflash_pipeline.training.checkpoint import capture_rng, save_checkpoint

    config = DrafterConfig(**spec(case), dtype="bfloat16")
    from dflash_pipeline.model.drafter import DFlashDrafter

    torch.manual_seed(0)
    drafter = DFlashDrafter(config)
    model = {k: v.detach() for k, v in drafter.state_dict().items()}
    del drafter
    # AdamW's state as torch's optimizer keeps it: per parameter, a step and two moments.
    moments = workdir / "moments"
    moments.mkdir(exist_ok=True)

    def moment(t: torch.Tensor, i: int, name: str, scale: float) -> torch.Tensor:
        if moments_on_disk:
            return zeros_on_disk(t, moments / f"{i}-{name}")
        return (torch.randn_like(t) if name == "exp_avg" else torch.rand_like(t)) * scale

    optimizer = {
        "state": {
            i: {
                "step": torch.tensor(1.0),
                "exp_avg": moment(t, i, "exp_avg", 1e-3),
                "exp_avg_sq": moment(t, i, "exp_avg_sq", 1e-6),
            }
            for i, t in enumerate(model.values())
        },
        "param_groups": [
            {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(len(model)))}
        ],
    }
    state = {"step": 1, "model": model, "optimizer": optimizer, "scheduler": {"last_epoch": 1}}
    index = save_checkpoint(open_storage(str(workdir / "run")), PREFIX, state, capture_rng(torch.device("cpu")))
    del state, optimizer
    for path in moments.iterdir():
        path.unlink()
    manifest = {"checkpoint_prefix": PREFIX, "drafter_config": config.to_zlab(), "files": index["files"]}
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    params = sum(t.numel() for t in model.values())
    size = sum(p.stat().st_size for p in (workdir / "run" / PREFIX).iterdir())
    return {"drafter_params": params, "checkpoint_bytes": size}


def measure(mode: str, workdir: Path) -> dict:
    """Run in a fresh process: one way of reading the checkpoint for export."""
    started = time.time()
    if mode == "export":
        from dflash_pipeline.stages.export import export_drafter

        export_drafter(
            str(workdir / "run"),
            str(workdir / "manifest.json"),
            str(workdir / "out" / "config.json"),
            str(workdir / "out" / "model.safetensors"),
            "bfloat16",
        )
    else:
        from dflash_pipeline.core.storage import open_storage
        from dflash_pipeline.model.drafter import DFlashDrafter
        from dflash_pipeline.training.checkpoint import load_checkpoint

        manifest = json.loads((workdir / "manifest.json").read_text())
        loaded = load_checkpoint(open_storage(str(workdir / "run")), manifest["checkpoint_prefix"])
        drafter = DFlashDrafter(DrafterConfig.from_zlab(manifest["drafter_config"]))
        assert set(drafter.state_dict()) == set(loaded.state["model"])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "peak_rss_gib": round(peak_kib / 2**20, 2), "seconds": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="tiny")
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written (GBs for the 27B case)")
    parser.add_argument("--modes", nargs="+", default=["export", "full_load"])
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--moments-on-disk",
        action="store_true",
        help="AdamW moments as zeros mapped from sparse files (a checkpoint larger than this machine's memory)",
    )
    parser.add_argument("--mem-mb", type=int, default=None, help="the export rule's mem_mb, for the record")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, Path(args.workdir))))
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        workdir = Path(tmp)
        (workdir / "out").mkdir()
        written = write_checkpoint(args.case, workdir, args.moments_on_disk)
        runs = []
        for mode in args.modes:
            proc = subprocess.run(
                [sys.executable, __file__, "--measure", mode, "--workdir", str(workdir)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    record = {
        "bench": "export_memory",
        "case": args.case,
        **written,
        "checkpoint_gib": round(written["checkpoint_bytes"] / 2**30, 2),
        "runs": runs,
        "rule_mem_mb": args.mem_mb,
        "moments": "zeros mapped from sparse files" if args.moments_on_disk else "random",
        **provenance(f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()})"),
    }
    emit(record, args.out, indent=1)


if __name__ == "__main__":
    main()
