"""The status server: what the snapshot says about a run, its routes, its read-only nature, and
that credentials never leave it. Runs are built with the pipeline's own writers."""

from __future__ import annotations

import http.client
import json
import logging
import subprocess
import sys
import time
import uuid

import pytest

from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.status.__main__ import parser, resolve_source
from dflash_pipeline.core.storage import ReadOnlyStorage
from dflash_pipeline.status.server import RedactingFilter, Redactor, StatusServer
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder, local_log_path
from dflash_pipeline.core.storage import LocalStorage, open_storage
from tests.support.seaweed import free_port
from tests.support.status_run import RUNNING_LOG, write_run

@pytest.fixture
def local_run(tmp_path):
    root = tmp_path / "results/demo"
    events = write_run(LocalStorage(root), tmp_path)
    return RunSource(ReadOnlyStorage.open(str(root)), num_shards=2, events_file=events, workdir=tmp_path)


def test_snapshot_counts_shards_and_shows_running_failed_training_and_storage(local_run):
    snap = SnapshotBuilder(local_run).build()
    stages = {s["stage"]: s for s in snap["stages"]}
    assert [s["stage"] for s in snap["stages"]] == ["prepare", "generate", "tokenize", "train"]
    assert (stages["prepare"]["done"], stages["prepare"]["percent"]) == (2, 100.0)
    assert {k: stages["generate"][k] for k in ("done", "running", "failed", "missing")} == {
        "done": 1, "running": 1, "failed": 0, "missing": 1 - 1}
    assert stages["generate"]["percent"] == 70.0  # one shard done, the other 4 of 10 samples
    assert {k: stages["tokenize"][k] for k in ("done", "running", "failed", "missing")} == {
        "done": 0, "running": 0, "failed": 1, "missing": 1}
    # Training: segment 0 done, segment 1 at 3 of its 10 steps.
    assert {k: stages["train"][k] for k in ("total", "done", "running", "percent")} == {
        "total": 2, "done": 1, "running": 1, "percent": 65.0}
    assert snap["progress_percent"] == pytest.approx((100 + 70 + 0 + 65) / 4, abs=0.01)
    running, training = snap["running"]
    assert (training["shard"], training["percent"], training["samples_done"]) == ("segment-0001", 30.0, 3)
    assert (running["stage"], running["shard"], running["percent"]) == ("generate", "00001", 40.0)
    assert (running["tokens_per_s"], running["eta_s"]) == (12.5, 6.0)
    assert running["log_tail"] == RUNNING_LOG
    [failed] = snap["failed"]
    assert (failed["rule"], failed["shard"]) == ("tokenize", "00000")
    assert failed["log_tail"][0].startswith("tokenize failed: 87% degenerate")
    assert [p["step"] for p in snap["training"]["curve"]] == [1, 2, 3, 4, 5]
    assert snap["training"]["curve"][-1]["accept_len"] == pytest.approx(1.5)
    assert snap["training"]["algorithm"] == "dflash"  # steps that name none are DFlash
    assert [(s["segment"], s["state"]) for s in snap["training"]["segments"]] == [("0000", "done"), ("0001", "running")]
    assert snap["evaluation"]["tau"] == 2.5 and snap["evaluation"]["prompt_sets"] == {"math": 2.7}
    assert snap["evaluation"]["algorithm"] == "dflash"
    assert snap["storage"]["by_category"]["prepare"] == {"bytes": 200, "objects": 2}
    assert snap["workflow"]["state"] == "running, with failures"
    assert (snap["workflow"]["steps_done"], snap["workflow"]["steps_total"]) == (4, 9)


def test_a_run_that_stops_at_tokenize_is_complete_without_training(tmp_path):
    run = LocalStorage(tmp_path / "run")
    for stage in ("prepare", "generate", "tokenize"):
        run.write_bytes(f"outputs/{stage}-00000.parquet", b"x")
    source = RunSource(ReadOnlyStorage(run), num_shards=1, num_segments=2, until="tokenize")
    snap = SnapshotBuilder(source).build()
    assert [s["stage"] for s in snap["stages"]] == ["prepare", "generate", "tokenize"]
    assert snap["progress_percent"] == 100.0
    source.until = "prepare"
    assert [s["stage"] for s in SnapshotBuilder(source).build()["stages"]] == ["prepare", "generate", "tokenize"]
    (tmp_path / "run2").mkdir()
    source = RunSource(ReadOnlyStorage(LocalStorage(tmp_path / "run2")), num_shards=1, until="prepare")
    assert [s["stage"] for s in SnapshotBuilder(source).build()["stages"]] == ["prepare"]


