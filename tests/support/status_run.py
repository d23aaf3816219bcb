"""A run in mid-flight, written with the pipeline's own writers, for the status page tests."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.status.events import EventWriter
from dflash_pipeline.core.storage import Storage

RUNNING_LOG = ["loading the engine", "generated 4 of 10 samples"]


def write_run(run: Storage, workdir: Path, secret_in_log: str = "") -> Path:
    """A run in mid-flight: 2 shards; shard 1 generating, tokenize of shard 0 failed,
    one training segment done and the next running, evaluation written."""
    for shard in (0, 1):
        run.write_bytes(layout.shard_key("prepare", shard), b"p" * 100)
    run.write_bytes(layout.shard_key("generate", 0), b"g" * 300)
    ShardProgress(run, "generate", 1).write_telemetry(
        {
            "state": "running",
            "samples_total": 10,
            "samples_done": 4,
            "tokens_per_s": 12.5,
            "eta_s": 6.0,
            "tokens_generated": 50,
        }
    )
    metrics = [
        {
            "segment": 0,
            "step": s,
            "loss": 3.0 - s * 0.1,
            "accuracy": 0.1 * s,
            "accuracy_per_position": [0.5, 0.3],
            "accept_len": 1.0 + 0.1 * s,
            "tokens_per_s": 900.0,
            "lr": 1e-4,
            "gpu_mem_gib": None,
            "time": 1.0 + s,
        }
        for s in range(1, 6)
    ]
    prefix = layout.train_progress_prefix(0)
    # The last line is cut, as by a crash mid-write: it must be skipped.
    run.write_text(prefix + layout.TRAIN_METRICS, "".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 6, "lo')
    run.write_text(layout.segment_manifest_key(0), "{}")
    run.write_text(
        layout.train_progress_prefix(1) + "telemetry.json",
        json.dumps(
            {
                "state": "running",
                "step": 7,
                "steps_done": 3,
                "steps_total": 10,
                "tokens_per_s": 880.0,
                "eta_s": 30,
                "updated_at": time.time(),
            }
        ),
    )
    run.write_text(
        layout.EVAL_METRICS,
        json.dumps(
            {
                "overall": {
                    "tau": 2.5,
                    "accept_hist": [1, 2, 3],
                    "per_position": [0.8, 0.6],
                    "generated_tokens": 10,
                    "verify_steps": 4,
                    "speedup_estimate": 2.1,
                },
                "prompt_sets": {"math": {"tau": 2.7}},
                "per_prompt": [],
            }
        ),
    )
    # Job events as the logger plugin writes them, and the jobs' local logs.
    logs = workdir / "results/demo/logs"
    (logs / "generate").mkdir(parents=True, exist_ok=True)
    (logs / "tokenize").mkdir(parents=True, exist_ok=True)
    (logs / "generate/00001.log").write_text("\n".join(RUNNING_LOG) + "\n")
    (logs / "tokenize/00000.log").write_text(f"tokenize failed: 87% degenerate {secret_in_log}\n")
    events = EventWriter(workdir / "logs/events.jsonl")
    now = time.time()
    events.write({"event": "workflow_started", "time": now - 60})
    events.write({"event": "job_started", "time": now - 30, "jobids": [5, 6]})
    for jobid, rule, shard in ((5, "generate", "00001"), (6, "tokenize", "00000")):
        events.write(
            {
                "event": "job_info",
                "time": now - 30,
                "jobid": jobid,
                "rule": rule,
                "wildcards": {"shard": shard},
                "log": [f"results/demo/logs/{rule}/{shard}.log"],
                "output": [],
            }
        )
    events.write(
        {
            "event": "job_error",
            "time": now - 5,
            "jobid": 6,
            "rule": "tokenize",
            "log": ["results/demo/logs/tokenize/00000.log"],
            "message": "",
        }
    )
    events.write({"event": "progress", "time": now - 5, "done": 4, "total": 9})
    return workdir / "logs/events.jsonl"
