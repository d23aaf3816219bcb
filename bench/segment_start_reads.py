"""Bytes each rank reads from storage when a training segment starts from the previous
segment's checkpoint: two CPU ranks (torchrun, gloo) train segment 0 of the demo drafter, then
segment 1 starts from its checkpoint and each rank logs what it read. Before, every rank read
every rank's share (the whole checkpoint); now each reads its own and receives the others over
the process group (``training.checkpoint._load_shared``). ``--for-ranks`` and
``--checkpoint-gib`` write down the same arithmetic for a larger job (the 27B case: 8 ranks).

    python bench/segment_start_reads.py --out bench/results/segment_start_reads.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchlib import cpu_model, emit, provenance  # noqa: E402

from dflash_pipeline.core import layout  # noqa: E402
from dflash_pipeline.core.config import validate_config  # noqa: E402
from dflash_pipeline.demo.build_model import build_demo_model  # noqa: E402
from dflash_pipeline.stages.train import segment_args, torchrun_command  # noqa: E402
from dflash_pipeline.training.trainer import SegmentJob  # noqa: E402
from tests.support.train_data import write_tokenized_shard  # noqa: E402

READ_LINE = re.compile(r"segment 0: ([\d.]+) MB read from storage by this rank")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--for-ranks", type=int, default=8)
    parser.add_argument(
        "--checkpoint-gib",
        type=float,
        default=19.4,
        help="the checkpoint written down for --for-ranks (27B case: 1.73B params x 12 B)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(build_demo_model(tmp / "demo-target"))
        tokenized = {"00000": str(write_tokenized_shard(model, tmp / "tokenize-00000.parquet", 24, seed=0))}
        settings = validate_config({"train": {}})["train"]
        settings.update(
            mode="online",
            segments=2,
            steps_per_segment=2,
            checkpoint_every_steps=100,
            batch_size=1,
            gpus_per_job=0,
            num_layers=2,
            intermediate_size=128,
            block_size=4,
            num_anchors=16,
            metrics_every_seconds=0,
            attention="sdpa",
        )
        settings_file = tmp / "settings.json"
        settings_file.write_text(json.dumps(settings))
        run = tmp / "run"
        logs = []
        for segment in (0, 1):
            job = SegmentJob(
                run_url=str(run),
                segment=segment,
                settings=settings,
                target_dir=str(model),
                tokenized=tokenized,
                manifest_path=str(run / layout.segment_manifest_key(segment)),
            )
            command = torchrun_command(2, [*segment_args(job, str(settings_file)), "--device", "cpu"])
            proc = subprocess.run(
                command, capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1")
            )
            logs.append(proc.stderr)
        index = json.loads((run / layout.checkpoint_prefix(0) / "checkpoint.json").read_text())
    per_rank_mb = [float(x) for x in READ_LINE.findall(logs[1])]
    whole_mb = sum(f["size"] for f in index["files"].values()) / 1e6
    n, gib = args.for_ranks, args.checkpoint_gib
    record = {
        "bench": "segment_start_reads",
        "measured": {
            "ranks": 2,
            "checkpoint_mb": round(whole_mb, 2),
            "read_per_rank_mb": per_rank_mb,
            "read_total_mb": round(sum(per_rank_mb), 2),
            "before_read_total_mb": round(2 * whole_mb, 2),
        },
        "written_down": {
            "ranks": n,
            "checkpoint_gib": gib,
            "before_read_total_gib": round(n * gib, 1),
            "after_read_total_gib": gib,
            "after_read_per_rank_gib": round(gib / n, 2),
            "note": "each rank reads its share (split by bytes); the rest comes over the process group",
        },
        **provenance(f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()})"),
    }
    emit(record, args.out, indent=1)


if __name__ == "__main__":
    main()
