"""Planning against S3 reads absence from folder listings (a real SeaweedFS, real snakemake -n):
missing objects cost no request of their own, and the plan names exactly their chains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_pipeline.snakemake_patches.s3_inventory import (
    folder_prefix,
    install_folder_inventory,
    parse_query,
    parse_timestamp,
)
from dflash_pipeline.core.s3 import S3Storage
from tests.conftest import parse_job_table
from tests.support.waiting import wait_until

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parent.parent
SHARDS = 40

SNAKEFILE = f"""
import sys

sys.path.insert(0, {str(REPO)!r})
from dflash_pipeline.snakemake_patches.s3_inventory import install_folder_inventory

install_folder_inventory()


rule all:
    input:
        expand("run/outputs/tokenize-{{shard}}.txt", shard=range({SHARDS})),


rule generate:
    output:
        "run/outputs/generate-{{shard}}.txt",
    shell:
        "echo generated > {{output}}"


rule tokenize:
    input:
        "run/outputs/generate-{{shard}}.txt",
    output:
        "run/outputs/tokenize-{{shard}}.txt",
    shell:
        "cat {{input}} > {{output}}"
"""


@pytest.fixture
def finished_run(s3_server, s3_env, tmp_path):
    """Every output of a finished run of 40 shards in one S3 folder, tokenize's objects newer
    than generate's (S3 mtimes have a resolution of one second: tokenize's are written once the
    server's own clock, read from a probe object's mtime, has passed generate's newest)."""
    prefix = f"s3://{s3_server.bucket}/inventory-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ)
    store = S3Storage(prefix)
    for shard in range(SHARDS):
        store.write_bytes(f"run/outputs/generate-{shard}.txt", b"x")
    generated = max(o.mtime for o in store.list("run/outputs/generate-"))

    def server_time() -> float:
        store.write_bytes("clock-probe", b"")
        return store.list("clock-probe")[0].mtime

    wait_until(lambda: server_time() > generated, 60, "the S3 server's clock to pass generate's mtimes")
    store.delete("clock-probe")
    for shard in range(SHARDS):
        store.write_bytes(f"run/outputs/tokenize-{shard}.txt", b"x")
    assert min(o.mtime for o in store.list("run/outputs/tokenize-")) > generated
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    return tmp_path, prefix, store, env


