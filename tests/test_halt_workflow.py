"""A collapsed regeneration through the workflow: an engine that answers every prompt with an empty
think block and "OK." fails the first tokenize shard's gate, and that stops the run's generation,
keep-going or not (dflash_pipeline.core.jobstate)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core.jobstate import read_halt
from dflash_pipeline.core.storage import open_storage
from tests.support.seaweed import free_port

pytestmark = pytest.mark.workflow

# One shard generated and failed, the others refused: two of them show it as well as five did.
NUM_SHARDS = 3


class SeedIncidentEndpoint:
    """An OpenAI-compatible /v1/completions server whose every answer is the collapse's
    "empty think block + OK.", counting the requests it gets."""

    def __init__(self):
        self.requests = 0
        lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    endpoint.requests += 1
                opened = body["prompt"].rstrip().endswith("<think>")
                text = ("" if opened else "<think>") + "\n\n</think>\n\nOK."
                reply = json.dumps(
                    {
                        "choices": [{"text": text, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 20, "completion_tokens": 6},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def seed_incident_endpoint():
    endpoint = SeedIncidentEndpoint()
    yield endpoint
    endpoint.stop()


def read_parquet(store, key):
    with store.local_copy(key) as path:
        return pq.read_table(path)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_the_first_failed_gate_stops_every_other_generate_job(
    where, workflow, demo_model, tmp_path, seed_incident_endpoint, request
):
    workflow.write_config(
        num_shards=NUM_SHARDS,
        until="tokenize",
        target={"model": str(demo_model), "build_demo": False},
        gpu_lock_dir=str(tmp_path / "locks"),
        generation={
            "engine": "endpoint",
            "endpoints": [seed_incident_endpoint.url],
            "concurrency": 4,
            "part_every_samples": 4,
            "max_retries": 0,
        },
    )
    # One job at a time, so "in flight" is well defined; keep-going from the profile, as in a
    # real run: it must not let the other shards generate.
    args, env = ("--profile", "profiles/local"), {}
    run_url = str(workflow.root / "results/demo")
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        prefix = f"s3://{server.bucket}/halt-{uuid.uuid4().hex[:8]}"
        args = ("--profile", "profiles/s3", "--default-storage-prefix", prefix)
        env = server.env
        request.getfixturevalue("s3_env")
        run_url = f"{prefix}/results/demo"
    proc = workflow.snakemake(*args, "--cores", "1", env=env, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    store = open_storage(run_url)

    # Exactly one shard was generated: the one whose gate failed; nothing was in flight beside it.
    generated = [o.key for o in store.list("outputs/generate-") if o.key.endswith(".parquet")]
    assert len(generated) == 1, (generated, output[-3000:])
    first = re.search(r"generate-(\d{5})\.parquet", generated[0])[1]
    halt = read_halt(store)
    assert halt["stage"] == "tokenize" and halt["shard"] == first
    assert halt["cause"].startswith("failed the data-quality gate: ")
    assert "most common response" in halt["cause"] and "OK." in halt["cause"]
    # The endpoint answered that shard's turns and no other request.
    table = read_parquet(store, generated[0])
    assert seed_incident_endpoint.requests == sum(len(t) for t in table.column("turns").to_pylist()) > 0
    assert not store.list("outputs/tokenize-")

    # Every other generate job was refused before it started, naming the cause and the fix.
    logs = {shard: store.read_text(f"logs/generate/{shard}.log") for shard in (f"{i:05d}" for i in range(NUM_SHARDS))}
    assert sum("to generate" in text for text in logs.values()) == 1 and "to generate" in logs[first]
    for shard, text in logs.items():
        if shard != first:
            assert f"generate shard {shard} stopped: the run is halted since" in text
            assert f"tokenize shard {first} failed the data-quality gate" in text
            assert "clear-halt --run-url" in text
    assert "halting the run" in store.read_text(f"logs/tokenize/{first}.log")
    # Snakemake's own output ends with the cause.
    assert "the run stopped: the run is halted since" in output
    assert f"tokenize shard {first} failed the data-quality gate" in output

    # Cleared by the explicit command, found from the config the way Snakemake finds the run.
    clear = [sys.executable, "-m", "dflash_pipeline.stages.tokenize", "clear-halt"]
    if where == "s3":
        clear += ["--default-storage-prefix", prefix]
    done = subprocess.run(clear, cwd=workflow.root, capture_output=True, text=True, check=True)
    assert f"cleared the halt of tokenize shard {first}" in done.stdout
    assert read_halt(store) is None
    plan = workflow.planned_jobs(*args, env=env)
    assert plan["generate"] == NUM_SHARDS - 1 and plan["tokenize"] == NUM_SHARDS
