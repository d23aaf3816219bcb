"""The whole run in S3 (a real SeaweedFS server): complete, idempotent, rebuilds one shard."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core.s3 import BUCKET_SENTINEL_KEY

pytestmark = [pytest.mark.workflow, pytest.mark.s3]

NUM_SHARDS = 2


def s3_client(server):
    return server.client()


def test_s3_run_completes_replans_one_shard_and_matches_local(workflow, s3_server, demo_model, session_endpoint):
    workflow.write_config(
        num_shards=NUM_SHARDS,
        # Storage is this test's business, not the demo's answers: a few prompts, short turns
        # (the whole run is generated twice, in S3 and locally).
        dataset={"paths": [workflow.few_prompts(24)], "heldout_fraction": 0.25},
        generation={"max_new_tokens": 32},
        target={"model": str(demo_model), "build_demo": False},
        # Training and evaluation go through S3 too; their quality is the demo test's business,
        # so few steps and prompts here (and no parity gate on an untrained drafter).
        train={"steps_per_segment": 3, "checkpoint_every_steps": 2},
        evaluate={"max_prompts": 2, "max_new_tokens": 24, "simulated_rows": 2, "parity_tolerance": 10.0},
        # Thinking traces cut at 32 tokens; the gate is tests/test_tokenize.py's business.
        tokenize={"max_degenerate_fraction": 1.0},
    )
    # Storage is the subject, not the engine's launch: five generate jobs through one server.
    workflow.write_config(**session_endpoint)
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    s3_args = ("--profile", "profiles/s3", "--default-storage-prefix", f"s3://{s3_server.bucket}/{prefix}")
    env = s3_server.env

    workflow.snakemake(*s3_args, env=env)
    client = s3_client(s3_server)
    listed = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/")
    keys = {o["Key"][len(prefix) + 1 :] for o in listed.get("Contents", [])}
    shard_keys = [f"results/demo/outputs/prepare-{i:05d}.parquet" for i in range(NUM_SHARDS)]
    assert set(shard_keys) <= keys
    assert {"results/demo/outputs/ingest-summary.json", "results/demo/outputs/ingest-prompts.parquet"} <= keys
    assert "results/demo/logs/ingest.log" in keys
    # The evaluate rule's engine log is declared, so it reaches the bucket (with a real engine
    # it holds the server logs and the captured /metrics).
    assert {"results/demo/logs/evaluate.log", "results/demo/logs/evaluate-engine.log"} <= keys
    assert {
        "results/demo/checkpoints/segment-0001/checkpoint.json",
        "results/demo/drafter/model.safetensors",
        "results/demo/outputs/evaluate-metrics.json",
        "results/demo/_progress/train/segment-0001/metrics.jsonl",
    } <= keys
    assert not (workflow.root / "results").exists(), "an S3 run must leave no local results"
    sentinel = client.head_object(Bucket=s3_server.bucket, Key=BUCKET_SENTINEL_KEY)
    assert sentinel["ContentLength"] > 0

    assert workflow.planned_jobs(*s3_args, env=env) == {}

    client.delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/{shard_keys[1]}")
    for stage in ("generate", "tokenize"):
        key = f"results/demo/outputs/{stage}-00001.parquet"
        client.delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}")
    # Snakemake does not rebuild a missing intermediate whose products (the drafter, the
    # evaluation) exist; the data stages alone show the one shard's chain being re-planned.
    data_only = ("--config", "until=tokenize")
    planned = workflow.planned_jobs(*s3_args, *data_only, env=env)
    assert {k: planned.get(k) for k in ("prepare", "generate", "tokenize")} == {
        "prepare": 1,
        "generate": 1,
        "tokenize": 1,
    }, planned
    assert "train" not in planned and "ingest" not in planned
    workflow.snakemake(*s3_args, *data_only, env=env)
    assert workflow.planned_jobs(*s3_args, *data_only, env=env) == {}

    # The same config on local storage, up to the stages compared below.
    workflow.snakemake("--config", "until=generate")
    for key in shard_keys:
        remote = client.get_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}")["Body"].read()
        assert remote == (workflow.root / key).read_bytes(), key
    for i in range(NUM_SHARDS):
        key = f"results/demo/outputs/generate-{i:05d}.parquet"
        body = client.get_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}")["Body"].read()
        remote = pq.read_table(pa.BufferReader(body))
        local = pq.read_table(workflow.root / key)
        assert remote.column("id").to_pylist() == local.column("id").to_pylist()
