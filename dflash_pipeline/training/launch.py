"""How a `train` job runs its segment: in this process on CPU or one GPU, or under torchrun
(DDP) over several GPUs. SIGTERM reaches the workers either way, so preemption checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_pipeline.training.trainer import SegmentJob


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "-m", "dflash_pipeline.stages.train", *args,
    ]  # fmt: skip


def segment_args(job: SegmentJob, settings_file: str) -> list[str]:
    args = [
        "--run-url", job.run_url, "--segment", str(job.segment), "--settings", settings_file,
        "--target", job.target_dir, "--manifest", job.manifest_path,
        "--tokenized", *[f"{k}={v}" for k, v in sorted(job.tokenized.items())],
    ]  # fmt: skip
    if job.hidden:
        args += ["--hidden", *[f"{k}={v}" for k, v in sorted(job.hidden.items())]]
    return args


def run_train_job(job: SegmentJob, gpus: int) -> int:
    if gpus <= 1:
        job.run()
        return 0
    with tempfile.TemporaryDirectory(prefix="dflash-train-") as tmp:
        settings_file = Path(tmp) / "settings.json"
        settings_file.write_text(json.dumps(job.settings))
        proc = subprocess.Popen(torchrun_command(gpus, segment_args(job, str(settings_file))))
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if code != 0:
        raise SystemExit(f"torchrun over {gpus} GPUs failed with exit code {code}")
    return 0
