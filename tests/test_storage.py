"""The storage layer behaves the same on a local folder and on a real S3 server."""

from __future__ import annotations

import uuid

import pytest

from dflash_pipeline.core.digest import Digest
from dflash_pipeline.core.storage import LocalStorage, NotFound, StorageError, open_object, write_atomically
from dflash_pipeline.core.s3 import BUCKET_SENTINEL_KEY, S3Storage, s3_settings_from_env


def test_write_read_list_delete_round_trip(store):
    store.write_bytes("a/one.bin", b"\x00\x01")
    store.write_text("a/b/two.txt", "two")
    store.write_text("c.txt", "three")
    assert store.read_bytes("a/one.bin") == b"\x00\x01"
    assert store.read_text("a/b/two.txt") == "two"
    assert [o.key for o in store.list()] == ["a/b/two.txt", "a/one.bin", "c.txt"]
    assert [o.key for o in store.list("a/")] == ["a/b/two.txt", "a/one.bin"]
    assert {o.key: o.size for o in store.list()}["a/one.bin"] == 2
    assert store.exists("c.txt") and not store.exists("missing.txt")
    store.delete("c.txt")
    store.delete("c.txt")  # deleting twice is fine
    assert not store.exists("c.txt")
    assert store.delete_prefix("a/") == 2
    assert store.list() == []


def test_any_under_is_an_existence_check_that_lists_one_key(store):
    """What a planning decision asks (dflash_pipeline.engines.tuning.generate_waits_for_tune): on
    S3 one listing of one key, however many objects share the prefix."""
    assert not store.any_under("outputs/generate-")
    for shard in range(3):
        store.write_text(f"outputs/generate-0000{shard}.parquet", "x")
    asked = []
    if isinstance(store, S3Storage):
        events = store.client.meta.events
        events.register(
            "provide-client-params.s3.ListObjectsV2",
            lambda params, **_: asked.append(params),
            unique_id="any-under-test",
        )
    try:
        assert store.any_under("outputs/generate-") and store.any_under("")
        assert not store.any_under("outputs/tokenize-")
    finally:
        if isinstance(store, S3Storage):
            events.unregister("provide-client-params.s3.ListObjectsV2", unique_id="any-under-test")
    assert all(params["MaxKeys"] == 1 for params in asked)
    assert len(asked) == (3 if isinstance(store, S3Storage) else 0)


def test_overwrite_replaces_whole_object(store):
    store.write_bytes("x", b"long old content")
    store.write_bytes("x", b"new")
    assert store.read_bytes("x") == b"new"


def test_reading_a_missing_object_names_its_url(store):
    with pytest.raises(StorageError, match="missing.bin does not exist"):
        store.read_bytes("missing.bin")


