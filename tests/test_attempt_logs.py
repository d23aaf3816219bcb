"""Every attempt of a job keeps its job and engine logs (logs/attempts/<job>/ in the run root, in S3
too): Snakemake empties a job's declared logs when it retries it, and a retry must not erase the
failure it retries. The declared engine log bundles the earlier attempts' last lines with its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.core.joblog import ATTEMPTS_DIR, JobAttempt, attempt_of, job_logging
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.engines.launch import ManagedServer, ServerSpec

FIRST, SECOND = "20250102T030405Z", "20250102T031500Z"


def local_logs(store, tmp_path) -> Path:
    """The local folder behind the run root's logs/: the run root's own in a local run,
    elsewhere (Snakemake's local copy) in an S3 run."""
    if store.url.startswith("s3://"):
        return tmp_path / "snakemake-storage/results/demo/logs"
    return Path(store.url) / "logs"


def failed_attempt(store, logs: Path, started: str = FIRST, number: int = 1) -> JobAttempt:
    """An attempt whose engine died: its job log says so, its engine log ends with the death."""
    attempt = JobAttempt(store.url, "generate-00001", number, logs, started=started)
    with pytest.raises(RuntimeError), job_logging(logs / "generate/00001.log", copies=[attempt.local("job")]) as log:
        log.info("1000 prompts, 0 resumed from earlier work, 1000 to generate")
        attempt.local("engine").write_text("INFO server up\n[dflash-pipeline] died: killed by signal SIGKILL\n")
        raise RuntimeError(f"the engine process died. Engine log: {attempt.label(logs / 'generate-engine/00001.log')}")
    return attempt


def test_an_attempt_keeps_its_job_and_engine_logs_in_the_run_root(store, tmp_path):
    logs = local_logs(store, tmp_path)
    attempt = failed_attempt(store, logs)
    attempt.keep()
    name = f"{FIRST}-attempt-1"
    job_log = store.read_text(f"{ATTEMPTS_DIR}/generate-00001/{name}.job.log")
    assert "the engine process died" in job_log and "job failed: the engine process died" in job_log
    assert "killed by signal SIGKILL" in store.read_text(f"{ATTEMPTS_DIR}/generate-00001/{name}.engine.log")
    # The job log of the attempt is the declared one's twin (Snakemake empties that one on a retry).
    assert (logs / "generate/00001.log").read_text() == job_log
    # The message names the attempt's own file, and for S3 its place in the run root.
    own = logs / f"attempts/generate-00001/{name}.engine.log"
    assert f"Engine log: {logs}/generate-engine/00001.log (this attempt's own: {own}" in job_log
    assert (f", in the run root {store.url}/{ATTEMPTS_DIR}/generate-00001/{name}.engine.log)" in job_log) == (
        store.url.startswith("s3://")
    )


def test_a_retry_bundles_the_earlier_attempts_after_its_own_log(store, tmp_path):
    logs = local_logs(store, tmp_path)
    failed_attempt(store, logs).keep()
    retry = JobAttempt(store.url, "generate-00001", 2, logs, started=SECOND)
    retry.local("engine").write_text("INFO server up again\nINFO shard done\n")
    assert retry.earlier() == [f"{FIRST}-attempt-1"]
    retry.keep()
    declared = logs / "generate-engine/00001.log"
    retry.bundle(declared, "engine", "no engine")
    text = declared.read_text()
    first = f"{store.url}/{ATTEMPTS_DIR}/generate-00001/{FIRST}-attempt-1"
    assert text.index(f"last 40 lines of {first}.job.log") < text.index("job failed: the engine process died")
    assert text.index(f"last 40 lines of {first}.engine.log") < text.index("killed by signal SIGKILL")
    assert f"===== this attempt: {SECOND}-attempt-2 (" in text
    assert text.endswith("INFO server up again\nINFO shard done\n")  # this attempt's log, whole, last


def test_a_first_attempt_bundle_is_its_own_log_alone(tmp_path):
    attempt = JobAttempt(tmp_path / "run", "evaluate", 1, tmp_path / "run/logs")
    declared = tmp_path / "run/logs/evaluate-engine.log"
    attempt.bundle(declared, "engine", "no serving engine was launched (evaluate.engine: transformers)")
    assert declared.read_text() == "no serving engine was launched (evaluate.engine: transformers)\n"
    attempt.local("engine").parent.mkdir(parents=True)
    attempt.local("engine").write_text("INFO served")
    attempt.bundle(declared, "engine", "unused")
    assert declared.read_text() == "INFO served\n"


def test_only_the_last_earlier_attempts_are_repeated_and_the_rest_named(tmp_path):
    logs = tmp_path / "run/logs"
    folder = logs / "attempts/generate-00001"
    folder.mkdir(parents=True)
    names = [f"2025010{i}T000000Z-attempt-1" for i in range(1, 8)]
    for name in names:
        (folder / f"{name}.job.log").write_text("\n".join(f"{name} line {k}" for k in range(100)) + "\n")
    attempt = JobAttempt(tmp_path / "run", "generate-00001", 1, logs, started="20250109T000000Z")
    attempt.bundle(logs / "declared.log", "engine", "no engine")
    text = (logs / "declared.log").read_text()
    assert text.startswith("===== 7 earlier attempt(s) of this job")
    assert f"{names[0]}, {names[1]} are not" in text and f"{names[0]} line" not in text
    assert f"{names[2]} line 59\n" not in text and f"{names[2]} line 60\n" in text  # the last 40 lines
    assert f"----- {names[6]}.engine.log: not kept -----" in text


def test_an_attempt_killed_before_it_kept_its_logs_is_kept_by_the_next(s3_env, s3_server, tmp_path):
    """An S3 run's job SIGKILLed (no `finally`): its files stay on this machine, and the next
    attempt copies what the run root lacks."""
    store = open_storage(f"s3://{s3_server.bucket}/unit-{uuid.uuid4().hex[:8]}")
    logs = local_logs(store, tmp_path)
    failed_attempt(store, logs)  # never kept
    assert not store.exists(f"{ATTEMPTS_DIR}/generate-00001/{FIRST}-attempt-1.job.log")
    retry = JobAttempt(store.url, "generate-00001", 2, logs, started=SECOND)
    retry.local("engine").write_text("up\n")
    kept = retry.keep()
    assert sorted(kept) == [
        f"{ATTEMPTS_DIR}/generate-00001/{FIRST}-attempt-1.engine.log",
        f"{ATTEMPTS_DIR}/generate-00001/{FIRST}-attempt-1.job.log",
        f"{ATTEMPTS_DIR}/generate-00001/{SECOND}-attempt-2.engine.log",
    ]
    assert retry.keep() == [f"{ATTEMPTS_DIR}/generate-00001/{SECOND}-attempt-2.engine.log"]  # only its own again


def test_keeping_and_bundling_never_fail_the_job(tmp_path, caplog):
    (tmp_path / "not-a-folder").write_text("")
    attempt = JobAttempt(tmp_path / "not-a-folder", "generate-00001", 1, tmp_path / "logs")
    attempt.local("engine").parent.mkdir(parents=True)
    attempt.local("engine").write_text("INFO up\n")
    assert attempt.keep() == []
    assert "cannot keep" in caplog.text
    attempt.bundle(tmp_path / "logs/generate-engine/00001.log", "engine", "none")
    assert (tmp_path / "logs/generate-engine/00001.log").read_text() == "INFO up\n"


def test_the_attempt_number_is_the_rule_resource():
    assert attempt_of(SimpleNamespace(attempt=3)) == 3
    assert attempt_of(SimpleNamespace()) == 1  # a rule without the resource
    attempt = JobAttempt("run", "evaluate", 2, "run/logs", started=FIRST)
    assert attempt.name == f"{FIRST}-attempt-2"
    assert attempt.key("job") == f"logs/attempts/evaluate/{FIRST}-attempt-2.job.log"
    assert attempt.local("job") == Path(f"run/logs/attempts/evaluate/{FIRST}-attempt-2.job.log")


@pytest.mark.parametrize("kill", [True, False])
def test_the_engine_log_records_how_the_server_ended(tmp_path, kill):
    log = tmp_path / "engine.log"
    log.write_text("INFO serving\n")
    server = ManagedServer(ServerSpec(engine="transformers", model="m", port=9), log, tmp_path)
    server.process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    if kill:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
    server.stop()
    server.stop()  # noted once
    pid = server.process.pid
    end = "died before the job stopped it: killed by signal SIGKILL" if kill else "stopped by the job"
    assert log.read_text().count("[dflash-pipeline]") == 1
    assert f"[dflash-pipeline] transformers server (pid {pid}) {end}" in log.read_text()


# --- through the workflow: the demo target on `transformers serve` (CPU) --------------------------


@pytest.mark.workflow
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_retry_keeps_the_failed_attempts_logs_in_the_run_root(where, workflow, demo_model, tmp_path, request):
    """Generate with `generation.retries: 1`: the engine is SIGKILLed mid-shard, the retry resumes
    from the saved part and succeeds, and the first attempt's job log (with the death) and engine
    log (with its end) are still in the run root, bundled into the declared engine log too."""
    from tests.test_generate_workflow import SLOW, configure, start_snakemake
    from tests.support.waiting import wait_until

    configure(workflow, demo_model, tmp_path, prompts=16, max_new_tokens=32, retries=1)
    args, env, run_url, local_root = (), {}, str(workflow.root / "results/demo"), "results/demo"
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        request.getfixturevalue("s3_env")
        prefix = f"s3://{server.bucket}/attempts-{uuid.uuid4().hex[:8]}"
        args, env = ("--profile", "profiles/s3", "--default-storage-prefix", prefix), server.env
        run_url = f"{prefix}/results/demo"
        # Snakemake's local copy of the run root, where the job writes its logs.
        local_root = f".snakemake/storage/s3/{prefix.removeprefix('s3://')}/results/demo"
    store = open_storage(run_url)
    progress = ShardProgress(store, "generate", 0)
    run = start_snakemake(workflow, *args, env=env)
    try:
        wait_until(lambda: len(progress.part_keys()) >= 1, SLOW, "a progress part")
        pid_file = next((tmp_path / "locks").glob("server-*.pid"))
        os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        assert run.wait(timeout=SLOW) == 0  # the retry resumed and finished the shard
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)

    folder = "logs/attempts/generate-00000/"
    kept = [o.key.rsplit("/", 1)[-1] for o in store.list(folder)]
    names = sorted({k.split(".")[0] for k in kept})
    assert [n.rsplit("-", 1)[-1] for n in names] == ["1", "2"], kept  # Snakemake's attempt numbers
    assert len(kept) == 4, kept  # a job log and an engine log each
    first, second = names
    first_job = store.read_text(f"{folder}{first}.job.log")
    assert "the engine process died" in first_job
    own = f"{local_root}/{folder}{first}.engine.log"
    if where == "s3":
        own += f", in the run root {run_url}/{folder}{first}.engine.log"
    assert f"Engine log: {local_root}/logs/generate-engine/00000.log (this attempt's own: {own})" in first_job
    first_engine = store.read_text(f"{folder}{first}.engine.log")
    assert "died before the job stopped it: killed by signal SIGKILL" in first_engine
    assert len(first_engine.splitlines()) > 2  # the server's own output before it

    # The declared job log ends with the retry's, which resumed from the first attempt's part.
    job_log = store.read_text("logs/generate/00000.log")
    # (An S3 run's declared job log holds the first attempt's too: Snakemake does not empty its
    # local copy for a retry.)
    assert job_log.endswith(store.read_text(f"{folder}{second}.job.log"))
    total, reused, fresh = map(int, re.findall(r"(\d+) prompts, (\d+) resumed from earlier work, (\d+) to generate",
                                               job_log)[-1])  # fmt: skip
    assert total == 16 and reused >= 4 and fresh == total - reused
    assert f"1 earlier attempt(s) of this job, the last {first}" in job_log
    # The declared engine log: the first attempt's last lines, then the retry's whole log.
    engine_log = store.read_text("logs/generate-engine/00000.log")
    assert engine_log.index("the engine process died") < engine_log.index("killed by signal SIGKILL")
    assert engine_log.index(f"===== this attempt: {second} (") > engine_log.index("killed by signal SIGKILL")
    assert engine_log.endswith(store.read_text(f"{folder}{second}.engine.log"))
    with store.local_copy("outputs/generate-00000.parquet") as path:
        generated = pq.read_table(path)
    assert generated.num_rows == 16 and all(e is None for e in generated.column("error").to_pylist())


