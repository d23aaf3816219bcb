"""Checksum records beyond the shard objects (dflash_pipeline.core.checksums): a deleted record is
an error, verify --adopt writes records once, the ingest outputs, segment manifests (with their
checkpoint index) and the drafter are checked, a job that refuses a damaged input says so, and so
does the driver's check of the jobs about to run again over their earlier outputs."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.core import checksums, layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.checksums import (
    ChecksumError,
    Rerun,
    record_checksum,
    refuse_damaged_reruns,
    refusal_key,
    refused,
    rule_and_shard_of,
    sidecar_key,
    verify_inputs,
)
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.stages import verify
from tests.test_checksums import flip_byte, small_run, verify_config, write_shard


def test_a_deleted_record_fails_verify_and_the_advice_is_a_repair(tmp_path, monkeypatch, capsys):
    root, config = small_run(tmp_path)
    config_file = verify_config(tmp_path, config)
    monkeypatch.chdir(tmp_path)
    store = open_storage(root)
    # A changed row with its record deleted, in a run that records checksums: named, exit 1, and
    # the advice is the repair (adopting would give the changed bytes a valid record).
    write_shard(root, "outputs/generate-00000.parquet", b"a changed row")
    store.delete(sidecar_key("outputs/generate-00000.parquet"))
    assert verify.main(["--configfile", str(config_file)]) == 1
    out = capsys.readouterr().out
    assert f"unrecorded {root}/outputs/generate-00000.parquet" in out
    assert "verify --repair rebuilds it)" in out and "--adopt" not in out
    # --adopt refuses it all the same: its content is no parquet.
    assert verify.main(["--configfile", str(config_file), "--adopt"]) == 1
    out = capsys.readouterr().out
    assert "adopted 0 object(s)" in out
    assert f"not adopted {root}/outputs/generate-00000.parquet: it does not parse as parquet" in out
    assert not store.exists(sidecar_key("outputs/generate-00000.parquet"))


def parseable(key: str) -> bytes:
    """Content that parses as the kind of ``key`` (parquet, JSON, JSON lines)."""
    if key.endswith(".parquet"):
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        sink = io.BytesIO()
        pq.write_table(pa.table({"id": [key]}), sink)
        return sink.getvalue()
    return b'{"key": 1}\n'


def test_adopt_records_a_run_made_before_checksums_once_and_refuses_what_does_not_parse(tmp_path, monkeypatch, capsys):
    root, config = small_run(tmp_path)
    config_file = verify_config(tmp_path, config)
    monkeypatch.chdir(tmp_path)
    store = open_storage(root)
    keys = verify.expected_keys(config)
    for key in keys:
        write_shard(root, key, parseable(key))
    store.delete_prefix(checksums.CHECKSUMS_DIR + "/")  # a run made before records existed
    damaged = "outputs/tokenize-00001.parquet"
    write_shard(root, damaged, parseable(damaged)[:-30])  # its footer cut
    assert verify.main(["--configfile", str(config_file)]) == 1
    assert "a run made before checksums were recorded: verify --adopt" in capsys.readouterr().out
    assert verify.main(["--configfile", str(config_file), "--adopt"]) == 1
    out = capsys.readouterr().out
    assert f"adopted {len(keys) - 1} object(s)" in out
    assert f"not adopted {root}/{damaged}: it does not parse as parquet" in out
    assert json.loads(store.read_bytes(sidecar_key("outputs/generate-00000.parquet")))["adopted"] is True
    assert not store.exists(sidecar_key(damaged))
    write_shard(root, damaged, parseable(damaged))  # rebuilt
    assert verify.main(["--configfile", str(config_file), "--adopt"]) == 0
    assert "adopted 1 object(s)" in capsys.readouterr().out
    assert verify.main(["--configfile", str(config_file), "--adopt"]) == 0
    assert "adopted 0 object(s)" in capsys.readouterr().out
    assert verify.main(["--configfile", str(config_file)]) == 0


def test_adopt_parses_safetensors_by_their_header(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(path))
    assert verify.content_problem(path, "drafter/model.safetensors") is None
    path.write_bytes(path.read_bytes()[:-8])
    assert "tensors do not end where the file does" in verify.content_problem(path, "drafter/model.safetensors")
    path.write_bytes(b"\xff" * 16)
    assert "header length runs past the file" in verify.content_problem(path, "drafter/model.safetensors")


def test_refusals_are_notes_of_verify_never_orphans_nor_deleted_by_repair(tmp_path):
    root, config = small_run(tmp_path)
    store = open_storage(root)
    refusal = refusal_key("tokenize", {"shard": "00001"})
    doc = {"rule": "tokenize", "wildcards": {"shard": "00001"}, "input": "outputs/generate-00001.parquet"}
    store.write_text(refusal, json.dumps(doc))
    report = verify.check_run(store, config)
    assert report.ok and report.refusals == [refusal]
    assert f"note      {root}/{refusal}  (rule tokenize shard=00001 refused its damaged input" in "\n".join(
        report.lines(store)
    )
    (root / "outputs/generate-00001.parquet").unlink()
    report = verify.check_run(store, config)
    assert [f.kind for f in report.findings] == ["missing"]
    verify.delete_damaged(store, report)
    assert store.exists(refusal)


def test_verify_names_a_damaged_ingest_output_segment_manifest_index_and_drafter(tmp_path):
    root = tmp_path / "results/demo"
    store = open_storage(root)
    config = validate_config({"until": "train", "num_shards": 1, "train": {"mode": "online", "segments": 2}})
    for key in verify.expected_keys(config):
        data = key.encode() * 100
        if key.startswith("outputs/train-segment-"):
            prefix = layout.checkpoint_prefix(key[-9:-5])
            files = {"shard-00000-of-00001.pt": {"size": 1, "sha256": "ab"}}
            data = json.dumps({"checkpoint_prefix": prefix, "files": files}).encode()
            store.write_text(prefix + "checkpoint.json", json.dumps({"files": files}))
        record_checksum(store, write_shard(root, key, data), *rule_and_shard_of(key), key=key)
    assert verify.check_run(store, config).ok
    flip_byte(root / layout.INGESTED_PROMPTS, 10)
    flip_byte(root / layout.DRAFTER_WEIGHTS, 10)
    (root / "outputs/train-segment-0000.json").write_bytes(b"{}")
    index = layout.checkpoint_prefix(1) + "checkpoint.json"
    store.write_text(index, json.dumps({"files": {"shard-00000-of-00001.pt": {"size": 1, "sha256": "cd"}}}))
    found = [(f.kind, f.key, f.detail) for f in verify.check_run(store, config).findings]
    assert [(k, key) for k, key, _ in found] == [
        ("damaged", layout.DRAFTER_WEIGHTS),
        ("damaged", layout.INGESTED_PROMPTS),
        ("damaged", "outputs/train-segment-0000.json"),
        ("damaged", "outputs/train-segment-0001.json"),
    ]
    assert "rule export" in found[0][2] and "checkpoint index" in found[3][2]


def test_a_damaged_input_writes_the_jobs_refusal(tmp_path):
    root = tmp_path / "results/demo"
    store = open_storage(root)
    shard = write_shard(root, "outputs/prepare-00001.parquet")
    record_checksum(store, shard, "prepare", 1)
    flip_byte(shard)
    with pytest.raises(ChecksumError, match="prepare-00001.parquet is damaged"):
        verify_inputs(str(root), "generate", {"shard": "00001"}, {}, [str(shard)])
    refusal = refused(store, "generate", {"shard": "00001"})
    assert refusal["input"] == "outputs/prepare-00001.parquet"
    assert refusal_key("generate", {"shard": "00001"}).endswith("refused/generate-shard=00001.json")


def test_reruns_with_a_damaged_input_are_refused_keeping_their_outputs_each_input_read_once(tmp_path, monkeypatch):
    root = tmp_path / "results/demo"
    store = open_storage(root)
    good = write_shard(root, "outputs/prepare-00000.parquet")
    bad = write_shard(root, "outputs/prepare-00001.parquet")
    record_checksum(store, good, "prepare", 0)
    record_checksum(store, bad, "prepare", 1)
    flip_byte(bad)
    # Shard 0's job was refused in an earlier run; its input has been repaired since.
    store.write_text(refusal_key("generate", {"shard": "00000"}), "{}")
    hashed = []
    real_digest = checksums.digest_file
    monkeypatch.setattr(checksums, "digest_file", lambda path: hashed.append(str(path)) or real_digest(path))
    reruns = [
        Rerun("generate", {"shard": "00000"}, (str(good),), ("outputs/generate-00000.parquet",)),
        Rerun("generate", {"shard": "00001"}, (str(bad),), ("outputs/generate-00001.parquet",)),
        # A job of the whole run reading both shards (as the report jobs read every shard).
        Rerun("report_prepare", {}, (str(good), str(bad)), ("report/prepare.svg", "report/prepare.html")),
    ]
    refusals = refuse_damaged_reruns(str(root), {}, reruns, parallel=3)

    assert sorted(hashed) == sorted([str(good), str(bad)])  # each input once, for the three jobs
    assert [rerun for rerun, _ in refusals] == reruns[1:]
    for rerun, line in refusals:
        assert "\n" not in line
        assert line.startswith(f"{checksums.job_name(rerun.rule, rerun.wildcards)} not run, its earlier outputs kept (")
        assert f"{root}/outputs/prepare-00001.parquet is damaged" in line
        assert "rule prepare (shard 00001)" in line and "make verify REPAIR=1" in line
    assert refusals[0][1].startswith("rule generate (shard 00001) not run, its earlier outputs kept (outputs/generate-")
    assert "(report/prepare.svg, report/prepare.html)" in refusals[1][1]
    # Each refused job's refusal, as its own check writes it, with the outputs it keeps.
    refusal = refused(store, "generate", {"shard": "00001"})
    assert refusal["input"] == "outputs/prepare-00001.parquet"
    assert refusal["kept_outputs"] == ["outputs/generate-00001.parquet"]
    assert refused(store, "report_prepare", {})["kept_outputs"] == ["report/prepare.svg", "report/prepare.html"]
    # The job whose input is intact: its old refusal removed, as its own check would.
    assert refused(store, "generate", {"shard": "00000"}) is None


def test_a_job_that_refuses_its_own_input_lists_no_kept_outputs(tmp_path):
    root = tmp_path / "results/demo"
    store = open_storage(root)
    shard = write_shard(root, "outputs/prepare-00001.parquet")
    record_checksum(store, shard, "prepare", 1)
    flip_byte(shard)
    with pytest.raises(ChecksumError):
        verify_inputs(str(root), "generate", {"shard": "00001"}, {}, [str(shard)])
    assert "kept_outputs" not in refused(store, "generate", {"shard": "00001"})