def dry_run(workdir: Path, prefix: str, env: dict, **extra_env) -> tuple[dict, dict]:
    log = workdir / f"requests-{uuid.uuid4().hex[:6]}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--quiet", "rules", "--cores", "1",
         "--default-storage-provider", "s3", "--default-storage-prefix", prefix,
         "--rerun-triggers", "mtime"],
        cwd=workdir, capture_output=True, text=True,
        env={**env, "DFLASH_S3_REQUEST_LOG": str(log), **extra_env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return parse_job_table(proc.stdout + proc.stderr), json.loads(log.read_text())


def test_missing_objects_cost_no_requests_and_the_plan_names_their_chains(finished_run):
    workdir, prefix, store, env = finished_run
    jobs, requests = dry_run(workdir, prefix, env)
    assert jobs == {}, jobs
    assert requests.get("HeadObject", 0) == 0
    for shard in (3, 5, 7):
        store.delete(f"run/outputs/tokenize-{shard}.txt")
    store.delete("run/outputs/generate-7.txt")  # shard 7's whole chain is gone
    jobs, requests = dry_run(workdir, prefix, env)
    assert jobs == {"generate": 1, "tokenize": 3, "all": 1}
    # One folder listing (40 objects fit one page) and one bucket check: nothing per object.
    assert requests.get("HeadObject", 0) == 0
    assert requests.get("ListObjectsV2", 0) + requests.get("ListObjects", 0) <= 2, requests
    # The plugin alone: HeadObject, HeadBucket and a listing for every missing object.
    plain_jobs, plain = dry_run(workdir, prefix, env, DFLASH_S3_FOLDER_INVENTORY="0")
    assert plain_jobs == jobs
    assert plain.get("HeadObject", 0) >= 3, plain


def test_folder_prefix():
    assert folder_prefix("a/b/c.txt") == "a/b/"
    assert folder_prefix("c.txt") == ""


def plugin_split(query: str) -> tuple[str, str] | None:
    """(bucket, key) as the S3 plugin's own __post_init__ derives them (None: invalid query)."""
    import posixpath
    from urllib.parse import urlparse

    from snakemake_storage_plugin_s3 import StorageProvider

    if not StorageProvider.is_valid_query(query):
        return None
    parsed = urlparse(query)
    return parsed.netloc, posixpath.normpath(parsed.path.lstrip("/"))


QUERY_TEXT = st.text(alphabet="ab/.?#;:@%[] \\-_0", max_size=24)


@settings(max_examples=500)
@given(st.one_of(QUERY_TEXT.map(lambda t: "s3://" + t), QUERY_TEXT.map(lambda t: "s3://bkt/" + t), QUERY_TEXT))
def test_the_fast_query_split_agrees_with_the_plugin_or_declines(query):
    fast = parse_query(query)
    if fast is not None:
        assert fast == plugin_split(query)


@settings(max_examples=500)
@given(st.one_of(QUERY_TEXT.map(lambda t: "s3://" + t), QUERY_TEXT.map(lambda t: "s3://bkt/" + t), QUERY_TEXT))
def test_the_patched_query_check_agrees_with_the_plugin(query):
    # The patched check accepts plain queries without urlparse; every query gets the plugin's answer.
    from snakemake_storage_plugin_s3 import StorageProvider

    from dflash_pipeline.snakemake_patches import s3_inventory

    assert install_folder_inventory()
    assert bool(StorageProvider.is_valid_query(query)) == bool(s3_inventory._plugin_valid_query(query))


def test_plain_run_keys_take_the_fast_split():
    query = "s3://bucket/prefix/results/demo/outputs/tokenize-00012.stats.json"
    assert parse_query(query) == ("bucket", "prefix/results/demo/outputs/tokenize-00012.stats.json")
    assert parse_query(query) == plugin_split(query)
    for odd in ("s3://bucket/a//b", "s3://bucket/a/../b", "s3://bucket/a/", "s3://bucket/a?x=1", "s3://b/./a"):
        assert parse_query(odd) is None, odd


def test_memoized_storage_objects_match_the_plugin(monkeypatch):
    # The patched plugin (install_folder_inventory, as the Snakefile installs it) builds objects
    # with the same bucket, key, local suffix, cache key and local path as the plugin's own code.
    from snakemake_storage_plugin_s3 import StorageObject

    assert install_folder_inventory()
    from snakemake_storage_plugin_s3 import StorageProvider

    provider = SimpleNamespace(
        local_prefix=Path(".snakemake/storage/s3"),
        safe_print=lambda q: q,
        is_valid_query=StorageProvider.is_valid_query,
    )
    queries = ["s3://bkt/run/outputs/generate-00001.parquet", "s3://bkt/a//b/../c.txt", "s3://bkt/x"]
    for query in queries * 2:  # the second round comes from the memo
        obj = StorageObject(query=query, keep_local=False, retrieve=True, provider=provider)
        bucket, key = plugin_split(query)
        assert (obj.bucket, obj.key, obj.local_suffix()) == (bucket, key, f"{bucket}/{key}")
        assert obj.cache_key() == str(provider.local_prefix / f"{bucket}/{key}")
        assert obj.local_path() == provider.local_prefix / f"{bucket}/{key}"
        # Its inventory parent: the cache key of its folder.
        folder = key.rpartition("/")[0]
        assert obj.get_inventory_parent() == str(provider.local_prefix / bucket / folder)


@pytest.mark.parametrize(
    "value", ["2026-12-04T17:30:05.000Z", "2026-12-04T17:30:05Z", "Fri, 04 Dec 2026 17:30:05 GMT", "1764869405"]
)
def test_listing_timestamps_parse_to_botocores_datetimes(value):
    from botocore.utils import parse_timestamp as botocore_parse_timestamp

    assert parse_timestamp(value).timestamp() == botocore_parse_timestamp(value).timestamp()
