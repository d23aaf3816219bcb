"""Cost of one status-page refresh at scale: a finished-or-running run of N shards x 3 stages in
a local SeaweedFS, plus the telemetry of the shards in flight.

Times SnapshotBuilder.build() cold (telemetry read for the first time) and warm (unchanged
telemetry is not read again), and counts the S3 requests of each.

    python bench/status_snapshot.py --shards 10000 --running 64 --out bench/results/status_snapshot.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchlib import RequestCounter, emit, provenance

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.core import layout  # noqa: E402
from dflash_pipeline.core.jobstate import ShardProgress  # noqa: E402
from dflash_pipeline.core.storage import ReadOnlyStorage  # noqa: E402
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder  # noqa: E402
from dflash_pipeline.core.s3 import S3Storage  # noqa: E402
from tests.support.seaweed import start_seaweed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--running", type=int, default=64, help="shards with live generation telemetry")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_seaweed(Path(tmp) / "weed")
        os.environ.update(server.env)
        try:
            url = f"s3://{server.bucket}/bench/results/demo"
            store = S3Storage(url)
            keys = [layout.shard_key(stage, s) for stage in ("prepare", "generate") for s in range(args.shards)]
            keys += [layout.shard_key("tokenize", s) for s in range(args.shards - args.running)]
            t0 = time.time()
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda k: store.write_bytes(k, b"x"), keys))
                list(
                    pool.map(
                        lambda s: ShardProgress(store, "generate", s).write_telemetry(
                            {"state": "running", "samples_total": 100, "samples_done": 10, "tokens_per_s": 1.0}
                        ),
                        range(args.shards - args.running, args.shards),
                    )
                )
            fill_s = time.time() - t0
            readonly = ReadOnlyStorage.open(url)
            counter = RequestCounter(readonly._storage.client)
            builder = SnapshotBuilder(RunSource(readonly, num_shards=args.shards))
            results = {}
            for label in ("cold", "warm"):
                counter.count = 0
                t0 = time.time()
                snap = builder.build()
                results[label] = {"seconds": round(time.time() - t0, 3), "requests": counter.count}
            assert snap["stages"][2]["done"] == args.shards - args.running
        finally:
            server.stop()
    record = {
        "bench": "status_snapshot",
        "shards": args.shards,
        "objects": len(keys) + args.running,
        "running_with_telemetry": args.running,
        "fill_s": round(fill_s, 1),
        "snapshot": results,
        **provenance(f"{platform.machine()} CPU, {os.cpu_count()} cores"),
    }
    emit(record, args.out, indent=1)


if __name__ == "__main__":
    main()