def test_upload_download_and_local_copy(store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload" * 1000)
    store.upload_file("up/src.bin", src)
    dst = tmp_path / "dst.bin"
    store.download_file("up/src.bin", dst)
    assert dst.read_bytes() == src.read_bytes()
    with store.local_copy("up/src.bin") as local:
        assert local.read_bytes() == src.read_bytes()


def test_write_atomically_leaves_nothing_when_the_writer_fails(store):
    url = store.join("shards/out.parquet")
    store.write_text("shards/out.parquet", "old")
    with pytest.raises(RuntimeError), write_atomically(url) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer crashed")
    assert store.read_text("shards/out.parquet") == "old"
    assert [o.key for o in store.list("shards/")] == ["shards/out.parquet"]
    with write_atomically(url) as tmp:
        tmp.write_text("new")
    assert store.read_text("shards/out.parquet") == "new"


def test_a_staged_file_appears_whole_when_its_block_ends(store):
    with store.staged_file("ckpt/shard.pt") as path:
        path.write_bytes(b"x" * 4096)
        assert not store.exists("ckpt/shard.pt")  # nothing visible while it is written
    assert store.read_bytes("ckpt/shard.pt") == b"x" * 4096
    assert [o.key for o in store.list("ckpt/")] == ["ckpt/shard.pt"]


def test_a_local_staged_file_is_written_beside_its_destination_not_copied(tmp_path):
    """A multi-GB checkpoint or hidden-state shard on local storage is written once, in the
    destination's folder, and renamed; not written to /tmp and then copied."""
    store = LocalStorage(tmp_path / "run")
    with store.staged_file("ckpt/shard.pt") as path:
        assert path.parent == tmp_path / "run" / "ckpt"
        path.write_bytes(b"y")
    assert (tmp_path / "run" / "ckpt" / "shard.pt").read_bytes() == b"y"


def test_local_listing_hides_partial_files(tmp_path):
    store = LocalStorage(tmp_path)
    (tmp_path / ".x.parquet.partial-1234").write_text("half")
    store.write_text("x.parquet", "whole")
    assert [o.key for o in store.list()] == ["x.parquet"]


def test_local_keys_cannot_escape_the_root(tmp_path):
    store = LocalStorage(tmp_path / "root")
    with pytest.raises(StorageError, match="escapes"):
        store.write_text("../outside.txt", "no")


def test_open_object_splits_parent_and_key(tmp_path):
    storage, key = open_object("s3://bucket/run/shards/a.parquet")
    assert (storage.url, key) == ("s3://bucket/run/shards", "a.parquet")
    storage, key = open_object(tmp_path / "a.txt")
    assert isinstance(storage, LocalStorage) and key == "a.txt"


def test_s3_settings_come_from_the_plugin_variables():
    settings = s3_settings_from_env(
        {
            "SNAKEMAKE_STORAGE_S3_ENDPOINT_URL": "http://127.0.0.1:9",
            "SNAKEMAKE_STORAGE_S3_ACCESS_KEY": "k",
            "SNAKEMAKE_STORAGE_S3_SECRET_KEY": "s",
        }
    )
    assert settings["endpoint_url"] == "http://127.0.0.1:9"
    assert (settings["access_key"], settings["secret_key"]) == ("k", "s")
    assert settings["region"] == "us-east-1"


def test_ensure_bucket_creates_bucket_and_keeps_a_sentinel(s3_server, s3_env):
    bucket = f"fresh-{uuid.uuid4().hex[:8]}"
    store = S3Storage(f"s3://{bucket}/run")
    store.ensure_bucket()
    store.ensure_bucket()  # idempotent
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == [BUCKET_SENTINEL_KEY]


def test_boto_credentials_alone_serve_the_storage_layer(s3_server, aws_env):
    """Only AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL (none of the S3 plugin's
    variables): the storage layer resolves them through boto, as the plugin does."""
    from dflash_pipeline.core.s3 import s3_credentials_source
    from dflash_pipeline.core.storage import open_storage

    assert s3_credentials_source() == "boto's credentials (env)"
    store = open_storage(f"s3://{s3_server.bucket}/aws-only-{uuid.uuid4().hex[:8]}")
    assert store.client.meta.endpoint_url == s3_server.endpoint
    store.ensure_bucket()
    store.write_bytes("a/b.json", b'{"ok": true}')
    assert store.read_bytes("a/b.json") == b'{"ok": true}'
    assert [o.key for o in store.list("a/")] == ["a/b.json"]


def test_sha256_hashes_a_stored_object_as_it_streams(store, monkeypatch):
    """``Storage.sha256`` is what ``verify`` checks records against: the digest of the stored
    bytes, read in chunks (made small here, so that several are read)."""
    import hashlib

    from dflash_pipeline.core import digest, s3

    monkeypatch.setattr(digest, "CHUNK", 1000)
    monkeypatch.setattr(s3, "CHUNK", 1000)
    data = bytes(range(256)) * 20  # 5120 bytes: six chunks
    store.write_bytes("outputs/x.parquet", data)
    assert store.sha256("outputs/x.parquet") == Digest(hashlib.sha256(data).hexdigest(), len(data))
    with pytest.raises(NotFound, match="outputs/missing.parquet does not exist"):
        store.sha256("outputs/missing.parquet")


def test_a_missing_object_is_a_typed_not_found(store):
    with pytest.raises(NotFound, match="does not exist"):
        store.read_bytes("nope/missing.json")
    assert not store.exists("nope/missing.json")


def test_no_access_to_a_bucket_never_creates_one(s3_server, s3_env, monkeypatch):
    from dflash_pipeline.core.storage import StorageError
    from dflash_pipeline.core.s3 import S3Storage

    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_SECRET_KEY", "wrong")
    storage = S3Storage(f"s3://{s3_server.bucket}-other/run")
    with pytest.raises(StorageError, match="no access"):
        storage.ensure_bucket()


def test_copying_a_missing_object_is_a_typed_not_found(store, tmp_path):
    with pytest.raises(NotFound, match="missing.bin does not exist"):
        store.download_file("missing.bin", tmp_path / "out.bin")
    with pytest.raises(NotFound), store.local_copy("missing.bin"):
        pass


def test_storages_of_one_endpoint_share_one_client(s3_server, s3_env):
    from dflash_pipeline.core.storage import open_object, open_storage

    run = open_storage(f"s3://{s3_server.bucket}/run")
    parent, _ = open_object(f"s3://{s3_server.bucket}/run/outputs/x.parquet")
    assert run.client is parent.client  # one connection pool and credential chain per process


def test_an_unreachable_endpoint_is_retried_with_backoff_and_logged(monkeypatch, caplog):
    """Each failed try is in the log (a job's log shows the outage it met), then a
    StorageOutage naming the object, the outage and the endpoint (tests/test_storage_outage.py)."""
    from dflash_pipeline.core.outage import StorageOutage
    from dflash_pipeline.core.s3 import S3Storage
    from tests.support.seaweed import free_port

    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_ACCESS_KEY", "k")
    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_SECRET_KEY", "s")
    monkeypatch.setenv("DFLASH_STORAGE_OUTAGE_TOLERANCE_S", "2")
    store = S3Storage("s3://nowhere/run")
    with caplog.at_level("WARNING", logger="dflash_pipeline.storage"):
        with pytest.raises(StorageOutage, match="s3://nowhere/run/a.json unreachable since .*127.0.0.1"):
            store.write_bytes("a.json", b"{}")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) >= 2, messages
    assert messages[0].startswith(
        "storage s3://nowhere/run/a.json unreachable (PutObject EndpointConnectionError); retry 1 in "
    )
    assert messages[0].endswith(" s, giving up after 2 s of outage")
