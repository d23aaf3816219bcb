"""How the planning of a fresh run grows with its shard count: `snakemake -n` of a new local run
with every stage on (tune, generate, tokenize, extract for offline training, train, export,
evaluate, the reports), at several shard counts. A plan must cost the same per shard at 20,000
shards as at 2,500 (linear): the record gives seconds per shard at each count and the ratio of the
largest count's to the smallest's.

    python bench/dryrun_scale.py --shards 2500 5000 10000 20000 --out bench/results/dryrun_scale.json
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from benchlib import REPO, cpu_model, copy_workflow, emit, provenance

sys.path.insert(0, str(REPO))


# Every stage of the workflow: offline training adds extract, tune measures the engine first.
EVERY_STAGE = {"until": "evaluate", "train": {"mode": "offline"}, "tune": {"enabled": True}}


def planned_run(root: Path, shards: int) -> Path:
    """A copy of the workflow in ``root`` configured for ``shards`` shards and every stage."""
    root.mkdir(parents=True)
    copy_workflow(root)
    config = yaml.safe_load((root / "config.yaml").read_text())
    config["num_shards"] = shards
    for key, value in EVERY_STAGE.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    (root / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


def time_dry_run(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "2", "--quiet", "rules"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"snakemake -n in {root} failed:\n{proc.stderr[-3000:]}")
    return {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
        "max_rss_mb": round(after.ru_maxrss / 1024),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[2500, 5000, 10000, 20000])
    parser.add_argument("--out", help="result JSON")
    args = parser.parse_args()
    record = {"benchmark": "dryrun_scale", **provenance(cpu_model()), "stages": EVERY_STAGE, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="dryrun-scale-") as tmp:
        for shards in sorted(args.shards):
            run = time_dry_run(planned_run(Path(tmp) / str(shards), shards))
            run["cpu_ms_per_shard"] = round(1000 * run["cpu_seconds"] / shards, 2)
            record["runs"][str(shards)] = run
            print(shards, run, flush=True)
    per_shard = [r["cpu_ms_per_shard"] for r in record["runs"].values()]
    # CPU time, not wall time: the machine's other load does not count against the plan.
    record["largest_to_smallest_per_shard"] = round(per_shard[-1] / per_shard[0], 2)
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
