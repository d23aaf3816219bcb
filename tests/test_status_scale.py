"""The status page at scale: between full listings a refresh lists only what can still change
(unsettled shard blocks, run-level prefixes), finished shards' telemetry is read once, and the
incremental snapshot says the same as a full one. Local and real S3 (SeaweedFS)."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.core.storage import ReadOnlyStorage, open_storage
from dflash_pipeline.status.snapshot import SETTLED_BLOCK, RunSource, SnapshotBuilder

# The stages of a run up to tokenize (layout.stages_built without tune).
UP_TO_TOKENIZE = ("prepare", "generate", "tokenize")
NUM_SHARDS = 2 * SETTLED_BLOCK + 10  # two full blocks and a partial one


class CountingStorage(ReadOnlyStorage):
    """The read-only handle, counting listings and reads by kind."""

    def __init__(self, storage):
        super().__init__(storage)
        self.calls: list[tuple[str, str]] = []

    def list(self, prefix=""):
        self.calls.append(("list", prefix))
        return super().list(prefix)

    def list_range(self, prefix, start="", stop=None):
        self.calls.append(("list_range", prefix))
        return super().list_range(prefix, start, stop)

    def read_bytes(self, key):
        self.calls.append(("read", key))
        return super().read_bytes(key)


@pytest.fixture
def run(store):
    return store


def finish(run, stage, shard, tokens=7):
    """A finished shard as a real run leaves it: the output and the job's last telemetry."""
    run.write_bytes(layout.shard_key(stage, shard), b"x")
    if stage != "prepare":
        ShardProgress(run, stage, shard).write_telemetry(
            {"state": "done", "samples_total": 4, "samples_done": 4, "tokens_generated": tokens}
        )


def comparable(snapshot):
    snapshot = json.loads(json.dumps(snapshot))
    snapshot.pop("generated_at")
    snapshot["storage"].pop("full_listing_at")
    return snapshot


def test_settled_blocks_are_not_listed_or_read_again(run):
    for shard in range(NUM_SHARDS):
        finish(run, "prepare", shard)
    for shard in range(SETTLED_BLOCK):  # generate: block 0 done, the rest not yet
        finish(run, "generate", shard)
    source = RunSource(CountingStorage(run), num_shards=NUM_SHARDS, stages=UP_TO_TOKENIZE, full_listing_every_s=1e9)
    builder = SnapshotBuilder(source)
    storage = source.storage

    first = builder.build()
    assert builder.last_listing == "full"
    reads = [key for kind, key in storage.calls if kind == "read"]
    assert len(reads) == SETTLED_BLOCK  # every finished shard's telemetry, once
    assert first["throughput"]["tokens_generated"] == 7 * SETTLED_BLOCK

    storage.calls.clear()
    second = builder.build()
    assert builder.last_listing == "incremental"
    assert [c for c in storage.calls if c[0] != "list_range"] == []  # nothing read again
    listed = [prefix for _, prefix in storage.calls]
    # prepare is settled everywhere; generate lists one range (blocks 1-2), tokenize one.
    assert "outputs/prepare-" not in listed
    assert listed.count("outputs/generate-") == 1 and listed.count("outputs/tokenize-") == 1
    assert comparable(second) == comparable(first)

    # Work lands in the unsettled ranges: the incremental refresh sees it like a full one.
    finish(run, "generate", SETTLED_BLOCK + 3, tokens=100)
    finish(run, "tokenize", 0)
    ShardProgress(run, "generate", NUM_SHARDS - 1).write_telemetry(
        {"state": "running", "samples_total": 4, "samples_done": 1}
    )
    storage.calls.clear()
    third = builder.build()
    assert builder.last_listing == "incremental"
    telemetry_reads = [k for kind, k in storage.calls if kind == "read" and k.endswith("telemetry.json")]
    assert len(telemetry_reads) == 3  # only the new telemetry (the running job's log tail too)
    fresh = SnapshotBuilder(RunSource(ReadOnlyStorage(run), num_shards=NUM_SHARDS, stages=UP_TO_TOKENIZE)).build()
    assert comparable(third) == comparable(fresh)
    stages = {s["stage"]: s for s in third["stages"]}
    assert stages["generate"]["done"] == SETTLED_BLOCK + 1 and stages["generate"]["running"] == 1
    assert stages["tokenize"]["done"] == 1


