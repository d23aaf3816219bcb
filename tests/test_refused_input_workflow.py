"""A generate job whose prepare shard was damaged after its record was written fails once, naming
the damaged object, and is not retried: every attempt would read the same bytes and fail alike
(dflash_pipeline.core.checksums.verify_inputs writes the job's refusal,
dflash_pipeline.snakemake_patches.refusals turns it into the job's last attempt). The other
shard's outputs are left as they were."""

from __future__ import annotations

import json

import pytest

from tests.test_checksums import flip_byte
from tests.test_generate_workflow import configure

pytestmark = pytest.mark.workflow

OUTPUTS = "results/demo/outputs"
RECORDS = "results/demo/_progress/checksums/outputs"


def snapshot(root, names: list[str]) -> dict[str, tuple[bytes, int]]:
    return {name: ((root / name).read_bytes(), (root / name).stat().st_mtime_ns) for name in names}


def test_a_damaged_prepare_shard_fails_its_generate_job_once_and_leaves_the_other_shard(workflow, demo_model, tmp_path):
    configure(workflow, demo_model, tmp_path, prompts=4, max_new_tokens=8, retries=2)
    workflow.write_config(num_shards=2, until="generate")
    # Both prepare shards and shard 0's generation, not shard 1's: the failing job below is then
    # its first run (a rerun would be the same job after Snakemake removed its old output).
    workflow.snakemake(f"{OUTPUTS}/generate-00000.parquet", f"{OUTPUTS}/prepare-00001.parquet")
    shard0 = [
        f"{OUTPUTS}/prepare-00000.parquet",
        f"{OUTPUTS}/generate-00000.parquet",
        f"{RECORDS}/prepare-00000.parquet.json",
        f"{RECORDS}/generate-00000.parquet.json",
    ]
    before = snapshot(workflow.root, shard0)

    damaged = workflow.root / OUTPUTS / "prepare-00001.parquet"
    flip_byte(damaged, damaged.stat().st_size // 2)
    proc = workflow.snakemake(check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output

    # One attempt, although the rule allows two retries: one attempt log, one error, no restart.
    attempts = sorted(p.name for p in (workflow.root / "results/demo/logs/attempts/generate-00001").glob("*.job.log"))
    assert len(attempts) == 1 and attempts[0].endswith("-attempt-1.job.log"), attempts
    assert output.count("Error in rule generate") == 1, output[-6000:]
    assert "Trying to restart job" not in output, output[-6000:]
    # The driver says so only where Snakemake would otherwise have restarted the job.
    assert "refused its damaged input outputs/prepare-00001.parquet: not retried" in output, output[-6000:]

    # The failure names the damaged stored object (not a local copy) and its producer.
    job_log = (workflow.root / "results/demo/logs/attempts/generate-00001" / attempts[0]).read_text()
    assert "results/demo/outputs/prepare-00001.parquet is damaged" in job_log, job_log[-3000:]
    assert "rule prepare (shard 00001)" in job_log
    refusal = json.loads(
        (workflow.root / "results/demo/_progress/checksums/refused/generate-shard=00001.json").read_text()
    )
    assert refusal["input"] == "outputs/prepare-00001.parquet"

    # No output of shard 1's generation, and shard 0's objects and records as they were.
    assert not (workflow.root / OUTPUTS / "generate-00001.parquet").exists()
    assert snapshot(workflow.root, shard0) == before
