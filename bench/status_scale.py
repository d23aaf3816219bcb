"""The status page at scale with the telemetry a real run leaves behind: N shards x 3 stages
finished (prepare, generate, tokenize outputs) and the last ``telemetry.json`` of every finished
generate and tokenize shard, in a local SeaweedFS (~5 N objects).

Times SnapshotBuilder.build() and counts its S3 requests: the first refresh (full listing, and the
stage totals objects the jobs keep, or with --no-totals every finished shard's telemetry read
once, concurrently: a run from before them), warm refreshes between full listings (only unsettled shard
blocks and run-level prefixes listed), and a warm full re-listing (what every refresh cost before).
Then one generate shard is rerun (output deleted, live telemetry) and the next full listing
must show it running. Records the machine's load average beside the figures.

    python bench/status_scale.py --shards 10000 --out bench/results/status_scale.json
    python bench/status_scale.py --data-dir /tmp/weed-status   # keep the filled server for reruns
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

from benchlib import RequestCounter, cpu_model, emit, provenance

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.core import layout  # noqa: E402
from dflash_pipeline.core.jobstate import ShardProgress, StageTotals  # noqa: E402
from dflash_pipeline.core.storage import ReadOnlyStorage  # noqa: E402
from dflash_pipeline.core.s3 import S3Storage  # noqa: E402
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder  # noqa: E402
from tests.support.seaweed import start_seaweed  # noqa: E402

STAGES = ("prepare", "generate", "tokenize")
TELEMETRY_STAGES = ("generate", "tokenize")


TELEMETRY = {"state": "done", "samples_total": 90, "samples_done": 90, "tokens_generated": 270000}


def fill(store: S3Storage, shards: int) -> float:
    started = time.time()
    with ThreadPoolExecutor(16) as pool:
        for stage in STAGES:
            list(pool.map(lambda s, stage=stage: store.write_bytes(layout.shard_key(stage, s), b"x"), range(shards)))
            if stage in TELEMETRY_STAGES:
                list(
                    pool.map(
                        lambda s, stage=stage: ShardProgress(store, stage, s).write_telemetry(TELEMETRY), range(shards)
                    )
                )
    return time.time() - started


def write_totals(store: S3Storage, shards: int) -> None:
    """The stage totals objects the finished jobs would have left (Telemetry.write("done"))."""
    for stage in TELEMETRY_STAGES:
        StageTotals(store, stage).replace(
            {s: {k: v for k, v in TELEMETRY.items() if k != "state"} for s in range(shards)}
        )


def timed(builder: SnapshotBuilder, counter: RequestCounter) -> tuple[dict, dict]:
    counter.count = 0
    started = time.time()
    snap = builder.build()
    return snap, {
        "seconds": round(time.time() - started, 3),
        "requests": counter.count,
        "listing": builder.last_listing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10000)
    parser.add_argument("--warm", type=int, default=5, help="warm refreshes timed")
    parser.add_argument("--data-dir", default=None, help="SeaweedFS data folder kept between runs")
    parser.add_argument("--out", default=None)
    parser.add_argument("--note", default="", help="what else ran on the machine")
    parser.add_argument(
        "--no-totals",
        dest="totals",
        action="store_false",
        help="without the stage totals objects (a run from before them)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_seaweed(Path(args.data_dir or Path(tmp) / "weed"))
        os.environ.update(server.env)
        try:
            url = f"s3://{server.bucket}/bench/status-scale-{args.shards}"
            store = S3Storage(url)
            last = args.shards - 1
            filled = store.list_range("outputs/", layout.shard_key("tokenize", last)) != []
            fill_s = None if filled else round(fill(store, args.shards), 1)
            if args.totals:
                write_totals(store, args.shards)
            else:
                for stage in TELEMETRY_STAGES:
                    store.delete(layout.stage_totals_key(stage))
            # A rerun from an earlier run of this script is put back as finished.
            store.write_bytes(layout.shard_key("generate", last), b"x")
            readonly = ReadOnlyStorage.open(url)
            counter = RequestCounter(readonly._storage.client)
            source = RunSource(readonly, num_shards=args.shards, until="tokenize", full_listing_every_s=1e9)
            builder = SnapshotBuilder(source)
            load_before = os.getloadavg()
            snap, first = timed(builder, counter)
            assert [s["done"] for s in snap["stages"]] == [args.shards] * 3, snap["stages"]
            warm = [timed(builder, counter)[1] for _ in range(args.warm)]
            assert all(w["listing"] == "incremental" for w in warm)
            source.full_listing_every_s = 0.0
            _, full_warm = timed(builder, counter)
            source.full_listing_every_s = 1e9

            # Snakemake reruns the last generate shard: output deleted, job telemetry live. With
            # no events file here (no logger plugin), a settled block changes at the next full
            # listing; the job events unsettle it at once (tests/test_status_scale.py).
            store.delete(layout.shard_key("generate", last))
            ShardProgress(store, "generate", last).write_telemetry(
                {"state": "running", "samples_total": 90, "samples_done": 10, "tokens_per_s": 500.0}
            )
            source.full_listing_every_s = 0.0
            snap, _ = timed(builder, counter)
            generate = snap["stages"][1]
            assert (generate["done"], generate["running"]) == (args.shards - 1, 1), generate
            load_after = os.getloadavg()
        finally:
            server.stop()
    seconds = sorted(w["seconds"] for w in warm)
    record = {
        "bench": "status_scale",
        "shards": args.shards,
        "stages": list(STAGES),
        "objects": args.shards * (len(STAGES) + len(TELEMETRY_STAGES)),
        "fill_s": fill_s,
        "stage_totals": args.totals,
        "first_refresh": first,
        "warm_refreshes": warm,
        "warm_median_s": seconds[len(seconds) // 2],
        "warm_requests": warm[-1]["requests"],
        "warm_full_listing": full_warm,
        "target_s": 2.0,
        "cold_target_s": 10.0,
        "machine_load": {
            "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
            "loadavg_1_5_15_after": [round(x, 2) for x in load_after],
            "note": args.note,
        },
        **provenance(f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()})"),
    }
    emit(record, args.out, indent=1)


if __name__ == "__main__":
    main()
