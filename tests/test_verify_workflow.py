"""A deleted intermediate of a finished run: Snakemake sees nothing to do, `verify` lists it
missing, and `verify --repair` rebuilds exactly that shard's chain (dflash_pipeline.stages.verify)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, parse_job_table
from tests.test_generate_workflow import configure

pytestmark = pytest.mark.workflow


def run_verify(workflow, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.stages.verify", *args],
        cwd=workflow.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )


def test_a_deleted_intermediate_is_found_and_only_its_chain_rebuilt(workflow, demo_model, tmp_path, session_endpoint):
    configure(workflow, demo_model, tmp_path, prompts=12, max_new_tokens=16)
    # Verification and repair are the subject, not the engine's launch.
    workflow.write_config(num_shards=2, **session_endpoint)
    workflow.snakemake()
    outputs = workflow.root / "results/demo/outputs"
    records = workflow.root / "results/demo/_progress/checksums/outputs"
    # The ingest outputs and every shard object of prepare, generate and tokenize carry their
    # job's record, and each reading job checked its input against it.
    recorded = {p.name.removesuffix(".json") for p in records.glob("*.json")}
    expected = ["ingest-prompts.parquet", "ingest-summary.json", "ingest-quarantine.jsonl"]
    expected += [f"{stage}-{shard:05d}.parquet" for stage in ("prepare", "generate") for shard in range(2)] + [
        f"tokenize-{shard:05d}.{ext}" for shard in range(2) for ext in ("parquet", "heldout.parquet", "stats.json")
    ]
    assert recorded == set(expected)
    tokenize_log = (workflow.root / "results/demo/logs/tokenize/00001.log").read_text()
    assert "checksum of results/demo/outputs/generate-00001.parquet verified" in tokenize_log
    clean = run_verify(workflow)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert f"{len(recorded)} object(s) match their checksums" in clean.stdout
    assert clean.stdout.rstrip().endswith("0 missing, 0 damaged, 0 without a checksum record, 0 orphaned")

    (outputs / "generate-00001.parquet").unlink()
    assert workflow.planned_jobs() == {}  # Snakemake: "Nothing to be done"
    found = run_verify(workflow)
    assert found.returncode == 1, found.stdout + found.stderr
    assert "missing   results/demo/outputs/generate-00001.parquet  (made by rule generate (shard 00001)" in found.stdout
    assert "1 missing, 0 damaged, 0 without a checksum record, 0 orphaned" in found.stdout

    untouched = {
        name: (outputs / name).stat().st_mtime_ns
        for name in (
            "prepare-00000.parquet",
            "prepare-00001.parquet",
            "generate-00000.parquet",
            "tokenize-00000.parquet",
        )
    }
    before = (outputs / "tokenize-00001.parquet").stat().st_mtime_ns
    # The repair would take the shard's rows from its reuse copy: one byte changed there must be
    # named and those rows generated again, not rebuilt into a shard with a fresh valid checksum.
    reuse = workflow.root / "results/demo/_progress/reuse/generate-00001.parquet"
    damaged = bytearray(reuse.read_bytes())
    damaged[len(damaged) // 3] ^= 0x01
    reuse.write_bytes(bytes(damaged))
    repaired = run_verify(workflow, "--repair", "--", "--cores", "2")
    output = repaired.stdout + repaired.stderr
    assert repaired.returncode == 0, output
    generate_log = (workflow.root / "results/demo/logs/generate/00001.log").read_text()
    assert "reuse copy results/demo/_progress/reuse/generate-00001.parquet is damaged" in generate_log
    assert "dropped; its rows are generated again" in generate_log
    assert re.search(r"(\d+) prompts, 0 resumed from earlier work, \1 to generate", generate_log), generate_log
    assert "running: " in output and "--forcerun results/demo/outputs/generate-00001.parquet --cores 2" in output
    jobs = parse_job_table(output)
    assert jobs["generate"] == 1 and jobs["tokenize"] == 1 and "prepare" not in jobs, jobs
    assert "shard=00000" not in output
    assert (outputs / "generate-00001.parquet").exists()
    assert (outputs / "tokenize-00001.parquet").stat().st_mtime_ns > before
    assert {name: (outputs / name).stat().st_mtime_ns for name in untouched} == untouched
    assert "after the repair:" in repaired.stdout
    assert repaired.stdout.rstrip().endswith("0 missing, 0 damaged, 0 without a checksum record, 0 orphaned")
    assert workflow.planned_jobs() == {}
