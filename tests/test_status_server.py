"""The status server: what the snapshot says about a run, its routes, its read-only nature, and
that credentials never leave it. Runs are built with the pipeline's own writers."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.status.__main__ import parser, resolve_source
from dflash_pipeline.core.storage import ReadOnlyStorage
from dflash_pipeline.status.events import EventWriter
from dflash_pipeline.status.server import HostPolicy, RedactingFilter, Redactor, StatusServer
from dflash_pipeline.status.events import RunJobBoard
from dflash_pipeline.status.events import local_log_path
from dflash_pipeline.status.snapshot import RunSource, SnapshotBuilder
from dflash_pipeline.core.storage import LocalStorage, open_storage
from tests.support.ci import skip_unless_ci
from tests.support.seaweed import free_port
from tests.support.waiting import wait_until
from tests.support.status_run import RUNNING_LOG, write_run


def built(**config) -> tuple[str, ...]:
    """The stages a run of this config builds, as the CLI hands them to the snapshot."""
    return layout.stages_built(validate_config(config))


@pytest.fixture
def local_run(tmp_path):
    root = tmp_path / "results/demo"
    events = write_run(LocalStorage(root), tmp_path)
    return RunSource(ReadOnlyStorage.open(str(root)), num_shards=2, events_file=events, workdir=tmp_path)


def test_snapshot_counts_shards_and_shows_running_failed_training_and_storage(local_run):
    snap = SnapshotBuilder(local_run).build()
    stages = {s["stage"]: s for s in snap["stages"]}
    assert [s["stage"] for s in snap["stages"]] == ["prepare", "generate", "tokenize", "train", "export", "evaluate"]
    assert (stages["prepare"]["done"], stages["prepare"]["percent"]) == (2, 100.0)
    assert {k: stages["generate"][k] for k in ("done", "running", "failed", "missing")} == {
        "done": 1,
        "running": 1,
        "failed": 0,
        "missing": 1 - 1,
    }
    assert stages["generate"]["percent"] == 70.0  # one shard done, the other 4 of 10 samples
    assert {k: stages["tokenize"][k] for k in ("done", "running", "failed", "missing")} == {
        "done": 0,
        "running": 0,
        "failed": 1,
        "missing": 1,
    }
    # Training: segment 0 done, segment 1 at 3 of its 10 steps.
    assert {k: stages["train"][k] for k in ("total", "done", "running", "percent")} == {
        "total": 2,
        "done": 1,
        "running": 1,
        "percent": 65.0,
    }
    # Export and evaluate wait for the running segment (the evaluation written is an old one).
    assert [(stages[s]["missing"], stages[s]["percent"]) for s in ("export", "evaluate")] == [(1, 0.0), (1, 0.0)]
    assert snap["progress_percent"] == pytest.approx((100 + 70 + 0 + 65 + 0 + 0) / 6, abs=0.01)
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


TUNE_RESULT = {
    "schema": 1, "engine": "vllm", "engine_version": "0.20.1", "device": "1 x NVIDIA H200",
    "created_utc": "2026-12-05T10:00:00Z", "settings": [{}, {}, {}],
    "choice": {"concurrency": 128, "mtp": True, "tokens_per_s_per_gpu": 2345.6, "why": "the best throughput"},
}  # fmt: skip


def test_snapshot_shows_the_engine_settings_tune_measured(local_run, tmp_path):
    assert SnapshotBuilder(local_run).build()["tune"] is None
    LocalStorage(tmp_path / "results/demo").write_text(layout.TUNE_RESULT, json.dumps(TUNE_RESULT))
    assert SnapshotBuilder(local_run).build()["tune"] == {
        "concurrency": 128, "mtp": True, "tokens_per_s_per_gpu": 2345.6, "why": "the best throughput",
        "engine": "0.20.1", "device": "1 x NVIDIA H200", "measured_at_utc": "2026-12-05T10:00:00Z", "settings": 3,
    }  # fmt: skip


def test_a_running_job_without_shards_is_shown_with_its_log(local_run, tmp_path):
    """tune (and ingest, export, evaluate) run without a shard: the page lists them while they
    run, with their log's last lines."""
    (tmp_path / "results/demo/logs/tune.log").write_text("plain, concurrency 64: 2345.6 output tokens/s\n")
    events = EventWriter(local_run.events_file)
    events.write({"event": "job_started", "time": time.time(), "jobids": [9]})
    events.write({"event": "job_info", "time": time.time(), "jobid": 9, "rule": "tune", "wildcards": {},
                  "log": ["results/demo/logs/tune.log", "results/demo/logs/tune-engine.log"], "output": []})  # fmt: skip
    rows = [r for r in SnapshotBuilder(local_run).build()["running"] if r["rule"] == "tune"]
    assert len(rows) == 1 and rows[0]["shard"] is None and rows[0]["stage"] == "tune"
    assert rows[0]["log_tail"] == ["plain, concurrency 64: 2345.6 output tokens/s"]


