"""Offline mode's hidden-state bytes: the estimate, and the refusal above train.offline_max_bytes
at plan time (snakemake -n) and at train start."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.training.offline import (
    OfflineBudgetError,
    TargetShape,
    TokenCount,
    check_offline_budget,
    check_offline_run,
    check_stored,
    count_tokens,
    estimate,
    read_stats_sample,
    read_target_shape,
    tokens_from_samples,
)

SEEDS_TARGET = TargetShape(hidden_size=5120, num_layers=64)


def config(**train) -> dict:
    base = validate_config({"num_shards": 4, "train": {"mode": "offline", **train}})
    return base


def write_stats(storage, shard: int, tokens: int, sequences: int) -> None:
    storage.write_text(
        layout.shard_key("tokenize", shard, "stats.json"),
        json.dumps({"tokens_total": tokens, "sequences_out": sequences}),
    )


def test_bytes_per_token_of_the_seeds_case_is_50_kib():
    c = config(target_layer_ids=[1, 16, 31, 46, 61])
    est = estimate(c, SEEDS_TARGET, TokenCount(1000, 1, "test"))
    assert est.bytes_per_token == 5 * 5120 * 2 == 50 * 1024
    assert est.total_bytes == 1000 * 50 * 1024
    fp8 = estimate(config(num_layers=3, hidden_dtype="float8_e4m3fn"), SEEDS_TARGET, TokenCount(1, 1, "t"))
    assert (fp8.taps, fp8.element_bytes) == (3, 1)  # no target_layer_ids: one tap per drafter layer


def test_tokens_come_from_the_tokenized_stats_exact_or_scaled(tmp_path):
    storage = open_storage(tmp_path)
    c = config()
    write_stats(storage, 0, 1000, 10)
    write_stats(storage, 2, 3000, 30)
    count = count_tokens(c, storage)
    # 2 of 4 shards: scaled to the run.
    assert (count.tokens, count.sequences) == (8000, 80) and "2 of 4 tokenized shards" in count.source
    write_stats(storage, 1, 2000, 20)
    write_stats(storage, 3, 2000, 20)
    count = count_tokens(c, storage)
    assert (count.tokens, count.sequences) == (8000, 80) and "the 4 tokenized shards" in count.source


def test_only_a_sample_of_many_stats_is_read(tmp_path):
    storage = open_storage(tmp_path)
    for shard in range(10):
        write_stats(storage, shard, 100 * (shard + 1), 1)
    sample = read_stats_sample(storage, 10, limit=3)
    assert [s["tokens_total"] for s in sample] == [100, 500, 1000]  # first, middle (index round(4.5) = 4), last


def test_without_stats_tokens_come_from_prompts_at_the_expected_length(tmp_path):
    storage = open_storage(tmp_path)
    c = validate_config(
        {
            "num_shards": 4,
            "train": {"mode": "offline"},
            "tokenize": {"max_length": 4096},
            "generation": {"max_new_tokens": 3000},
            "dataset": {"heldout_fraction": 0.1, "paths": [str(tmp_path / "p.jsonl")]},
        }
    )
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(20)) + "\n")
    count = count_tokens(c, storage)
    assert (count.tokens, count.sequences) == (18 * 3000, 18) and "rows of dataset.paths" in count.source
    storage.write_text(layout.INGEST_SUMMARY, json.dumps({"samples": 100}))
    count = count_tokens(c, storage)
    assert count.tokens == 90 * 3000 and layout.INGEST_SUMMARY in count.source
    # An S3 dataset and no ingest summary yet: not known before prepare has run.
    c["dataset"]["paths"] = ["s3://bucket/prompts.jsonl"]
    assert count_tokens(c, open_storage(tmp_path / "empty")) is None


def test_target_shape_from_config_json_and_its_text_config(tmp_path):
    assert read_target_shape(tmp_path / "absent") is None
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 5120, "num_hidden_layers": 64}}))
    assert read_target_shape(tmp_path) == SEEDS_TARGET


def test_refusal_names_the_bytes_the_limit_and_what_online_would_cost():
    c = config(
        target_layer_ids=[1, 16, 31, 46, 61],
        offline_max_bytes=2**40,
        gpus_per_job=8,
        segments=20,
        steps_per_segment=2000,
        batch_size=1,
    )
    count = tokens_from_samples(902_000, c, "test")  # ~3.7B tokens
    with pytest.raises(OfflineBudgetError) as err:
        check_offline_budget(c, SEEDS_TARGET, count)
    message = str(err.value)
    assert "above train.offline_max_bytes (1.0 TiB)" in message
    assert "5 taps x hidden 5120 x 2 bytes (bfloat16) = 50.0 KiB per token" in message
    assert f"{count.tokens:,} tokens" in message and "8 x " in message
    assert "train.mode: online" in message and "GPU-hours" in message
    # 20 x 2000 x 1 x 8 sequences of the expected length, at the measured 9,134 tok/s.
    hours = 20 * 2000 * 8 * count.tokens / count.sequences / 9134.3 / 3600
    assert f"~{hours:,.0f} GPU-hours" in message
    # Under the limit, or with no limit: no refusal.
    c["train"]["offline_max_bytes"] = None
    assert check_offline_budget(c, SEEDS_TARGET, count).total_bytes == count.tokens * 51200


def test_check_run_is_silent_when_the_run_cannot_be_sized_yet_or_extracts_nothing(tmp_path):
    c = config(offline_max_bytes=0)
    c["target"]["model"] = str(tmp_path / "not-built-yet")
    assert check_offline_run(c, str(tmp_path)) is None
    c["train"]["mode"] = "online"
    assert check_offline_run(c, str(tmp_path)) is None


def test_check_run_refuses_a_run_that_extracts_and_not_one_that_stops_before(tmp_path):
    c = config(offline_max_bytes=1000)
    c["target"]["model"] = str(tmp_path / "target")
    (tmp_path / "target").mkdir()
    (tmp_path / "target/config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 4}))
    for shard in range(4):
        write_stats(open_storage(tmp_path / "run"), shard, 1000, 10)
    with pytest.raises(OfflineBudgetError, match="above train.offline_max_bytes"):
        check_offline_run(c, str(tmp_path / "run"))
    c["until"] = "tokenize"  # extracts nothing: nothing stored to refuse
    assert check_offline_run(c, str(tmp_path / "run")) is None


def test_train_start_refuses_from_the_extract_manifests():
    train = config(offline_max_bytes=1000)["train"]
    manifests = {
        "00000": {"size": 600, "tokens": 10, "rows": 2, "width": 30},
        "00001": {"size": 600, "tokens": 10, "rows": 2, "width": 30},
    }
    with pytest.raises(OfflineBudgetError, match="the 2 extract shards' manifests: 20 tokens x 30 values"):
        check_stored(train, manifests, 2)
    train["offline_max_bytes"] = 1200
    assert check_stored(train, manifests, 2) == 1200


def test_training_job_refuses_before_downloading(demo_model, tmp_path):
    from dflash_pipeline.training.trainer import SegmentJob, TrainingError
    from tests.support.train_data import write_tokenized_shard
    from tests.test_training import settings

    manifest = tmp_path / "extract-00000.manifest.json"
    # The object it names does not exist: the refusal must come before any download.
    manifest.write_text(
        json.dumps(
            {
                "key": "extract/missing.safetensors",
                "size": 10**12,
                "tokens": 10**6,
                "rows": 10,
                "width": 128,
                "layer_ids": [1, 5],
            }
        )
    )
    tokenized = {"00000": str(write_tokenized_shard(demo_model, tmp_path / "t.parquet", 4, seed=0))}
    job = SegmentJob(
        run_url=str(tmp_path),
        segment=0,
        settings=settings(mode="offline", offline_max_bytes=10**9),
        target_dir=str(demo_model),
        tokenized=tokenized,
        hidden={"00000": str(manifest)},
        manifest_path=str(tmp_path / layout.segment_manifest_key(0)),
        device="cpu",
    )
    with pytest.raises(TrainingError, match="train.mode offline would store 931.3 GiB"):
        job.run()


def test_snakemake_plan_refuses_offline_above_the_limit(workflow, demo_model):
    workflow.write_config(
        target={"model": str(demo_model), "build_demo": False},
        train={"mode": "offline", "offline_max_bytes": 1000},
    )
    proc = workflow.snakemake("-n", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "train.mode offline would store" in out and "rows of dataset.paths" in out, out[-3000:]
    assert "Online mode (train.mode: online) stores no hidden states" in out
    # The same run planned only up to tokenize stores no hidden states: nothing to refuse.
    workflow.write_config(until="tokenize")
    assert workflow.snakemake("-n", check=False).returncode == 0
