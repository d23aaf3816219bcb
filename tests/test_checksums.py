"""Checksums of shard objects (dflash_pipeline.core.checksums) and the run check of
dflash_pipeline.stages.verify, on a local folder and on the session's real S3 server."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.checksums import (
    ChecksumError,
    read_record,
    record_checksum,
    repair_command,
    rule_and_shard_of,
    sidecar_key,
    verify_local_copy,
    verify_stored_size,
)
from dflash_pipeline.core.digest import Digest, digest_file
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.model import speculators_format
from dflash_pipeline.stages import verify

KEY = "outputs/tokenize-00000.parquet"
CONTENT = bytes(range(256)) * 64  # 16 KiB


def write_shard(folder: Path, key: str = KEY, data: bytes = CONTENT) -> Path:
    path = folder / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def flip_byte(path: Path, at: int = 5000) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_record_then_verify_an_intact_copy(store, tmp_path):
    shard = write_shard(tmp_path / "job")
    record = record_checksum(store, shard, "tokenize", 0)
    doc = json.loads(store.read_text(sidecar_key(KEY)))
    assert sidecar_key(KEY) == "_progress/checksums/outputs/tokenize-00000.parquet.json"
    assert doc["size"] == len(CONTENT) and doc["rule"] == "tokenize" and doc["shard"] == "00000"
    assert doc["sha256"] == record.sha256 and len(record.sha256) == 64
    assert read_record(store, KEY) == record
    assert verify_local_copy(shard, store.url, "rule train") == record


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_flipped_byte_or_a_truncated_copy_is_caught(store, tmp_path, damage):
    shard = write_shard(tmp_path / "job")
    record_checksum(store, shard, "tokenize", 0)
    if damage == "flip":
        flip_byte(shard)
    else:
        shard.write_bytes(CONTENT[:1000])
    with pytest.raises(ChecksumError) as err:
        verify_local_copy(shard, store.url, "rule train")
    message = str(err.value)
    assert message.startswith(f"{store.url}/{KEY} is ")
    assert ("damaged: its sha256" if damage == "flip" else "short: 1000 bytes") in message
    assert "produced by rule tokenize (shard 00000)" in message
    assert "python -m dflash_pipeline.stages.verify --repair" in message and "make verify REPAIR=1" in message
    assert str(tmp_path / "job") not in message  # the stored object is named, not the local copy


def test_an_object_without_a_record_is_refused_naming_it_and_the_fix(store, tmp_path):
    # A deleted record must not switch the check off: a changed row would be read unchecked.
    shard = write_shard(tmp_path / "job")
    record_checksum(store, shard, "tokenize", 0)
    store.delete(sidecar_key(KEY))
    with pytest.raises(ChecksumError) as err:
        verify_local_copy(shard, store.url, "rule train")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{store.url}/{KEY} has no checksum record")
    assert "verify --adopt" in message and "verify --repair" in message


def test_a_missing_local_copy_is_an_error(tmp_path):
    store = open_storage(tmp_path / "run")
    shard = write_shard(tmp_path / "job")
    record_checksum(store, shard, "tokenize", 0)
    shard.unlink()
    with pytest.raises(ChecksumError, match="tokenize-00000.parquet is missing"):
        verify_local_copy(shard, store.url, "rule train")


def test_repair_command_names_the_prefix_of_an_s3_run():
    config = {"results_dir": "results", "run": "demo"}
    command = repair_command("s3://bucket/pre/fix/results/demo", config, None)
    assert command.startswith(
        "python -m dflash_pipeline.stages.verify --repair --default-storage-prefix s3://bucket/pre/fix"
    )
    assert "make verify REPAIR=1 PREFIX=s3://bucket/pre/fix" in command
    assert repair_command("results/demo", config, None).startswith(
        "python -m dflash_pipeline.stages.verify --repair  (or: make verify REPAIR=1)"
    )


def test_records_written_before_core_digest_read_as_they_are(store, tmp_path):
    """Records in runs made before the digest helper (its two keys were already these) need no
    conversion: read, checked and adopted alike."""
    shard = write_shard(tmp_path / "job")
    old = {"key": KEY, "sha256": digest_file(shard).sha256, "size": len(CONTENT), "rule": "tokenize"}
    store.write_text(sidecar_key(KEY), json.dumps({**old, "shard": "00000", "written_at": 1.0}))
    assert verify_local_copy(shard, store.url, "rule train").digest == Digest.of(old)


def test_a_ranged_reader_checks_the_record_and_the_stored_size(tmp_path):
    store = open_storage(tmp_path / "run")
    key = layout.INGESTED_PROMPTS
    written = write_shard(tmp_path / "job", key)
    record_checksum(store, written, "ingest", "-")
    store.upload_file(key, written)
    assert verify_stored_size(store.url, store.join(key), "rule prepare").size == len(CONTENT)
    store.write_bytes(key, CONTENT[:100])
    with pytest.raises(ChecksumError, match=f"{key} is 100 bytes, not the {len(CONTENT)}.*rule prepare"):
        verify_stored_size(store.url, store.join(key), "rule prepare")
    store.delete(sidecar_key(key))
    with pytest.raises(ChecksumError, match="has no checksum record"):
        verify_stored_size(store.url, store.join(key), "rule prepare")
    with pytest.raises(ValueError, match="not in the run root"):
        verify_stored_size(store.url, f"{tmp_path}/elsewhere/{key}", "rule prepare")


def test_flipped_and_truncated_s3_objects_are_caught_at_read_with_their_s3_name(s3_server, s3_env, tmp_path):
    """As in an S3 run: the job writes locally and records, Snakemake uploads, the object is
    damaged in the bucket, the consumer gets Snakemake's local copy of it."""
    prefix = f"s3://{s3_server.bucket}/ck-{uuid.uuid4().hex[:8]}"
    run_url = f"{prefix}/results/demo"
    store = open_storage(run_url)
    config = {"results_dir": "results", "run": "demo"}
    for shard, damage in ((0, "flip"), (1, "truncate")):
        key = layout.shard_key("tokenize", shard)
        written = write_shard(tmp_path / "job", key)
        record_checksum(store, written, "tokenize", shard)
        store.upload_file(key, written)  # Snakemake's upload after the job
        data = bytearray(store.read_bytes(key))
        if damage == "flip":
            data[7000] ^= 0x80
        store.write_bytes(key, bytes(data if damage == "flip" else data[: len(data) // 2]))
        local_copy = (
            tmp_path / ".snakemake/storage/s3" / s3_server.bucket / prefix.split("/", 3)[3] / "results/demo" / key
        )
        local_copy.parent.mkdir(parents=True, exist_ok=True)
        store.download_file(key, local_copy)
        with pytest.raises(ChecksumError) as err:
            verify_local_copy(local_copy, run_url, "rule train", config=config)
        message = str(err.value)
        assert message.startswith(f"{run_url}/{key} is {'damaged' if damage == 'flip' else 'short'}"), message
        assert f"produced by rule tokenize (shard {shard:05d})" in message
        assert "python -m dflash_pipeline.stages.verify --repair" in message
        assert f"--default-storage-prefix {prefix}" in message and f"PREFIX={prefix}" in message
        assert ".snakemake" not in message


# --- the run check -------------------------------------------------------------------------------


def small_run(tmp_path: Path, num_shards: int = 2) -> tuple[Path, dict]:
    """A local run root with every shard object of `until: tokenize` and its record."""
    root = tmp_path / "results/demo"
    store = open_storage(root)
    config = validate_config(
        {
            "results_dir": str(tmp_path / "results"),
            "results_dir_outside_workdir": True,  # a temp folder
            "run": "demo",
            "until": "tokenize",
            "num_shards": num_shards,
        }
    )
    for key in verify.expected_keys(config):
        path = write_shard(root, key, key.encode() * 100)
        record_checksum(store, path, *rule_and_shard_of(key), key=key)
    return root, config


def test_expected_keys_follow_num_shards_until_and_the_drafters_shape():
    config = validate_config({"until": "tokenize", "num_shards": 2, "train": {"mode": "online"}})
    keys = verify.expected_keys(config)
    assert len(keys) == 3 + 2 * 5 and "outputs/tokenize-00001.heldout.parquet" in keys
    assert verify.expected_keys({**config, "until": "generate"}) == [
        layout.INGESTED_PROMPTS,
        layout.INGEST_SUMMARY,
        layout.QUARANTINE,
        "outputs/prepare-00000.parquet",
        "outputs/prepare-00001.parquet",
        "outputs/generate-00000.parquet",
        "outputs/generate-00001.parquet",
    ]
    offline = verify.expected_keys(
        validate_config({"until": "train", "num_shards": 2, "train": {"mode": "offline", "segments": 2}})
    )
    assert "outputs/extract-00001.manifest.json" in offline
    assert {"outputs/train-segment-0001.json", layout.DRAFTER_CONFIG, layout.DRAFTER_WEIGHTS} <= set(offline)
    # The speculators export where the export writes it: not for a drafter mixing sliding and
    # full layers (tests/test_run_outputs.py holds both to the rules).
    speculators = {speculators_format.RUN_CONFIG, speculators_format.RUN_WEIGHTS}
    assert speculators <= set(offline)
    mixed = validate_config(
        {
            "until": "train",
            "num_shards": 2,
            "train": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16},
        }
    )
    assert not speculators & set(verify.expected_keys(mixed))


def test_check_run_lists_missing_damaged_and_orphaned_objects(tmp_path):
    root, config = small_run(tmp_path)
    store = open_storage(root)
    assert verify.check_run(store, config).ok
    (root / "outputs/generate-00001.parquet").unlink()
    flip_byte(root / "outputs/tokenize-00000.parquet", 10)
    (root / "outputs/tokenize-00001.stats.json").write_bytes(b"short")
    write_shard(root, "outputs/prepare-00002.parquet")  # beyond num_shards
    record_checksum(store, write_shard(tmp_path / "gone", "outputs/generate-00007.parquet"), "generate", 7)
    write_shard(root, "outputs/prepare-00001.parquet", b"rewritten before checksums")
    store.delete(sidecar_key("outputs/prepare-00001.parquet"))
    report = verify.check_run(store, config)
    found = [(f.kind, f.key) for f in report.findings]
    assert found == [
        ("missing", "outputs/generate-00001.parquet"),
        ("damaged", "outputs/tokenize-00000.parquet"),
        ("damaged", "outputs/tokenize-00001.stats.json"),
        ("unrecorded", "outputs/prepare-00001.parquet"),
        ("orphaned", "_progress/checksums/outputs/generate-00007.parquet.json"),
        ("orphaned", "outputs/prepare-00002.parquet"),
    ]
    assert report.unchecked == ["outputs/prepare-00001.parquet"]
    # A size check alone catches the short object, not the flipped byte.
    quick = verify.check_run(store, config, sizes_only=True)
    assert ("damaged", "outputs/tokenize-00000.parquet") not in [(f.kind, f.key) for f in quick.findings]
    lines = report.lines(store)
    assert lines[0].startswith(f"missing   {root}/outputs/generate-00001.parquet")
    assert lines[-1].endswith("1 missing, 2 damaged, 1 without a checksum record, 2 orphaned")

    command = verify.rebuild_command(report, "results/demo", ["my.yaml"], None, ["--cores", "2"])
    assert command[1:] == [
        "-m",
        "snakemake",
        "--forcerun",
        "results/demo/outputs/generate-00001.parquet",
        "results/demo/outputs/tokenize-00000.parquet",
        "results/demo/outputs/tokenize-00001.stats.json",
        "results/demo/outputs/prepare-00001.parquet",
        "--configfile",
        "my.yaml",
        "--cores",
        "2",
    ]
    s3 = verify.rebuild_command(report, "results/demo", None, "s3://b/p", [])
    assert s3[-6:] == ["--default-storage-provider", "s3", "--default-storage-prefix", "s3://b/p", "--cores", "all"]

    deleted = verify.delete_damaged(store, report)
    assert "outputs/tokenize-00000.parquet" in deleted and not (root / "outputs/tokenize-00000.parquet").exists()
    assert not store.exists(sidecar_key("outputs/tokenize-00000.parquet"))
    assert not store.exists(sidecar_key("outputs/generate-00007.parquet"))
    assert (root / "outputs/prepare-00002.parquet").exists()  # beyond num_shards: left alone


def verify_config(tmp_path, config: dict) -> Path:
    """The config file `verify` reads for ``small_run``'s run (its results_dir is a temp folder)."""
    config_file = tmp_path / "run.yaml"
    settings = {"results_dir": config["results_dir"], "results_dir_outside_workdir": True}
    config_file.write_text(json.dumps({**settings, "run": "demo", "until": "tokenize", "num_shards": 2}))
    return config_file


def test_verify_cli_exit_codes_and_dry_run_repair(tmp_path, monkeypatch, capsys):
    root, config = small_run(tmp_path)
    config_file = verify_config(tmp_path, config)
    monkeypatch.chdir(tmp_path)
    assert verify.main(["--configfile", str(config_file)]) == 0
    assert "0 missing, 0 damaged, 0 without a checksum record, 0 orphaned" in capsys.readouterr().out
    os.remove(root / "outputs/generate-00001.parquet")
    assert verify.main(["--configfile", str(config_file)]) == 1
    out = capsys.readouterr().out
    assert f"missing   {root}/outputs/generate-00001.parquet" in out and "--repair" in out
    assert verify.main(["--configfile", str(config_file), "--repair", "--dry-run", "--", "--cores", "1"]) == 1
    out = capsys.readouterr().out
    assert "--forcerun " + f"{root}/outputs/generate-00001.parquet" in out
    assert (root / "outputs/tokenize-00001.parquet").exists()


def test_a_hidden_state_shard_unlike_its_manifest_is_refused(tmp_path):
    """The extract manifest is an integrity record like the others (core.digest): training's
    copy of a shorter or changed shard is refused, naming the stored object and its manifest."""
    from types import SimpleNamespace

    from dflash_pipeline.data.hidden import HiddenShards

    store = open_storage(tmp_path / "run")
    key = layout.hidden_states_key(0)
    written = write_shard(tmp_path / "job", key)
    manifest = {"key": key, "layer_ids": [1], **digest_file(written).fields()}
    manifest_path = tmp_path / "extract-00000.manifest.json"
    manifest_path.write_text(json.dumps(manifest))
    store.write_bytes(key, CONTENT[:1000])
    with pytest.raises(ValueError) as err:
        HiddenShards(store, {"00000": str(manifest_path)}, SimpleNamespace(target_layer_ids=[1]))
    assert str(err.value) == (
        f"{store.join(key)} does not match {manifest_path}: it is short: 1000 bytes, not the "
        f"{len(CONTENT)} it was written with"
    )
