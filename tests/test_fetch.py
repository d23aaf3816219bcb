"""`python -m dflash_pipeline.stages.fetch` copies a run's results to a local folder: the selection
(by the layout's keys), "already there" (size + ETag/mtime + a local sha256 record), a run in S3
on the real test server and a local run folder, and one-line errors."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.stages import fetch as fetch_mod
from dflash_pipeline.stages.fetch import MANIFEST, Listed, fetch, is_fetched, kind, main, md5_file

CHECKPOINT_SHARD = layout.checkpoint_prefix(0) + "shard-00000-of-00001.pt"
INSEGMENT_SHARD = layout.train_progress_prefix(1) + "checkpoint/step-00000010/shard-00000-of-00001.pt"
GENERATION_PART = layout.progress_prefix("generate", 1) + "part-00000000000000000001-abcdef.parquet"

# What a user reads: fetched by default.
ARTIFACTS = {
    layout.DRAFTER_CONFIG: b'{"architectures": ["DFlashDraftModel"]}\n',
    layout.DRAFTER_WEIGHTS: b"\x01" * 3000,
    layout.EVAL_METRICS: b'{"acceptance_length": 3.2}\n',
    layout.report_key("acceptance.svg"): b"<svg/>",
    layout.report_key("training.svg"): b"<svg></svg>",
    layout.INGEST_SUMMARY: b'{"valid": 10}\n',
    layout.QUARANTINE: b"",
    f"{layout.LOGS_DIR}/generate/00000.log": b"generated 10 rows\n",
    layout.benchmark_key("generate", 0): b"s\th:m:s\n1.0\t0:00:01\n",
    layout.segment_manifest_key(0): b'{"checkpoint_prefix": "checkpoints/segment-0000/"}\n',
    layout.checkpoint_prefix(0) + "checkpoint.json": b'{"format": 2}\n',
    layout.shard_key("tokenize", 0, "stats.json"): b'{"rows": 10}\n',
    layout.shard_key("extract", 0): b'{"key": "extract/shard-00000.safetensors"}\n',
    layout.train_progress_prefix(1) + layout.TRAIN_METRICS: b'{"step": 1, "loss": 2.0}\n',
    layout.progress_prefix("generate", 1) + "telemetry.json": b'{"done": 3}\n',
    layout.HALT: b'{"stage": "tokenize"}\n',
}
# Fetched only with --with-checkpoints; the segment shard is multipart-sized (boto: > 8 MiB).
CHECKPOINTS = {
    CHECKPOINT_SHARD: os.urandom(9 << 20),
    INSEGMENT_SHARD: b"\x02" * 2000,
}
# Fetched only with --with-shards.
SHARDS = {
    layout.INGESTED_PROMPTS: b"PAR1 ingest",
    layout.shard_key("generate", 0): b"PAR1 generate",
    layout.shard_key("tokenize", 0): b"PAR1 tokenize",
    layout.heldout_key(0): b"PAR1 heldout",
    layout.hidden_states_key(0): b"\x03" * 4000,
    GENERATION_PART: b"PAR1 part",
    layout.reuse_key("generate", 0): b"PAR1 reuse",
}


def write_run(storage) -> None:
    for key, data in {**ARTIFACTS, **SHARDS, **CHECKPOINTS}.items():
        if len(data) > 8 << 20:
            with storage.staged_file(key) as tmp:  # one multipart upload on S3
                tmp.write_bytes(data)
        else:
            storage.write_bytes(key, data)


def fetched_files(dest) -> dict[str, bytes]:
    return {
        p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file() and p.name != MANIFEST
    }


@pytest.fixture
def s3_run(s3_server, s3_env):
    url = f"s3://{s3_server.bucket}/fetch-{uuid.uuid4().hex[:8]}/results/demo"
    storage = open_storage(url)
    write_run(storage)
    return url, storage


@pytest.fixture
def local_run(tmp_path):
    root = tmp_path / "results" / "demo"
    write_run(open_storage(root))
    return root


# --- selection and comparison, without a server ---


def test_selection_follows_the_layout():
    assert {k for k in ARTIFACTS if kind(k) != "artifact"} == set()
    assert {kind(k) for k in CHECKPOINTS} == {"checkpoint"}
    assert {kind(k) for k in SHARDS} == {"shard"}
    assert kind(MANIFEST) == "record"


def test_a_local_file_is_the_object_when_its_record_matches(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    listed = Listed("f.bin", 3, "deadbeef" * 4 + "-2")  # a multipart ETag: no MD5 of the bytes
    record = fetch_mod.record_of(listed, path)
    assert is_fetched(listed, path, record)
    assert not is_fetched(Listed("f.bin", 3, "0" * 32 + "-2"), path, record)  # the object changed
    assert not is_fetched(listed, path, None)  # no record, no MD5 to check: copy again
    os.utime(path, ns=(0, 0))  # touched, same bytes: the sha256 vouches for it
    assert is_fetched(listed, path, record)
    path.write_bytes(b"abd")  # edited locally, same size
    assert not is_fetched(listed, path, record)
    assert not is_fetched(listed, tmp_path / "missing", record)
    single = Listed("f.bin", 3, md5_file(path))  # a single-part ETag is the MD5
    assert is_fetched(single, path, None)


# --- a run in S3 ---


def test_fetch_from_s3_copies_what_a_user_reads_then_only_what_changed(s3_run, tmp_path, capsys):
    url, storage = s3_run
    dest = tmp_path / "laptop"
    assert main(["--run-url", url, "--to", str(dest)]) == 0
    assert fetched_files(dest) == ARTIFACTS
    err = capsys.readouterr().err
    assert f"{len(ARTIFACTS)} copied" in err.splitlines()[-1]
    assert "2 checkpoint objects" in err and "--with-checkpoints" in err
    assert f"{len(SHARDS)} shard objects" in err
    records = json.loads((dest / MANIFEST).read_text())["objects"]
    assert set(records) == set(ARTIFACTS)

    assert main(["--run-url", url, "--to", str(dest)]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (f"0 copied (0 B), {len(ARTIFACTS)} already there, 0 skipped")

    storage.write_bytes(layout.EVAL_METRICS, b'{"acceptance_length": 3.5}\n')
    summary = fetch(url, dest)
    assert (summary.copied, summary.there) == (1, len(ARTIFACTS) - 1)
    assert (dest / layout.EVAL_METRICS).read_bytes() == b'{"acceptance_length": 3.5}\n'
    assert "copied outputs/evaluate-metrics.json" in capsys.readouterr().err


def test_with_checkpoints_adds_them_and_a_multipart_object_is_recognised_by_its_record(s3_run, tmp_path):
    url, _ = s3_run
    dest = tmp_path / "laptop"
    fetch(url, dest)
    summary = fetch(url, dest, with_checkpoints=True)
    assert summary.copied == len(CHECKPOINTS)
    assert fetched_files(dest) == {**ARTIFACTS, **CHECKPOINTS}
    assert fetch(url, dest, with_checkpoints=True).copied == 0
    # Without the manifest, single-part objects are checked by MD5; the multipart one is copied.
    (dest / MANIFEST).unlink()
    summary = fetch(url, dest, with_checkpoints=True)
    assert (summary.copied, summary.there) == (1, len(ARTIFACTS) + len(CHECKPOINTS) - 1)


def test_with_shards_and_dry_run(s3_run, tmp_path, capsys):
    url, _ = s3_run
    dest = tmp_path / "laptop"
    summary = fetch(url, dest, with_shards=True, dry_run=True)
    assert summary.copied == len(ARTIFACTS) + len(SHARDS)
    assert not dest.exists()
    assert f"would copy {layout.hidden_states_key(0)}" in capsys.readouterr().err
    fetch(url, dest, with_shards=True)
    assert fetched_files(dest) == {**ARTIFACTS, **SHARDS}


def test_an_object_gone_between_listing_and_reading_is_skipped(s3_run, tmp_path, monkeypatch, capsys):
    url, _ = s3_run
    real = fetch_mod.list_run
    monkeypatch.setattr(fetch_mod, "list_run", lambda s: [*real(s), Listed("logs/gone.log", 5, "x")])
    summary = fetch(url, tmp_path / "laptop")
    assert (summary.copied, summary.skipped, summary.failed) == (len(ARTIFACTS), 1, 0)
    assert "skipped logs/gone.log: gone or changed since it was listed" in capsys.readouterr().err


# --- a local run folder ---


def test_fetch_from_a_local_run_folder(local_run, tmp_path):
    dest = tmp_path / "copy"
    assert fetch(str(local_run), dest).copied == len(ARTIFACTS)
    assert fetched_files(dest) == ARTIFACTS
    assert fetch(str(local_run), dest).copied == 0
    (local_run / layout.INGEST_SUMMARY).write_text('{"valid": 11}\n')
    summary = fetch(str(local_run), dest)
    assert (summary.copied, summary.there) == (1, len(ARTIFACTS) - 1)
    assert (dest / layout.INGEST_SUMMARY).read_text() == '{"valid": 11}\n'


# --- errors: one line naming the URL, exit code 1 ---


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def test_a_missing_run_root_is_one_line(s3_server, s3_env, tmp_path, capsys):
    url = f"s3://{s3_server.bucket}/no-such-run-{uuid.uuid4().hex[:8]}"
    err = one_line_error(capsys, ["--run-url", url, "--to", str(tmp_path / "d")])
    assert url in err and "no objects there" in err
    err = one_line_error(capsys, ["--run-url", str(tmp_path / "nowhere"), "--to", str(tmp_path / "d")])
    assert str(tmp_path / "nowhere") in err and "no such folder" in err


def test_a_bad_bucket_is_one_line(s3_env, tmp_path, capsys):
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/results/demo"
    err = one_line_error(capsys, ["--run-url", url, "--to", str(tmp_path / "d")])
    assert url in err and "NoSuchBucket" in err


def test_missing_credentials_are_one_line(s3_server, s3_env, tmp_path, monkeypatch, capsys):
    for name in (
        "SNAKEMAKE_STORAGE_S3_ACCESS_KEY",
        "SNAKEMAKE_STORAGE_S3_SECRET_KEY",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    url = f"s3://{s3_server.bucket}/results/demo"
    err = one_line_error(capsys, ["--run-url", url, "--to", str(tmp_path / "d")])
    assert url in err and "credentials" in err


def test_an_unreachable_server_is_one_line(s3_env, tmp_path, monkeypatch, capsys):
    from tests.support.seaweed import free_port

    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    # No outage tolerance: the default rides out minutes of outage, which this test need not wait for.
    monkeypatch.setenv("DFLASH_STORAGE_OUTAGE_TOLERANCE_S", "0")
    url = "s3://dflash-test/results/demo"
    err = one_line_error(capsys, ["--run-url", url, "--to", str(tmp_path / "d")])
    assert url in err and "unreachable" in err and "EndpointConnectionError" in err