def test_a_training_attempt_that_failed_keeps_its_log_after_its_retry(store, tmp_path):
    """The train and extract scripts' form (JobAttempt.of + .logging): a failed attempt's job
    log survives the retry that empties the declared log, in the run root (S3 too)."""
    logs = local_logs(store, tmp_path)
    declared = logs / "train/segment-0000.log"

    def smk(number):
        return SimpleNamespace(params=SimpleNamespace(run_url=store.url), resources=SimpleNamespace(attempt=number))

    first = JobAttempt.of(smk(1), "train-0000", declared)
    first.started = FIRST
    assert first.local_logs == logs  # found from the declared log, whatever its depth below logs/
    with pytest.raises(SystemExit), first.logging(declared) as log:
        log.warning("SIGTERM: checkpointed at step 40; exiting")
        raise SystemExit(143)
    declared.write_text("")  # what Snakemake does before the retry
    second = JobAttempt.of(smk(2), "train-0000", declared)
    second.started = SECOND
    with second.logging(declared) as log:
        log.info("segment 0: steps 40..99 from in-segment checkpoint")
    kept = store.read_text(f"{ATTEMPTS_DIR}/train-0000/{FIRST}-attempt-1.job.log")
    assert "checkpointed at step 40" in kept
    text = declared.read_text()
    assert "attempt 2 of this job" in text and f"the last {FIRST}-attempt-1" in text
    assert "steps 40..99" in store.read_text(f"{ATTEMPTS_DIR}/train-0000/{SECOND}-attempt-2.job.log")
