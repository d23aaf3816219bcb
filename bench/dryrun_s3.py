"""Dry-run cost of the workflow against S3 at scale (design target: 10,000 shards x 4 stages
in <= 30 s against a local SeaweedFS).

Fills a bucket on a local SeaweedFS with every output of a finished run of N shards (tiny
objects, uploaded in pipeline order so mtimes are consistent), then times `snakemake -n`
with the s3 profile, which must report nothing to do.

    python bench/dryrun_s3.py --shards 10000 --out bench/results/dryrun_s3.json
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import emit, provenance

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.core import layout  # noqa: E402
from dflash_pipeline.core.storage import S3Storage  # noqa: E402
from tests.conftest import WORKFLOW_FILES  # noqa: E402
from tests.support.seaweed import start_seaweed  # noqa: E402


def planned_keys(num_shards: int) -> list[list[str]]:
    """Tracked output keys of a finished run (outputs and benchmarks), grouped in the order
    the pipeline writes them."""
    root = layout.run_root("results", "demo")
    ingest = [layout.INGESTED_PROMPTS, layout.INGEST_SUMMARY, layout.QUARANTINE]
    ingest.append(layout.benchmark_key("ingest"))
    shards = [layout.shard_key("prepare", s) for s in range(num_shards)]
    shards += [layout.benchmark_key("prepare", s) for s in range(num_shards)]
    return [[f"{root}/{k}" for k in group] for group in (ingest, shards)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = start_seaweed(tmp / "weed")
        os.environ.update(server.env)
        try:
            wf = tmp / "wf"
            wf.mkdir()
            for name in WORKFLOW_FILES:
                (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, wf / name)
            config = yaml.safe_load((wf / "config.yaml").read_text())
            config["num_shards"] = args.shards
            config["target"]["build_demo"] = False
            (wf / "config.yaml").write_text(yaml.safe_dump(config))
            store = S3Storage(f"s3://{server.bucket}/bench")
            t0 = time.time()
            for group in planned_keys(args.shards):
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(lambda k: store.write_bytes(k, b"x"), group))
                time.sleep(1.1)  # S3 mtimes have 1 s resolution: keep stages apart
            fill_s = time.time() - t0
            cmd = [sys.executable, "-m", "snakemake", "-n", "--quiet", "rules", "--cores", "1",
                   "--profile", "profiles/s3", "--default-storage-prefix", f"s3://{server.bucket}/bench"]
            t0 = time.time()
            proc = subprocess.run(cmd, cwd=wf, capture_output=True, text=True,
                                  env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
            dry_s = time.time() - t0
            nothing = "Nothing to be done" in proc.stdout + proc.stderr
            t0 = time.time()
            subprocess.run(cmd[:-4], cwd=wf, capture_output=True, text=True)  # local floor: no S3
            local_s = time.time() - t0
        finally:
            server.stop()
    result = {
        "benchmark": "dryrun_s3",
        "shards": args.shards,
        "shard_stages": ["prepare"],
        "objects": sum(len(g) for g in planned_keys(args.shards)),
        "dry_run_s3_seconds": round(dry_s, 2),
        "nothing_to_do": nothing,
        "dry_run_local_missing_outputs_seconds": round(local_s, 2),
        "fill_seconds": round(fill_s, 1),
        **provenance(f"cpu {os.cpu_count()} cores, {platform.machine()}"),
    }
    emit(result, args.out)
    if not nothing:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)


if __name__ == "__main__":
    main()