def test_a_change_in_a_settled_block_shows_at_the_next_full_listing(run):
    for shard in range(NUM_SHARDS):
        finish(run, "prepare", shard)
    source = RunSource(ReadOnlyStorage(run), num_shards=NUM_SHARDS, stages=("prepare",), full_listing_every_s=1e9)
    builder = SnapshotBuilder(source)
    assert builder.build()["stages"][0]["done"] == NUM_SHARDS
    run.delete(layout.shard_key("prepare", 5))  # e.g. removed by hand to rebuild it
    assert builder.build()["stages"][0]["done"] == NUM_SHARDS  # settled: not listed again
    source.full_listing_every_s = 0.0
    assert builder.build()["stages"][0]["done"] == NUM_SHARDS - 1
    assert builder.last_listing == "full"


def test_a_running_job_unsettles_its_block(tmp_path):
    import time

    from dflash_pipeline.status.events import EventWriter

    run = open_storage(tmp_path / "run")
    for shard in range(NUM_SHARDS):
        finish(run, "prepare", shard)
    events = tmp_path / "events.jsonl"
    source = RunSource(
        ReadOnlyStorage(run), num_shards=NUM_SHARDS, stages=("prepare",), events_file=events, full_listing_every_s=1e9
    )
    writer = EventWriter(events)
    writer.write({"event": "workflow_started", "time": time.time()})
    builder = SnapshotBuilder(source)
    assert builder.build()["stages"][0]["done"] == NUM_SHARDS
    # Snakemake reruns shard 5: it deletes the output, the job starts.
    run.delete(layout.shard_key("prepare", 5))
    writer.write(
        {
            "event": "job_info",
            "time": time.time(),
            "jobid": 1,
            "rule": "prepare",
            "wildcards": {"shard": "00005"},
            "log": [],
            "output": [],
        }
    )
    writer.write({"event": "job_started", "time": time.time(), "jobids": [1]})
    stage = builder.build()["stages"][0]
    assert builder.last_listing == "incremental"
    assert (stage["done"], stage["running"]) == (NUM_SHARDS - 1, 1)


def test_a_cold_refresh_reads_the_stage_totals_not_every_finished_shards_telemetry(run):
    """Jobs that finish through Telemetry.write("done") add their counts to the stage's totals
    object (concurrently, none lost); the first refresh reads that object instead of each
    finished shard's telemetry, and sums the same tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_pipeline.core.jobstate import StageTotals

    def job_finishes(shard):
        run.write_bytes(layout.shard_key("generate", shard), b"x")
        telemetry = ShardProgress(run, "generate", shard).telemetry(4, every_s=10, token_field="tokens_generated")
        telemetry.update(4, 10 + shard)
        telemetry.write("done")

    for shard in range(NUM_SHARDS):
        finish(run, "prepare", shard)
    with ThreadPoolExecutor(8) as pool:  # jobs finishing at the same moment
        list(pool.map(job_finishes, range(NUM_SHARDS)))
    assert sorted(StageTotals(run, "generate").read()) == list(range(NUM_SHARDS))

    source = RunSource(CountingStorage(run), num_shards=NUM_SHARDS, stages=UP_TO_TOKENIZE, full_listing_every_s=1e9)
    snapshot = SnapshotBuilder(source).build()
    reads = [key for kind, key in source.storage.calls if kind == "read"]
    assert reads == [layout.stage_totals_key("generate")]
    assert snapshot["throughput"]["tokens_generated"] == sum(10 + s for s in range(NUM_SHARDS))
    assert {s["stage"]: s["done"] for s in snapshot["stages"]}["generate"] == NUM_SHARDS

    # A shard's output deleted for a rebuild: its telemetry is read again (counted once, from
    # there, until its rerun replaces it); rebuild() recomputes the object from the telemetry
    # of the shards that are done.
    run.delete(layout.shard_key("generate", 0))
    source.storage.calls.clear()
    again = SnapshotBuilder(source).build()
    reads = sorted(k for kind, k in source.storage.calls if kind == "read")
    assert reads == sorted(
        [layout.stage_totals_key("generate"), layout.progress_prefix("generate", 0) + "telemetry.json"]
    )
    assert again["throughput"]["tokens_generated"] == snapshot["throughput"]["tokens_generated"]
    rebuilt = StageTotals(run, "generate").rebuild(list(range(1, NUM_SHARDS)))
    assert sorted(rebuilt) == list(range(1, NUM_SHARDS))
