"""The run lease through real Snakemake runs: a second driver on the same run root (S3 or local)
stops before any job with a message naming the holder, a dry-run neither takes nor minds it, a
stale lease is taken over, and a finished run leaves no lease behind."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.lease import RunLease, read_lease
from dflash_pipeline.core.storage import open_storage

pytestmark = pytest.mark.workflow

NUM_SHARDS = 2


def small_run(workflow, demo_model):
    workflow.write_config(
        num_shards=NUM_SHARDS, until="prepare", target={"model": str(demo_model), "build_demo": False}
    )


def stale_record() -> bytes:
    """A lease left by a driver of another host that stopped heartbeating an hour ago."""
    past = time.time() - 3600
    owner = {"host": "gone-host", "pid": 4242, "started_at": past - 60, "token": "old"}
    return json.dumps({"owner": owner, "heartbeat_at": past, "expires_at": past + 300}).encode()


@pytest.mark.s3
def test_second_driver_on_one_s3_prefix_stops_and_stale_lease_is_taken_over(workflow, s3_server, s3_env, demo_model):
    small_run(workflow, demo_model)
    prefix = f"s3://{s3_server.bucket}/lease-{uuid.uuid4().hex[:8]}"
    args = ("--profile", "profiles/s3", "--default-storage-prefix", prefix)
    run = open_storage(f"{prefix}/{layout.run_root('results', 'demo')}")

    # Another driver (this test process, alive) holds the run.
    holder = RunLease(run, ttl_s=600).acquire()
    proc = workflow.snakemake(*args, env=s3_env, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"{socket.gethostname()} pid {os.getpid()}" in output, output[-3000:]
    assert not run.list(layout.OUTPUTS_DIR), "the refused driver must not run any job"
    # A dry-run plans as usual and leaves the holder's lease alone.
    assert workflow.planned_jobs(*args, env=s3_env).get("prepare") == NUM_SHARDS
    assert read_lease(run)["owner"]["token"] == holder.owner["token"]

    # The holder vanished without releasing: its lease expired.
    run.write_bytes(layout.RUN_LEASE, stale_record())
    proc = workflow.snakemake(*args, env=s3_env)
    said = proc.stdout + proc.stderr
    assert "took over the run lease of host gone-host pid 4242" in said and "expired" in said, said[-3000:]
    assert {o.key for o in run.list(layout.OUTPUTS_DIR + "/prepare-")} == {
        layout.shard_key("prepare", s) for s in range(NUM_SHARDS)
    }
    assert read_lease(run) is None, "a finished run releases its lease"
    # The old holder cannot delete anything now: not another driver's lease. (A delete of a
    # lease already gone counts as done: a release whose answer was lost is not retried forever.)
    newer = RunLease(run, ttl_s=600).acquire()
    assert holder.release() is False
    assert read_lease(run)["owner"]["token"] == newer.owner["token"]
    assert newer.release() is True


def test_local_run_takes_and_releases_the_lease(workflow, demo_model):
    small_run(workflow, demo_model)
    run = open_storage(workflow.root / "results" / "demo")
    holder = RunLease(run, ttl_s=600, host="other-node").acquire()
    proc = workflow.snakemake(check=False)
    assert proc.returncode != 0
    assert "other-node" in proc.stdout + proc.stderr
    holder.release()

    workflow.snakemake()
    assert read_lease(run) is None
    assert workflow.planned_jobs() == {}