def test_a_run_that_stops_at_tokenize_is_complete_without_training(tmp_path):
    run = LocalStorage(tmp_path / "run")
    for stage in ("prepare", "generate", "tokenize"):
        run.write_bytes(f"outputs/{stage}-00000.parquet", b"x")
    source = RunSource(ReadOnlyStorage(run), num_shards=1, num_segments=2, stages=built(until="tokenize"))
    snap = SnapshotBuilder(source).build()
    assert [s["stage"] for s in snap["stages"]] == ["prepare", "generate", "tokenize"]
    assert snap["progress_percent"] == 100.0
    source.stages = built(until="prepare")
    assert [s["stage"] for s in SnapshotBuilder(source).build()["stages"]] == ["prepare", "generate", "tokenize"]
    (tmp_path / "run2").mkdir()
    source = RunSource(ReadOnlyStorage(LocalStorage(tmp_path / "run2")), num_shards=1, stages=built(until="prepare"))
    assert [s["stage"] for s in SnapshotBuilder(source).build()["stages"]] == ["prepare"]


def test_an_offline_run_counts_its_extract_shards_before_the_first_exists(tmp_path):
    run = LocalStorage(tmp_path / "run")
    run.write_bytes("outputs/prepare-00000.parquet", b"x")
    offline = built(until="train", train={"mode": "offline"})
    source = RunSource(ReadOnlyStorage(run), num_shards=1, num_segments=2, stages=offline)
    stages = SnapshotBuilder(source).build()["stages"]
    assert [s["stage"] for s in stages] == ["prepare", "generate", "tokenize", "extract", "train"]
    assert stages[3]["missing"] == 1
    source.stages = built(until="train")
    assert "extract" not in [s["stage"] for s in SnapshotBuilder(source).build()["stages"]]


def test_stale_telemetry_without_a_job_is_not_shown_as_running(tmp_path):
    run = LocalStorage(tmp_path / "run")
    ShardProgress(run, "generate", 0).write_telemetry({"state": "running", "samples_total": 4, "samples_done": 1})
    source = RunSource(ReadOnlyStorage(run), num_shards=1, stale_after_s=0.0)
    snap = SnapshotBuilder(source).build()
    assert snap["running"] == [] and snap["stages"][1]["missing"] == 1


def test_log_names_of_s3_jobs_map_to_snakemakes_local_copies():
    assert local_log_path("s3://b/p/results/demo/logs/generate/00001.log (send to storage)") == (
        ".snakemake/storage/s3/b/p/results/demo/logs/generate/00001.log"
    )
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


@pytest.mark.parametrize(
    "path",
    [
        "/../config.yaml",
        "/assets/../__init__.py",
        "/assets/..%2f__main__.py",
        "/assets/%2e%2e/server.py",
        "/assets/",
        "/assets/index.html/../app.js",
        "//etc/passwd",
        "/api/status/../../etc/passwd",
        "/results/demo/outputs/prepare-00000.parquet",
        "/logs/events.jsonl",
        "/nope",
        "/api",
    ],
)
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
    assert source.stages == built()
    assert source.events_file == tmp_path / "logs/snakemake-events.jsonl"
    args = parser().parse_args(["--workdir", str(tmp_path), "--default-storage-prefix", "s3://b/p"])
    assert resolve_source(args).storage.url == "s3://b/p/out/r1"
    (tmp_path / "config.yaml").write_text("until: evaluate\ntrain: {mode: offline}\n")
    args = parser().parse_args(["--workdir", str(tmp_path), "--until", "train"])
    assert resolve_source(args).stages == built(until="train", train={"mode": "offline"})
    args = parser().parse_args(["--run-url", str(tmp_path / "run"), "--num-shards", "1", "--until", "tokenize"])
    assert resolve_source(args).stages == built(until="tokenize")  # no config: a default run's


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
    wait_until(lambda: answers(port) is None, 120, "the status server to stop answering after stop")


