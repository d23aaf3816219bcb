"""A generate job whose prepare shard was damaged after its record was written fails once, naming
the damaged object, and is not retried: every attempt would read the same bytes and fail alike
(dflash_pipeline.core.checksums.verify_inputs writes the job's refusal,
dflash_pipeline.snakemake_patches.refusals turns it into the job's last attempt). The other
shard's outputs are left as they were. A job run again over outputs it made earlier is refused
before Snakemake removes them (dflash_pipeline.snakemake_patches.rerun_checks), so they stay as
they were too. In a local run folder and in S3."""

from __future__ import annotations

import json
import uuid

import pytest

from dflash_pipeline.core.storage import open_storage
from tests.test_generate_workflow import configure

pytestmark = pytest.mark.workflow

SHARD0 = [
    "outputs/prepare-00000.parquet",
    "outputs/generate-00000.parquet",
    "_progress/checksums/outputs/prepare-00000.parquet.json",
    "_progress/checksums/outputs/generate-00000.parquet.json",
]


def snapshot(store, keys: list[str]) -> dict[str, tuple[bytes, float]]:
    """Each object's stored bytes and listed modification time."""
    mtimes = {o.key: o.mtime for key in keys for o in store.list(key)}
    missing = [key for key in keys if key not in mtimes]
    assert not missing, f"gone from {store.join('')}: {missing}"
    return {key: (store.read_bytes(key), mtimes[key]) for key in keys}


def run_in(where: str, workflow, request) -> tuple[tuple[str, ...], dict, str]:
    """The snakemake arguments, environment and run root of a run ``where`` (local or s3)."""
    if where == "local":
        return (), {}, str(workflow.root / "results/demo")
    server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_env")
    prefix = f"s3://{server.bucket}/refused-{uuid.uuid4().hex[:8]}"
    return ("--profile", "profiles/s3", "--default-storage-prefix", prefix), server.env, f"{prefix}/results/demo"


def flip_a_byte(store, key: str) -> None:
    """A byte flipped in the stored object, after its job recorded its checksum."""
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.write_bytes(key, bytes(data))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_damaged_prepare_shard_fails_its_generate_job_once_and_leaves_the_other_shard(
    where, workflow, demo_model, tmp_path, request, session_endpoint
):
    configure(workflow, demo_model, tmp_path, prompts=4, max_new_tokens=8, retries=2)
    workflow.write_config(num_shards=2, until="generate", **session_endpoint)
    args, env, run_url = run_in(where, workflow, request)
    store = open_storage(run_url)
    # Both prepare shards and shard 0's generation, not shard 1's: the failing job below is then
    # its first run (a rerun would be the same job after Snakemake removed its old output).
    targets = ("results/demo/outputs/generate-00000.parquet", "results/demo/outputs/prepare-00001.parquet")
    workflow.snakemake(*args, *targets, env=env)
    before = snapshot(store, SHARD0)

    flip_a_byte(store, "outputs/prepare-00001.parquet")
    proc = workflow.snakemake(*args, env=env, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output

    # One attempt, although the rule allows two retries: one attempt log, one error, no restart.
    folder = "logs/attempts/generate-00001/"
    attempts = sorted(o.key.rsplit("/", 1)[-1] for o in store.list(folder) if o.key.endswith(".job.log"))
    assert len(attempts) == 1 and attempts[0].endswith("-attempt-1.job.log"), attempts
    assert output.count("Error in rule generate") == 1, output[-6000:]
    assert "Trying to restart job" not in output, output[-6000:]
    # The driver says so only where Snakemake would otherwise have restarted the job.
    assert "refused its damaged input outputs/prepare-00001.parquet: not retried" in output, output[-6000:]

    # The failure names the damaged stored object (not a local copy) and its producer.
    job_log = store.read_text(folder + attempts[0])
    named = f"{run_url}/outputs" if where == "s3" else "results/demo/outputs"  # the run's form of the path
    assert f"{named}/prepare-00001.parquet is damaged" in job_log, job_log[-3000:]
    assert "rule prepare (shard 00001)" in job_log
    refusal = json.loads(store.read_bytes("_progress/checksums/refused/generate-shard=00001.json"))
    assert refusal["input"] == "outputs/prepare-00001.parquet"

    # No output of shard 1's generation, and shard 0's objects and records as they were.
    assert not store.exists("outputs/generate-00001.parquet")
    assert snapshot(store, SHARD0) == before


# Shard 1's generation and what goes with it: the rerun below must leave them as they are.
SHARD1_KEPT = [
    "outputs/generate-00001.parquet",
    "_progress/checksums/outputs/generate-00001.parquet.json",
    "_progress/checksums/outputs/prepare-00001.parquet.json",
    "logs/generate/00001.log",
]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_rerun_refused_for_a_damaged_input_keeps_the_outputs_it_made_before(
    where, workflow, demo_model, tmp_path, request, session_endpoint
):
    configure(workflow, demo_model, tmp_path, prompts=4, max_new_tokens=8, retries=2)
    workflow.write_config(num_shards=2, until="generate", **session_endpoint)
    args, env, run_url = run_in(where, workflow, request)
    store = open_storage(run_url)
    workflow.snakemake(*args, env=env)  # both shards generated
    folder = "logs/attempts/generate-00001/"
    attempts_before = sorted(o.key for o in store.list(folder))
    before = snapshot(store, SHARD0 + SHARD1_KEPT)

    flip_a_byte(store, "outputs/prepare-00001.parquet")
    # Shard 1's generate job runs again. The rewritten prepare shard is newer than the generated
    # one, so Snakemake's mtime trigger alone would rerun it; --forcerun names the job as well, so
    # the rerun does not hang on S3's one-second modification times (a rerun for a changed
    # parameter goes the same way: a job about to run over outputs it made before).
    forced = ("--forcerun", "results/demo/outputs/generate-00001.parquet")
    proc = workflow.snakemake(*args, *forced, env=env, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    # Shard 1's earlier generation, its record and its log as they were; shard 0 untouched.
    assert snapshot(store, SHARD0 + SHARD1_KEPT) == before

    # Refused before it ran: one error, no restart (retries: 2), no new attempt of the job.
    assert output.count("Error in rule generate") == 1, output[-6000:]
    assert "Trying to restart job" not in output, output[-6000:]
    assert "refused its damaged input outputs/prepare-00001.parquet: not retried" in output, output[-6000:]
    assert sorted(o.key for o in store.list(folder)) == attempts_before
    # One line names the damaged stored object (not a local copy), its producer and the repair.
    named = f"{run_url}/outputs" if where == "s3" else "results/demo/outputs"  # the run's form of the path
    (line,) = [x for x in output.splitlines() if f"{named}/prepare-00001.parquet is damaged" in x]
    assert "rule prepare (shard 00001)" in line and "make verify REPAIR=1" in line, line
    assert "outputs/generate-00001.parquet" in line and "kept" in line, line
    refusal = json.loads(store.read_bytes("_progress/checksums/refused/generate-shard=00001.json"))
    assert refusal["input"] == "outputs/prepare-00001.parquet"
    assert refusal["kept_outputs"] == ["outputs/generate-00001.parquet"]

    # Nothing is left marked incomplete: the next plan reads the kept output as any other.
    workflow.snakemake(*args, "--dry-run", env=env)
