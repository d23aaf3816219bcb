"""Halts through the workflow: an engine that answers every prompt with an empty think block and
"OK." fails the first tokenize shard's gate, and that stops the run's generation, keep-going or not
(dflash_pipeline.core.jobstate); a training segment that diverges stops the run's training."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from dflash_pipeline.core.jobstate import read_halt
from dflash_pipeline.core.storage import open_storage
from tests.support.seaweed import free_port
from tests.test_verify_workflow import run_verify

pytestmark = pytest.mark.workflow

# One shard generated and failed, the others refused: two of them show it as well as five did.
NUM_SHARDS = 3


def collapsed_answer(prompt: str) -> str:
    """The seed incident's answer: an empty think block and "OK."."""
    return "\n\n</think>\n\nOK."


def worked_answer(prompt: str) -> str:
    """A short sound answer to the few_prompts sums: data that passes the gate, made at once."""
    a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1])
    return f"\n{a} plus {b}: add the ones, then the tens, then the hundreds.\n</think>\n\n{a} + {b} = {a + b}."


class SeedIncidentEndpoint:
    """An OpenAI-compatible /v1/completions server that answers every prompt with ``answer``
    (default: the collapse's "empty think block + OK."), counting the requests it gets."""

    def __init__(self, answer=collapsed_answer):
        self.requests = 0
        lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    endpoint.requests += 1
                opened = body["prompt"].rstrip().endswith("<think>")
                text = ("" if opened else "<think>") + answer(body["prompt"])
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


def test_a_diverging_training_segment_halts_the_run_in_one_line_and_publishes_no_checkpoint(
    workflow, demo_model, tmp_path
):
    """The demo's training with a non-finite loss: segment 0 stops at its first non-finite step,
    says so in one line (step, loss, gradient norm, last good checkpoint), publishes no
    checkpoint, halts the run (no later segment starts, its retries are refused), and `verify`
    finds the run's stored objects intact. A learning rate that diverges is refused when the run
    is planned (train.learning_rate is at most 1; tests/test_training.py trains at 1e12), so the
    loss goes non-finite here by a target with one NaN weight, as a damaged checkpoint has. Data
    from a quick stand-in engine: training is the subject here."""
    target = tmp_path / "target"
    shutil.copytree(demo_model, target)
    weights = load_file(target / "model.safetensors")
    weights["model.layers.0.input_layernorm.weight"][0] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    endpoint = SeedIncidentEndpoint(worked_answer)
    try:
        workflow.write_config(
            num_shards=1,
            until="train",
            dataset={"paths": [workflow.few_prompts(8)], "heldout_fraction": 0.0},
            target={"model": str(target), "build_demo": False},
            gpu_lock_dir=str(tmp_path / "locks"),
            generation={"engine": "endpoint", "endpoints": [endpoint.url], "max_retries": 0},
            train={"steps_per_segment": 4, "checkpoint_every_steps": 2, "batch_size": 2},
        )
        proc = workflow.snakemake(check=False)
    finally:
        endpoint.stop()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    root = workflow.root / "results/demo"
    store = open_storage(str(root))

    assert store.exists("_progress/train/segment-0000/metrics.jsonl"), output[-4000:]
    records = [json.loads(x) for x in store.read_text("_progress/train/segment-0000/metrics.jsonl").splitlines()]
    step = records[-1]["step"]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records[:-1])
    first_attempt = next((root / "logs/attempts/train-0000").glob("*-attempt-1.job.log")).read_text()
    lines = [line for line in first_attempt.splitlines() if "diverged at step" in line]
    assert len(lines) == 1, first_attempt[-3000:]
    assert f"train segment 0000 diverged at step {step}: loss is not finite (loss nan" in lines[0]
    assert "last good checkpoint: none (segment 0 starts from a fresh drafter)" in lines[0]
    assert "Traceback" not in first_attempt

    # Nothing of the diverged state is published, no later segment started, and the run says why.
    assert not store.list("checkpoints/") and not store.list("outputs/train-segment-")
    assert not store.list("_progress/train/segment-0001/")
    halt = read_halt(store)
    assert (halt["stage"], halt["unit"], halt["shard"]) == ("train", "segment", "0000")
    assert f"the run stopped: the run is halted since {halt['halted_at_utc']}: train segment 0000 diverged" in output
    retried = (root / "logs/train/segment-0000.log").read_text()
    assert "train segment 0000 stopped: the run is halted since" in retried

    # Every stored object intact; missing only what the halted training has not made.
    verified = run_verify(workflow).stdout
    assert (
        "8 object(s) match their checksums, 6 missing, 0 damaged, 0 without a checksum record, 0 orphaned" in verified
    )
    missing = sorted(line.split()[1] for line in verified.splitlines() if line.startswith("missing"))
    exported = ("drafter/config.json", "drafter/model.safetensors")
    speculators = ("drafter/speculators/config.json", "drafter/speculators/model.safetensors")
    assert missing == [f"results/demo/{key}" for key in exported + speculators] + [
        f"results/demo/outputs/train-segment-000{k}.json" for k in (0, 1)
    ]