def test_snapshot_is_rebuilt_in_the_background_and_picks_up_new_shards(tmp_path):
    from dflash_pipeline.status.server import StatusState

    run = LocalStorage(tmp_path / "run")
    state = StatusState(SnapshotBuilder(RunSource(ReadOnlyStorage(run), num_shards=2)), refresh_s=0)
    redact = Redactor([])
    assert json.loads(state.body(redact))["stages"][0]["done"] == 0
    run.write_bytes("outputs/prepare-00001.parquet", b"x")
    wait_until(lambda: json.loads(state.body(redact))["stages"][0]["done"] == 1, 120, "the new shard to show")


# -- Host header (DNS rebinding) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:{port}",
        "127.0.0.1.evil.example:{port}",
        "localhost.evil.example",
        "[::1]evil",
        "::1",
        "127.0.0.1:80x",
    ],
)
def test_a_foreign_host_header_is_refused_without_data(server, host):
    host = host.format(port=server.port)
    for path in ("/api/status", "/", "/assets/app.js"):
        status, body = get(server, path, headers={"Host": host})
        assert status == 421 and body == b"misdirected request\n", (host, path)
    assert get(server, "/api/status", headers={"Host": host}, method="POST")[0] == 421


@pytest.mark.parametrize(
    "host", ["localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "LOCALHOST", "localhost.:{port}", "127.0.0.1:9999"]
)  # any port: an SSH tunnel
def test_loopback_host_headers_are_answered(server, host):
    status, body = get(server, "/api/status", headers={"Host": host.format(port=server.port)})
    assert status == 200 and json.loads(body)["num_shards"] == 2


def test_with_a_token_a_foreign_host_is_refused_even_with_the_token(local_run):
    srv = StatusServer(SnapshotBuilder(local_run), port=0, token="tok-2718281828").start()
    try:
        auth = {"Authorization": "Bearer tok-2718281828"}
        assert get(srv, "/api/status", headers={**auth, "Host": "evil.example"})[0] == 421
        assert get(srv, "/api/status", headers={**auth, "Host": f"127.0.0.1:{srv.port}"})[0] == 200
        assert get(srv, "/api/status", headers={"Host": f"127.0.0.1:{srv.port}"})[0] == 401
    finally:
        srv.stop()


def test_host_policy_allows_the_bound_address_with_its_port_and_proxy_names():
    bound = HostPolicy("10.1.2.3", 8080, frozenset({"status.internal"}))
    assert bound.allows("10.1.2.3:8080") and bound.allows("10.1.2.3") and bound.allows("localhost:1234")
    assert bound.allows("status.internal:8080") and bound.allows(None)
    assert not bound.allows("10.1.2.3:9090") and not bound.allows("10.9.9.9:8080")
    assert not bound.allows("evil.example:8080") and not bound.allows("status.internal:1")
    assert not bound.allows("") and not bound.allows("10.1.2.3:") and not bound.allows("a:b:c")
    everywhere = HostPolicy("0.0.0.0", 8080)
    assert everywhere.allows("192.168.7.7:8080") and everywhere.allows(f"{socket.gethostname()}:8080")
    assert not everywhere.allows("evil.example:8080")


# -- connections: bounded workers, request timeout ------------------------------------------------


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_half_sent_and_idle_connections_are_closed_by_the_server_and_hold_no_worker(local_run):
    srv = StatusServer(SnapshotBuilder(local_run), port=0, workers=1, request_timeout_s=1.0).start()
    half, idle = [], []
    try:
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.sendall(b"GET /api/status HTTP/1.1\r\nHost: localhost\r\nX-Half: ")
            half.append(sock)
            idle.append(socket.create_connection(("127.0.0.1", srv.port)))
        # The one worker is free for a whole request meanwhile.
        assert get(srv, "/api/status")[0] == 200
        for sock in half + idle:
            # A bound for a hang, far above the 1 s request timeout: recv() times out only if
            # the server never closes the connection.
            sock.settimeout(60)
            answer = read_until_closed(sock)
            assert answer == b"" or answer.startswith(b"HTTP/1.0 408"), answer
            assert b"stages" not in answer
    finally:
        for sock in half + idle:
            sock.close()
        srv.stop()


def test_concurrent_clients_are_answered_by_a_bounded_pool_of_workers(local_run):
    srv = StatusServer(SnapshotBuilder(local_run), port=0, workers=3).start()
    try:
        with ThreadPoolExecutor(30) as pool:
            statuses = list(pool.map(lambda _: get(srv, "/api/status")[0], range(120)))
        assert statuses == [200] * 120
        workers = [t for t in threading.enumerate() if t.name.startswith("status-worker")]
        assert 1 <= len(workers) <= 3
    finally:
        srv.stop()


def test_the_server_listens_with_a_backlog_for_the_pages_clients(local_run):
    srv = StatusServer(SnapshotBuilder(local_run), port=0)
    try:
        # The listening socket's accept queue limit, as the kernel reports it (ss's Send-Q).
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{srv.port}"], capture_output=True, text=True)
        if listening.returncode != 0 or not listening.stdout.strip():
            skip_unless_ci("ss (iproute2) is not available")
        assert int(listening.stdout.split()[2]) >= 128
    finally:
        srv.stop()


# -- the command line: token, pid file, ports -----------------------------------------------------

CLI = [sys.executable, "-m", "dflash_pipeline.status"]


def cli(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else {k: v for k, v in os.environ.items() if k != "DFLASH_STATUS_TOKEN"},
    )


def make_tree(path, shards=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(f"run: r1\nnum_shards: {shards}\n")
    return path


def answers(port: int, headers=None) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/status", headers=headers or {})
        return conn.getresponse().status
    except OSError:
        return None


def wait_until_silent(port: int) -> None:
    wait_until(lambda: answers(port) is None, 120, f"the status server on {port} to stop answering")


def test_the_token_never_reaches_the_background_servers_command_line(tmp_path):
    tree = make_tree(tmp_path / "tree")
    port = free_port()
    token = "tok-" + uuid.uuid4().hex
    env = {**os.environ, "DFLASH_STATUS_TOKEN": token}
    started = cli("start", "--workdir", str(tree), "--port", str(port), env=env)
    try:
        assert started.returncode == 0, started.stderr
        assert token not in started.stdout + started.stderr
        record = json.loads((tree / "logs/status-server.pid").read_text())
        cmdline = open(f"/proc/{record['pid']}/cmdline", "rb").read()
        assert b"dflash_pipeline.status" in cmdline and token.encode() not in cmdline
        assert answers(port) == 401
        assert answers(port, {"Authorization": f"Bearer {token}"}) == 200
    finally:
        stopped = cli("stop", "--workdir", str(tree))
    assert "Stopped" in stopped.stdout
    wait_until_silent(port)


def test_a_token_file_is_read_in_the_foreground_and_must_be_private(tmp_path):
    tree = make_tree(tmp_path / "tree")
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("tok-from-a-file-1234\n")
    token_file.chmod(0o644)
    refused = cli("start", "--workdir", str(tree), "--port", str(port), "--token-file", str(token_file))
    assert refused.returncode == 1 and "chmod 600" in refused.stderr and len(refused.stderr.splitlines()) == 1
    token_file.chmod(0o600)
    started = cli("start", "--workdir", str(tree), "--port", str(port), "--token-file", str(token_file))
    try:
        assert started.returncode == 0, started.stderr
        pid = json.loads((tree / "logs/status-server.pid").read_text())["pid"]
        assert b"tok-from-a-file-1234" not in open(f"/proc/{pid}/cmdline", "rb").read()
        assert answers(port, {"Authorization": "Bearer tok-from-a-file-1234"}) == 200
    finally:
        cli("stop", "--workdir", str(tree))
    wait_until_silent(port)


@pytest.mark.parametrize("action", ["serve", "start"])
def test_a_token_on_the_command_line_is_refused_in_one_line(tmp_path, action):
    tree = make_tree(tmp_path / "tree")
    refused = cli(action, "--workdir", str(tree), "--port", str(free_port()), "--token", "tok-on-argv-99")
    assert refused.returncode != 0
    assert refused.stderr.count("\n") == 1 and "DFLASH_STATUS_TOKEN" in refused.stderr
    assert not (tree / "logs/status-server.pid").exists()


def test_stop_in_a_copied_tree_leaves_the_originals_page_running(tmp_path):
    original = make_tree(tmp_path / "original")
    port = free_port()
    started = cli("start", "--workdir", str(original), "--port", str(port))
    try:
        assert started.returncode == 0, started.stderr
        copy = tmp_path / "copy"
        shutil.copytree(original, copy)  # the pid file too, as `cp -r` of a tree does
        stopped = cli("stop", "--workdir", str(copy))
        assert stopped.returncode == 0 and "left alone" in stopped.stdout
        assert len(stopped.stdout.splitlines()) == 1 and str(original.resolve()) in stopped.stdout
        assert answers(port) == 200
        # Nor does `start` in the copy take the original's page for its own.
        again = cli("start", "--workdir", str(copy), "--port", str(port))
        assert again.returncode == 1 and "taken by another program" in again.stderr
        assert answers(port) == 200
    finally:
        stopped = cli("stop", "--workdir", str(original))
    assert "Stopped" in stopped.stdout
    wait_until_silent(port)


def test_stop_leaves_a_pid_that_is_no_longer_this_trees_status_server_alone(tmp_path):
    tree = make_tree(tmp_path / "tree")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tree / "logs").mkdir()
        for record in (
            f"{other.pid}\n",  # a pid file of an older version: the pid alone
            json.dumps({"pid": other.pid, "workdir": str(tree.resolve()), "port": 1}),
        ):
            (tree / "logs/status-server.pid").write_text(record)
            stopped = cli("stop", "--workdir", str(tree))
            assert stopped.returncode == 0 and "no longer this tree's status page" in stopped.stdout
            assert len(stopped.stdout.splitlines()) == 1
            assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_busy_port_is_one_line_and_exit_1(tmp_path):
    tree = make_tree(tmp_path / "tree")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        for action in ("serve", "start"):
            result = cli(action, "--workdir", str(tree), "--port", str(port))
            assert result.returncode == 1, (action, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
            assert str(port) in result.stderr
    assert not (tree / "logs/status-server.pid").exists()


@pytest.mark.parametrize("port", ["70000", "-1", "eighty"])
def test_an_invalid_port_is_one_line_and_exit_1(tmp_path, port):
    tree = make_tree(tmp_path / "tree")
    for action in ("serve", "start"):
        result = cli(action, "--workdir", str(tree), "--port", port)
        assert result.returncode == 1 and "invalid port" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


# -- the events of the run the page shows ---------------------------------------------------------


def job_events(writer: EventWriter, files: list[tuple[str, str]], ended: bool = True) -> None:
    """One Snakemake run: its jobs (rule, shard, output), started, the first done, the rest running."""
    now = time.time()
    writer.write({"event": "workflow_started", "time": now})
    ids = list(range(1, len(files) + 1))
    writer.write({"event": "job_started", "time": now, "jobids": ids})
    for jobid, (rule, shard, output, log) in zip(ids, files):
        writer.write(
            {
                "event": "job_info",
                "time": now,
                "jobid": jobid,
                "rule": rule,
                "wildcards": {"shard": shard},
                "log": [log],
                "output": [output],
            }
        )
    writer.write({"event": "job_finished", "time": now, "jobid": 1})
    if ended:
        writer.write_closed_marker()


def s3_job(url: str, rule: str, shard: str):
    return (
        rule,
        shard,
        f"{url}/outputs/{rule}-{shard}.parquet (send to storage)",
        f"{url}/logs/{rule}/{shard}.log (send to storage)",
    )


def local_job(root: str, rule: str, shard: str):
    return (rule, shard, f"{root}/outputs/{rule}-{shard}.parquet", f"{root}/logs/{rule}/{shard}.log")


def test_the_board_keeps_only_the_snakemake_runs_of_its_run_root(tmp_path):
    events = tmp_path / "logs/snakemake-events.jsonl"
    writer = EventWriter(events)
    url = "s3://bucket/prefix/results/demo"
    s3 = RunJobBoard(events, url, tmp_path)
    local = RunJobBoard(events, str(tmp_path / "results/demo"), tmp_path)
    # The S3 run's demo model (a local helper) first, then its shards; it is still running.
    job_events(
        writer,
        [
            ("build_demo_model", "", "resources/demo-target", "logs/build_demo_model.log"),
            s3_job(url, "prepare", "00000"),
            s3_job(url, "generate", "00001"),
        ],
        ended=False,
    )
    assert {j.rule for j in s3.refresh().jobs.values()} == {"build_demo_model", "prepare", "generate"}
    assert s3.source == "this run" and s3.run.state == "running"
    assert local.refresh().jobs == {} and local.source == "another run"
    # A local run from the same working directory: the S3 page keeps its run, now ended.
    job_events(writer, [local_job("results/demo", "prepare", "00000")])
    s3_run = s3.refresh()
    assert {j.rule for j in s3_run.jobs.values()} == {"build_demo_model", "prepare", "generate"}
    assert s3_run.ended_at is not None and s3_run.jobs[3].state == "interrupted"
    local_run_events = local.refresh()
    assert [j.rule for j in local_run_events.jobs.values()] == ["prepare"] and local.source == "this run"
    # Another S3 prefix: neither page shows it; a run whose jobs named nothing yet is shown.
    job_events(writer, [s3_job("s3://bucket/other/results/demo", "prepare", "00000")])
    assert s3.refresh() is s3_run and local.refresh() is local_run_events
    writer.write({"event": "workflow_started", "time": time.time()})
    assert s3.refresh().jobs == {} and s3.source == "unknown"


@pytest.mark.s3
def test_the_page_of_an_s3_run_shows_that_runs_events_not_a_local_runs(s3_env, s3_server, tmp_path):
    url = f"s3://{s3_server.bucket}/events-{uuid.uuid4().hex[:8]}/results/demo"
    open_storage(url).write_bytes("outputs/prepare-00000.parquet", b"p")
    (tmp_path / "config.yaml").write_text("run: demo\nnum_shards: 2\n")
    writer = EventWriter(tmp_path / "logs/snakemake-events.jsonl")
    # The S3 run, driven from this checkout: prepare 00000 done, generate 00001 failed.
    job_events(writer, [s3_job(url, "prepare", "00000"), s3_job(url, "generate", "00001")], ended=False)
    writer.write(
        {
            "event": "job_error",
            "time": time.time(),
            "jobid": 2,
            "rule": "generate",
            "log": [s3_job(url, "generate", "00001")[3]],
            "message": "the S3 run's failure",
        }
    )
    writer.write_closed_marker()
    # Then a local run from the same checkout, still running (its page is the local one).
    LocalStorage(tmp_path / "results/demo").write_bytes("outputs/prepare-00000.parquet", b"p")
    job_events(
        writer,
        [local_job("results/demo", "prepare", "00000"), local_job("results/demo", "prepare", "00001")],
        ended=False,
    )
    prefix = url[: -len("/results/demo")]
    args = parser().parse_args(["--workdir", str(tmp_path), "--default-storage-prefix", prefix])
    srv = StatusServer(SnapshotBuilder(resolve_source(args)), port=0).start()
    try:
        snap = json.loads(get(srv, "/api/status")[1])
    finally:
        srv.stop()
    assert snap["run"] == url and snap["workflow"]["events_source"] == "this run"
    assert snap["workflow"]["state"] == "failed"
    assert [(f["stage"], f["shard"], f["message"]) for f in snap["failed"]] == [
        ("generate", "00001", "the S3 run's failure")
    ]
    stages = {s["stage"]: s for s in snap["stages"]}
    assert (stages["prepare"]["done"], stages["prepare"]["running"]) == (1, 0)  # not the local run's
    assert snap["running"] == []
    local_snap = SnapshotBuilder(resolve_source(parser().parse_args(["--workdir", str(tmp_path)]))).build()
    assert local_snap["workflow"]["state"] == "running" and local_snap["failed"] == []
    assert [(r["stage"], r["shard"]) for r in local_snap["running"]] == [("prepare", "00001")]


def test_the_first_request_after_an_idle_spell_gets_a_fresh_snapshot_not_the_old_one():
    from dflash_pipeline.status.server import StatusState

    class CountingBuilder:
        builds = 0

        def build(self):
            CountingBuilder.builds += 1
            return {"build": CountingBuilder.builds}

    state = StatusState(CountingBuilder(), first_wait_s=60)  # a bound for a hang only
    redact = Redactor([])
    assert json.loads(state.body(redact)) == {"build": 1}
    state._built_at -= 9 * 60  # nobody looked for nine minutes
    assert json.loads(state.body(redact)) == {"build": 2}
    # Within the stale bound a due rebuild runs in the background: the request is not held.
    release = threading.Event()
    CountingBuilder.build = lambda self: release.wait(60) and {"build": 3}
    state._built_at -= state.stale_after_s / 2
    assert json.loads(state.body(redact)) == {"build": 2}
    release.set()


def test_a_slow_first_read_of_the_run_holds_no_worker_past_its_wait(tmp_path):
    from dflash_pipeline.status.server import StatusState

    release = threading.Event()

    class SlowBuilder:  # the first listing of a large S3 run
        def build(self):
            release.wait(60)
            return {"run": "r", "generated_at": 0}

    state = StatusState(SlowBuilder(), first_wait_s=0.05)
    placeholder = json.loads(state.body(Redactor([])))
    assert "reading the run for the first time" in placeholder["error"]
    release.set()
    state.first_wait_s = 60  # a bound for a hang only
    assert json.loads(state.body(Redactor([]))) == {"run": "r", "generated_at": 0}


def test_generation_throughput_counts_generate_rows_and_training_its_own(local_run):
    """write_run: generate shard 1 at 12.5 tokens/s while training segment 1 runs at 880."""
    throughput = SnapshotBuilder(local_run).build()["throughput"]
    assert (throughput["tokens_per_s"], throughput["training_tokens_per_s"]) == (12.5, 880.0)


def test_only_a_train_segment_running_shows_no_generation_rate(local_run, tmp_path):
    LocalStorage(tmp_path / "results/demo").write_bytes(layout.shard_key("generate", 1), b"g")
    throughput = SnapshotBuilder(local_run).build()["throughput"]
    assert (throughput["tokens_per_s"], throughput["training_tokens_per_s"]) == (None, 880.0)


def finished_training(run: LocalStorage) -> None:
    """write_run's run with segment 1 done and the drafter exported, older than its evaluation."""
    run.write_text(layout.segment_manifest_key(1), "{}")
    run.write_text(layout.DRAFTER_CONFIG, "{}")
    for key in (layout.segment_manifest_key(0), layout.segment_manifest_key(1), layout.DRAFTER_CONFIG):
        os.utime(run.root / key, (1000.0, 1000.0))


def test_the_bar_stays_below_100_percent_while_evaluate_runs(local_run, tmp_path):
    run = LocalStorage(tmp_path / "results/demo")
    for stage in ("generate", "tokenize"):
        for shard in (0, 1):
            run.write_bytes(layout.shard_key(stage, shard), b"x")
    finished_training(run)
    run.delete(layout.EVAL_METRICS)
    (tmp_path / "results/demo/logs/evaluate.log").write_text("prompt 1 of 8\n")
    events = EventWriter(local_run.events_file)
    events.write({"event": "job_started", "time": time.time(), "jobids": [11]})
    events.write({"event": "job_info", "time": time.time(), "jobid": 11, "rule": "evaluate", "wildcards": {},
                  "log": ["results/demo/logs/evaluate.log"], "output": []})  # fmt: skip
    snap = SnapshotBuilder(local_run).build()
    stages = {s["stage"]: s for s in snap["stages"]}
    assert (stages["export"]["done"], stages["evaluate"]["running"], stages["evaluate"]["percent"]) == (1, 1, 0.0)
    assert snap["progress_percent"] == pytest.approx(100 * 5 / 6, abs=0.01)  # five of six stages done
    events.write({"event": "job_finished", "time": time.time(), "jobid": 11})
    run.write_text(layout.EVAL_METRICS, json.dumps({"overall": {"tau": 3.0}}))
    assert SnapshotBuilder(local_run).build()["progress_percent"] == 100.0


def test_after_a_forced_rerun_the_old_evaluation_and_segments_are_marked_old(local_run, tmp_path):
    """write_run: segment 1 runs again while segment 0 is done, and an evaluation exists."""
    run = LocalStorage(tmp_path / "results/demo")
    # Segment 2 of the earlier run: its manifest and its points are still in the run root.
    run.write_text(layout.segment_manifest_key(2), "{}")
    run.write_text(layout.train_progress_prefix(2) + layout.TRAIN_METRICS, json.dumps({"step": 30, "loss": 0.1}) + "\n")
    source = RunSource(local_run.storage, num_shards=2, num_segments=3, events_file=local_run.events_file,
                       workdir=tmp_path)  # fmt: skip
    snap = SnapshotBuilder(source).build()
    assert snap["evaluation"]["old"] and snap["headline"]["old"]
    rows = {r["key"]: r["text"] for r in snap["headline"]["rows"]}
    assert rows["tau_loop"] == "2.50 (old: from before the rerun)"
    assert [p["step"] for p in snap["training"]["curve"]] == [1, 2, 3, 4, 5]  # not segment 2's step 30
    assert snap["training"]["segments"][2]["state"] == "old, from before the rerun"
    assert {s["stage"]: s["done"] for s in snap["stages"]}["train"] == 1
    # Once training is done again, an evaluation older than the new drafter is still old...
    finished_training(run)
    os.utime(run.root / layout.segment_manifest_key(2), (1000.0, 1000.0))
    os.utime(run.root / layout.EVAL_METRICS, (900.0, 900.0))
    assert SnapshotBuilder(source).build()["headline"]["old"]
    # ...and the one evaluate writes after it is not.
    os.utime(run.root / layout.EVAL_METRICS, (2000.0, 2000.0))
    snap = SnapshotBuilder(source).build()
    assert not snap["headline"]["old"] and not snap["evaluation"]["old"]
    assert {r["key"]: r["text"] for r in snap["headline"]["rows"]}["tau_loop"] == "2.50"


def test_a_job_that_logs_its_steps_gets_a_step_count_and_an_eta(local_run, tmp_path):
    """The demo target's build runs without telemetry and logs its own progress."""
    (tmp_path / "logs/build_demo_model.log").write_text(
        "building the demo target\nstep 20/200, 3m17s elapsed, ~29m36s left\n"
    )
    events = EventWriter(local_run.events_file)
    events.write({"event": "job_started", "time": time.time(), "jobids": [12]})
    events.write({"event": "job_info", "time": time.time(), "jobid": 12, "rule": "build_demo_model",
                  "wildcards": {}, "log": ["logs/build_demo_model.log"], "output": []})  # fmt: skip
    [row] = [r for r in SnapshotBuilder(local_run).build()["running"] if r["rule"] == "build_demo_model"]
    assert (row["samples_done"], row["samples_total"], row["percent"], row["eta_s"]) == (20, 200, 10.0, 1776.0)


def test_the_engines_tau_is_not_configured_where_evaluate_runs_the_transformers_loop(local_run):
    for engine, text in (("transformers", "not configured"), ("vllm", None)):
        source = RunSource(local_run.storage, num_shards=2, events_file=local_run.events_file,
                           workdir=local_run.workdir, evaluate_engine=engine)  # fmt: skip
        rows = {r["key"]: r["text"] for r in SnapshotBuilder(source).build()["headline"]["rows"]}
        assert rows["tau_engine"] == text