def test_stale_telemetry_without_a_job_is_not_shown_as_running(tmp_path):
    run = LocalStorage(tmp_path / "run")
    ShardProgress(run, "generate", 0).write_telemetry({"state": "running", "samples_total": 4, "samples_done": 1})
    source = RunSource(ReadOnlyStorage(run), num_shards=1, stale_after_s=0.0)
    snap = SnapshotBuilder(source).build()
    assert snap["running"] == [] and snap["stages"][1]["missing"] == 1


def test_log_names_of_s3_jobs_map_to_snakemakes_local_copies():
    assert local_log_path("s3://b/p/results/demo/logs/generate/00001.log (send to storage)") == (
        ".snakemake/storage/s3/b/p/results/demo/logs/generate/00001.log")
    assert local_log_path("results/demo/logs/x.log") == "results/demo/logs/x.log"


def get(server: StatusServer, path: str, headers=None, method="GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    # http.client sends the path as given: no client-side normalization of ".." segments.
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


@pytest.fixture
def server(local_run):
    srv = StatusServer(SnapshotBuilder(local_run), port=0, refresh_s=0).start()
    yield srv
    srv.stop()


def test_page_assets_and_json_are_served(server):
    status, page = get(server, "/")
    assert status == 200 and b'id="overall-progress"' in page and b"/assets/app.js" in page
    for asset in ("app.js", "style.css"):
        assert get(server, f"/assets/{asset}")[0] == 200
    status, body = get(server, "/api/status")
    assert status == 200 and json.loads(body)["stages"][0]["stage"] == "prepare"


@pytest.mark.parametrize("path", [
    "/../config.yaml", "/assets/../__init__.py", "/assets/..%2f__main__.py", "/assets/%2e%2e/server.py",
    "/assets/", "/assets/index.html/../app.js", "//etc/passwd", "/api/status/../../etc/passwd",
    "/results/demo/outputs/prepare-00000.parquet", "/logs/events.jsonl", "/nope", "/api",
])
def test_path_traversal_and_unknown_routes_get_404(server, path):
    assert get(server, path)[0] == 404


def test_writing_methods_are_refused_and_nothing_is_written(server, local_run, tmp_path):
    before = {(o.key, o.size, o.mtime) for o in LocalStorage(tmp_path).list("")}
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert get(server, "/api/status", method=method)[0] == 405
    for _ in range(3):
        get(server, "/api/status")
        get(server, "/")
    assert {(o.key, o.size, o.mtime) for o in LocalStorage(tmp_path).list("")} == before
    assert not any(hasattr(local_run.storage, name) for name in ("write_bytes", "write_text", "delete", "upload_file"))


def test_beyond_loopback_a_token_is_required(local_run):
    with pytest.raises(ValueError, match="access token"):
        StatusServer(SnapshotBuilder(local_run), host="0.0.0.0", port=0)
    srv = StatusServer(SnapshotBuilder(local_run), port=0, token="tok-3141592653").start()
    try:
        assert get(srv, "/api/status")[0] == 401
        assert get(srv, "/?token=wrong")[0] == 401
        assert get(srv, "/?token=tok-3141592653")[0] == 200
        status, body = get(srv, "/api/status", headers={"Authorization": "Bearer tok-3141592653"})
        assert status == 200 and b"tok-3141592653" not in body
    finally:
        srv.stop()


def test_redactor_blanks_every_secret_of_the_environment():
    redact = Redactor.from_env(env={"SNAKEMAKE_STORAGE_S3_SECRET_KEY": "s3cr3t-value", "AWS_ACCESS_KEY_ID": "AKIAXX"})
    assert redact("key=AKIAXX secret=s3cr3t-value") == "key=[redacted] secret=[redacted]"
    record = logging.makeLogRecord({"msg": "reading %s failed", "args": ("s3://b/k?s3cr3t-value",)})
    assert RedactingFilter(redact).filter(record) and record.getMessage() == "reading s3://b/k?[redacted] failed"


@pytest.mark.s3
def test_s3_run_is_read_without_writes_and_credentials_never_appear(s3_env, s3_server, tmp_path, caplog):
    url = f"s3://{s3_server.bucket}/status-{uuid.uuid4().hex[:8]}/results/demo"
    secret, access = s3_env["SNAKEMAKE_STORAGE_S3_SECRET_KEY"], s3_env["SNAKEMAKE_STORAGE_S3_ACCESS_KEY"]
    # A job log that printed the secret: the page must still not show it.
    events = write_run(open_storage(url), tmp_path, secret_in_log=f"{access}:{secret}")
    before = [(o.key, o.size, o.mtime) for o in open_storage(url).list("")]
    source = RunSource(ReadOnlyStorage.open(url), num_shards=2, events_file=events, workdir=tmp_path)
    srv = StatusServer(SnapshotBuilder(source), port=0, refresh_s=0).start()
    caplog.set_level(logging.INFO)  # the level the server logs at (botocore's DEBUG shows signed headers)
    try:
        bodies = [get(srv, path)[1] for path in ("/", "/api/status", "/assets/app.js", f"/?x={secret}")]
    finally:
        srv.stop()
    snap = json.loads(bodies[1])
    assert snap["run"] == url and snap["stages"][1]["running"] == 1
    assert "[redacted]" in json.dumps(snap["failed"])
    for text in [*(b.decode() for b in bodies), caplog.text]:
        assert secret not in text and access not in text
    assert [(o.key, o.size, o.mtime) for o in open_storage(url).list("")] == before


def test_cli_finds_the_run_from_the_config_and_the_s3_prefix(tmp_path):
    (tmp_path / "config.yaml").write_text("run: r1\nresults_dir: out\nnum_shards: 3\n")
    args = parser().parse_args(["--workdir", str(tmp_path)])
    source = resolve_source(args)
    assert source.storage.url == str(tmp_path / "out/r1") and source.num_shards == 3
    assert source.events_file == tmp_path / "logs/snakemake-events.jsonl"
    args = parser().parse_args(["--workdir", str(tmp_path), "--default-storage-prefix", "s3://b/p"])
    assert resolve_source(args).storage.url == "s3://b/p/out/r1"


def test_start_serves_in_the_background_until_stop(tmp_path):
    (tmp_path / "config.yaml").write_text("run: r1\nnum_shards: 1\n")
    port = free_port()
    cli = [sys.executable, "-m", "dflash_pipeline.status"]
    common = ["--workdir", str(tmp_path), "--port", str(port)]
    started = subprocess.run([*cli, "start", *common], capture_output=True, text=True, timeout=60)
    try:
        assert started.returncode == 0, started.stderr
        assert f"http://127.0.0.1:{port}/" in started.stdout
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/status")
        assert json.loads(conn.getresponse().read())["num_shards"] == 1
        again = subprocess.run([*cli, "start", *common], capture_output=True, text=True, timeout=60)
        assert "already running" in again.stdout
    finally:
        stopped = subprocess.run([*cli, "stop", *common], capture_output=True, text=True, timeout=60)
    assert "Stopped" in stopped.stdout
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/")
        except OSError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the status server still answers after stop")


def test_snapshot_is_rebuilt_in_the_background_and_picks_up_new_shards(tmp_path):
    from dflash_pipeline.status.server import StatusState

    run = LocalStorage(tmp_path / "run")
    state = StatusState(SnapshotBuilder(RunSource(ReadOnlyStorage(run), num_shards=2)), refresh_s=0)
    redact = Redactor([])
    assert json.loads(state.body(redact))["stages"][0]["done"] == 0
    run.write_bytes("outputs/prepare-00001.parquet", b"x")
    deadline = time.monotonic() + 10
    while json.loads(state.body(redact))["stages"][0]["done"] != 1:
        assert time.monotonic() < deadline, "the new shard never showed"
        time.sleep(0.05)
