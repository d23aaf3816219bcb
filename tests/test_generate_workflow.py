"""Generation through the workflow with the demo target on `transformers serve` (CPU):
killed mid-shard and rerun, it ends with exactly the prompt set; broken engines fail clearly."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.engines.regenerate import GENERATED_SCHEMA
from tests.support.waiting import wait_until

pytestmark = pytest.mark.workflow

GENERATED = "results/demo/outputs/generate-00000.parquet"
PROMPTS = "results/demo/outputs/prepare-00000.parquet"


# Waits are upper bounds for a loaded machine (two CPU cores shared with other work): a
# `transformers serve` start and the first samples took minutes there. Nothing waits for a time.
SLOW = 600


def configure(workflow, demo_model, tmp_path, prompts: int | None = None, **generation):
    if prompts is not None:
        workflow.write_config(dataset={"paths": [workflow.few_prompts(prompts)]})
    workflow.write_config(
        num_shards=1,
        until="tokenize",
        target={"model": str(demo_model), "build_demo": False},
        gpu_lock_dir=str(tmp_path / "locks"),
        generation={
            "part_every_samples": 4,
            # Parts by count only: a part written by time on a slow machine holds fewer samples.
            "part_every_seconds": 86400,
            "concurrency": 2,
            "max_new_tokens": 96,
            "telemetry_every_seconds": 1,
            **generation,
        },
        # These tests are about generation. The demo's greedy output changes with CPU batching,
        # and a degenerate sample or two is the gate's business (tests/test_tokenize.py).
        tokenize={"max_degenerate_fraction": 0.5},
    )


def start_snakemake(workflow, *args, env=None, output: Path | None = None):
    """Snakemake in the background, its output in ``output`` (or dropped)."""
    run_env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    run_env.update(env or {})
    sink = open(output, "wb") if output else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "2", *args],
            cwd=workflow.root,
            env=run_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the test kills the whole run at once
        )
    finally:
        if output:
            sink.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_sigkilled_generation_resumes_with_exactly_the_prompt_set(where, workflow, demo_model, tmp_path, request):
    # 16 prompts: killed after two parts of 4, the rerun has 8 to generate.
    configure(workflow, demo_model, tmp_path, prompts=16, max_new_tokens=48)
    args, env = (), {}
    run_url = workflow.root / "results/demo"
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        prefix = f"s3://{server.bucket}/gen-{uuid.uuid4().hex[:8]}"
        args = ("--profile", "profiles/s3", "--default-storage-prefix", prefix)
        env = server.env
        request.getfixturevalue("s3_env")
        run_url = f"{prefix}/results/demo"
    progress = ShardProgress(open_storage(run_url), "generate", 0)

    run = start_snakemake(workflow, *args, env=env)
    try:
        wait_until(lambda: len(progress.part_keys()) >= 2, SLOW, "two progress parts")
        pid_files = list((tmp_path / "locks").glob("server-*.pid"))
        assert len(pid_files) == 1
        server_pid = int(pid_files[0].read_text().split()[0])
        os.killpg(run.pid, signal.SIGKILL)  # the job and Snakemake, not the server's own group
        run.wait()
        wait_until(lambda: not pid_alive(server_pid), 60, "the orphaned server to die")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    # What the parts hold, not what they should: every part is 4 samples, none repeated.
    parts = [
        pq.read_table(io.BytesIO(progress.run.read_bytes(key)), schema=GENERATED_SCHEMA) for key in progress.part_keys()
    ]
    saved_ids = [i for part in parts for i in part.column("id").to_pylist()]
    assert len(parts) >= 2 and all(part.num_rows == 4 for part in parts)
    assert len(set(saved_ids)) == len(saved_ids)
    saved = len(saved_ids)

    workflow.snakemake("--unlock", *args, env=env)  # what a user does after a hard kill
    workflow.snakemake(*args, env=env)
    log_text = _read(run_url, "logs/generate/00000.log")
    # The rerun's account (the log may still hold the killed attempt's first).
    attempts = re.findall(r"(\d+) prompts, (\d+) resumed from earlier work, (\d+) to generate", log_text)
    assert attempts, log_text[-2000:]
    total, reused, fresh = map(int, attempts[-1])
    assert reused == saved and fresh == total - saved  # nothing lost, nothing generated twice
    # The engine server's log is kept in the run root, in S3 too (a declared log of the job).
    assert _read(run_url, "logs/generate-engine/00000.log").strip()
    if where == "local":
        generated = pq.read_table(workflow.root / GENERATED)
        prompts = pq.read_table(workflow.root / PROMPTS)
    else:
        store = open_storage(run_url)
        with (
            store.local_copy("outputs/generate-00000.parquet") as g,
            store.local_copy("outputs/prepare-00000.parquet") as p,
        ):
            generated, prompts = pq.read_table(g), pq.read_table(p)
    ids = generated.column("id").to_pylist()
    assert ids == prompts.column("id").to_pylist()  # every prompt, once, in order
    assert len(set(ids)) == len(ids)
    assert all(e is None for e in generated.column("error").to_pylist())
    assert set(saved_ids) <= set(ids)
    rows = generated.to_pylist()
    # Thinking was regenerated (most rows; a degenerate demo sample may have an empty trace).
    assert sum(1 for r in rows if r["messages"][-1]["reasoning_content"]) > 0.5 * len(rows)
    assert progress.part_keys() == []  # parts became the output and are gone
    assert progress.read_telemetry()["state"] == "done"


def _read(run_url, key) -> str:
    return open_storage(run_url).read_text(key)


def test_engine_that_fails_to_start_names_its_log(workflow, demo_model, tmp_path):
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(demo_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    workflow.write_config(
        num_shards=1,
        target={"model": str(broken), "build_demo": False},
        gpu_lock_dir=str(tmp_path / "locks"),
        # The job's own failure is the subject: no Snakemake retry.
        generation={"server": {"startup_timeout_s": 120}, "retries": 0},
    )
    proc = workflow.snakemake(check=False)
    assert proc.returncode != 0
    log_text = (workflow.root / "results/demo/logs/generate/00000.log").read_text()
    # The engine's log lives in the run root's logs (an S3 run uploads it with the job's log).
    assert "see its log results/demo/logs/generate-engine/00000.log" in log_text
    assert (workflow.root / "results/demo/logs/generate-engine/00000.log").is_file()


def test_engine_dying_mid_shard_fails_the_job_and_keeps_finished_parts(workflow, demo_model, tmp_path):
    configure(workflow, demo_model, tmp_path, retries=0)  # a retry would resume and succeed
    progress, job_log = signal_engine_after_a_part(workflow, tmp_path / "locks", signal.SIGKILL)
    assert "the engine process died" in job_log
    assert progress.read_telemetry()["state"] == "failed"


def test_a_hung_engine_stops_the_job_within_hung_after_s_and_keeps_finished_parts(workflow, demo_model, tmp_path):
    """The engine server stopped (SIGSTOP: alive, accepting connections, answering nothing), as a
    deadlocked or stalled engine: its requests would each wait request_timeout_s (1,800 s, kept)
    six times over. The hang watch stops the job after generation.hung_after_s of silence, naming
    the server; the job stops the server it started, the part stays."""
    configure(workflow, demo_model, tmp_path, retries=0, hung_after_s=20)
    _, job_log = signal_engine_after_a_part(workflow, tmp_path / "locks", signal.SIGSTOP)
    said = r"the engine server at http://\S+ has given no healthy answer for \d+ s \(generation.hung_after_s\)"
    assert re.search(said, job_log), job_log[-3000:]
    assert not list((tmp_path / "locks").glob("server-*.pid"))  # stopped by the job, not left hung


def signal_engine_after_a_part(workflow, lock_dir, sig: signal.Signals) -> tuple[ShardProgress, str]:
    """Run the workflow (generate with retries 0), send ``sig`` to shard 0's engine server once a
    progress part is saved: the job fails naming the engine's log, the part stays. Returns the
    shard's progress and the job's log."""
    progress = ShardProgress(open_storage(workflow.root / "results/demo"), "generate", 0)
    run = start_snakemake(workflow)
    try:
        wait_until(lambda: len(progress.part_keys()) >= 1, SLOW, "a progress part")
        pid_file = next(lock_dir.glob("server-*.pid"))
        os.killpg(int(pid_file.read_text().split()[0]), sig)
        assert run.wait(timeout=SLOW) != 0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    job_log = (workflow.root / "results/demo/logs/generate/00000.log").read_text()
    assert "Engine log: results/demo/logs/generate-engine/00000.log" in job_log
    assert len(progress.part_keys()) >= 1
    return progress, job_log


def test_endpoint_that_keeps_failing_stops_the_job_with_a_clear_error(workflow, demo_model, tmp_path):
    from tests.support.seaweed import free_port

    configure(
        workflow,
        demo_model,
        tmp_path,
        engine="endpoint",
        endpoints=[f"http://127.0.0.1:{free_port()}"],
        max_retries=0,
        max_consecutive_failures=3,
        retries=0,
    )
    proc = workflow.snakemake(check=False)
    assert proc.returncode != 0
    log_text = (workflow.root / "results/demo/logs/generate/00000.log").read_text()
    assert "engine unhealthy: 3 requests in a row failed" in log_text
    assert "ConnectError" in log_text


def test_adding_data_regenerates_only_the_new_prompts(workflow, demo_model, tmp_path, session_endpoint):
    import json

    configure(workflow, demo_model, tmp_path, prompts=8, max_new_tokens=48, concurrency=8, part_every_samples=64)
    workflow.write_config(**session_endpoint)  # reuse is the subject, not the engine's launch
    workflow.snakemake()
    before = pq.read_table(workflow.root / GENERATED)
    data = workflow.root / "data/few.jsonl"
    new = [{"id": f"added-{i}", "messages": [{"role": "user", "content": f"What is {i} + 77?"}]} for i in range(3)]
    with open(data, "a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in new))
    workflow.snakemake()
    log_text = (workflow.root / "results/demo/logs/generate/00000.log").read_text()
    assert f"{before.num_rows} resumed from earlier work, 3 to generate" in log_text
    after = pq.read_table(workflow.root / GENERATED)
    assert after.num_rows == before.num_rows + 3
    old = {r["id"]: r for r in before.to_pylist()}
    for row in after.to_pylist():
        if row["id"] in old:
            assert row["messages"] == old[row["id"]]["messages"]  # reused, not regenerated


def job_pids(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (a job's script path in the workflow)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and pid_alive(int(proc.name)):
                found.append(int(proc.name))
    return found


def test_a_job_whose_driver_is_sigkilled_stops_after_its_part_and_the_next_run_resumes(workflow, demo_model, tmp_path):
    """SIGKILL of the Snakemake driver alone (its jobs live on): the generate job finds at its
    next part that the run's lease names a driver that no longer exists, saves and stops; no
    process of the run writes afterwards, and the next driver resumes from the parts."""
    # 16 prompts, parts of 4: the job has parts to write after the driver is gone.
    configure(workflow, demo_model, tmp_path, prompts=16, max_new_tokens=48)
    progress = ShardProgress(open_storage(workflow.root / "results/demo"), "generate", 0)
    run = start_snakemake(workflow)
    marker = f"{workflow.root}/.snakemake/scripts/"
    try:
        wait_until(lambda: len(progress.part_keys()) >= 1, SLOW, "a progress part")
        os.kill(run.pid, signal.SIGKILL)  # the driver only
        run.wait()
        wait_until(lambda: not job_pids(marker), SLOW, "the orphaned generate job to stop")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        for pid in job_pids(marker):
            os.kill(pid, signal.SIGKILL)
    log_text = (workflow.root / "results/demo/logs/generate/00000.log").read_text()
    assert "generate shard 00000 stopped: its driver is gone" in log_text
    assert progress.part_keys()  # what it finished is kept
    # No process of the run is left to write: the job is gone (waited for above), its server too.
    assert not list((tmp_path / "locks").glob("server-*.pid")) or not any(
        pid_alive(int(p.read_text().split()[0])) for p in (tmp_path / "locks").glob("server-*.pid")
    )
    workflow.snakemake("--unlock")
    workflow.snakemake()
    generated = pq.read_table(workflow.root / GENERATED).column("id").to_pylist()
    assert generated == pq.read_table(workflow.root / PROMPTS).column("id").to_pylist()


def test_a_hung_s3_server_during_generate_is_ridden_out(workflow, demo_model, tmp_path, monkeypatch, session_endpoint):
    """SeaweedFS frozen (SIGSTOP, as a stalled gateway: connections are accepted, nothing is
    answered) for 120 s while a generate job writes its parts and the driver beats its lease
    every 2 s, twice botocore's default read timeout (60 s, which the run keeps): requests time
    out and are retried, and writes that timed out land once the server resumes, so their
    retries meet their own writes (412 on the lease). The job's log says so, the driver keeps its lease,
    and the run finishes with every prompt once, without a rerun."""
    from tests.support.seaweed import start_seaweed

    server = start_seaweed(tmp_path / "weed")  # its own server: the session's stays up
    try:
        # 16 prompts: 12 left to generate after the first part, while the server is frozen.
        configure(workflow, demo_model, tmp_path, prompts=16, max_new_tokens=48)
        workflow.write_config(lease={"ttl_s": 8})  # a beat every 2 s: some fall in the freeze
        workflow.write_config(**session_endpoint)  # storage is the subject, not the engine's launch
        prefix = f"s3://{server.bucket}/outage"
        args = ("--profile", "profiles/s3", "--default-storage-prefix", prefix)
        for key, value in server.env.items():  # this test's own reads
            monkeypatch.setenv(key, value)
        run_url = f"{prefix}/results/demo"
        progress = ShardProgress(open_storage(run_url), "generate", 0)
        run = start_snakemake(workflow, *args, env=server.env, output=tmp_path / "driver.log")
        try:
            wait_until(lambda: len(progress.part_keys()) >= 1, SLOW, "a progress part")
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                time.sleep(120)  # the outage itself (a fault injected, not a wait for a result)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            assert run.wait(timeout=2 * SLOW) == 0, (tmp_path / "driver.log").read_text()[-3000:]
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
        assert "was taken over" not in (tmp_path / "driver.log").read_text()
        store = open_storage(run_url)
        job_log = store.read_text("logs/generate/00000.log")
        assert "ReadTimeoutError); retry" in job_log and "giving up after 900 s of outage" in job_log  # met, and said
        # One attempt: the job rode the outage out instead of failing into a retry.
        assert len(re.findall(r"attempt \d+ of this job", job_log)) == 1, job_log[-3000:]
        with (
            store.local_copy("outputs/generate-00000.parquet") as g,
            store.local_copy("outputs/prepare-00000.parquet") as p,
        ):
            ids = pq.read_table(g).column("id").to_pylist()
            assert ids == pq.read_table(p).column("id").to_pylist()
    finally:
        server.stop()
