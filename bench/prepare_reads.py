"""Bytes a `prepare` job fetches from S3: the whole ingested table (before: Snakemake downloaded
it as the job's input) against the footer and its own row group (``stages.prepare.read_shard``
over ``Storage.open_ranged``). An ingested table of N prompts in S shards in a local SeaweedFS;
a few shards are read and their fetched bytes and requests recorded.

    python bench/prepare_reads.py --prompts 100000 --shards 1000 --out bench/results/prepare_reads.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
from pathlib import Path

from benchlib import cpu_model, emit, provenance

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_pipeline.core.s3 import S3Storage  # noqa: E402
from dflash_pipeline.stages.prepare import ingest, read_shard  # noqa: E402
from tests.support.seaweed import start_seaweed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--words", type=int, default=120, help="words per prompt (~8 bytes each)")
    parser.add_argument("--read", type=int, default=5, help="shards read")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with open(tmp / "d.jsonl", "w") as fh:
            for i in range(args.prompts):
                text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(args.words))
                fh.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}) + "\n")
        ingest([str(tmp / "d.jsonl")], args.shards, str(tmp / "p.parquet"), str(tmp / "s.json"), str(tmp / "q.parquet"))
        size = (tmp / "p.parquet").stat().st_size
        server = start_seaweed(tmp / "weed")
        os.environ.update(server.env)
        try:
            store = S3Storage(f"s3://{server.bucket}/bench-prepare")
            store.upload_file("p.parquet", tmp / "p.parquet")
            opened = []
            open_ranged = S3Storage.open_ranged
            S3Storage.open_ranged = lambda self, key: opened.append(open_ranged(self, key)) or opened[-1]
            jobs = []
            for shard in rng.sample(range(args.shards), args.read):
                rows = read_shard(store.join("p.parquet"), shard).num_rows
                jobs.append(
                    {
                        "shard": shard,
                        "rows": rows,
                        "bytes_fetched": opened[-1].bytes_fetched,
                        "requests": opened[-1].requests + 1,
                    }
                )  # + the HEAD for the size
        finally:
            server.stop()
    record = {
        "bench": "prepare_reads",
        "prompts": args.prompts,
        "shards": args.shards,
        "ingested_bytes": size,
        "before_bytes_per_job": size,
        "after_bytes_per_job_max": max(j["bytes_fetched"] for j in jobs),
        "jobs": jobs,
        "note": "before: the whole ingested table was each prepare job's Snakemake input (one download per job)",
        **provenance(f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()})"),
    }
    emit(record, args.out, indent=1)


if __name__ == "__main__":
    main()
