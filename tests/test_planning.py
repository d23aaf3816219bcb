"""Snakemake's per-job checks without repeats (real snakemake -n runs): each rule's fixed script is
checked once per plan, scripts named by wildcards job by job, a missing script is still refused,
and each job's log paths are expanded once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
JOBS = 20

# Counts the script lookups of Snakemake's own check (snakemake.script.get_source), by script, and
# the expansions of each rule's log paths (Rule.expand_log).
SNAKEFILE = f"""
import atexit, json, sys
from collections import Counter

sys.path.insert(0, {str(REPO)!r})
from dflash_pipeline.core.planning import install_dag_checks

import snakemake.rules
import snakemake.script

install_dag_checks()
LOOKUPS = Counter()
_get_source = snakemake.script.get_source


def counted_get_source(path, *args, **kwargs):
    LOOKUPS[str(path)] += 1
    return _get_source(path, *args, **kwargs)


snakemake.script.get_source = counted_get_source
_expand_log = snakemake.rules.Rule.expand_log


def counted_expand_log(rule, *args, **kwargs):
    LOOKUPS[f"log of {{rule.name}}"] += 1
    return _expand_log(rule, *args, **kwargs)


snakemake.rules.Rule.expand_log = counted_expand_log
atexit.register(lambda: open("lookups.json", "w").write(json.dumps(LOOKUPS)))


rule all:
    input:
        expand("out/fixed-{{i}}.txt", i=range({JOBS})),
        expand("out/named-{{kind}}.txt", kind=["x", "y"]),


rule fixed:
    output:
        "out/fixed-{{i}}.txt",
    log:
        "logs/fixed-{{i}}.log",
    script:
        "scripts/fixed.py"


rule named:
    output:
        "out/named-{{kind}}.txt",
    script:
        "scripts/{{wildcards.kind}}.py"
"""


def dry_run(workdir: Path, **extra_env) -> subprocess.CompletedProcess:
    env = {**os.environ, **extra_env}
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1"],
                          cwd=workdir, capture_output=True, text=True, env=env)


@pytest.fixture
def workflow(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / "scripts").mkdir()
    for name in ("fixed", "x", "y"):
        (tmp_path / "scripts" / f"{name}.py").write_text("pass\n")
    return tmp_path


def test_a_fixed_script_is_checked_once_named_scripts_per_job_and_logs_expanded_once(workflow):
    proc = dry_run(workflow)
    assert proc.returncode == 0, proc.stderr
    lookups = json.loads((workflow / "lookups.json").read_text())
    assert lookups.pop("log of fixed") == JOBS
    assert lookups == {"scripts/fixed.py": 1, "scripts/{wildcards.kind}.py": 2, "log of named": 2, "log of all": 1}


def test_without_the_patch_every_job_is_checked(workflow):
    proc = dry_run(workflow, DFLASH_PLANNING_PATCHES="0")
    assert proc.returncode == 0, proc.stderr
    lookups = json.loads((workflow / "lookups.json").read_text())
    assert lookups.pop("log of fixed") == 2 * JOBS  # built into the plan, then checked again
    assert lookups == {"scripts/fixed.py": JOBS, "scripts/{wildcards.kind}.py": 2, "log of named": 4, "log of all": 2}


@pytest.mark.parametrize("missing", ["fixed", "y"])
def test_a_missing_script_is_still_refused(workflow, missing):
    (workflow / "scripts" / f"{missing}.py").unlink()
    proc = dry_run(workflow)
    assert proc.returncode != 0
    # Snakemake's own refusal, naming the file.
    assert f"No such file or directory: '{workflow / 'scripts' / missing}.py'" in proc.stderr + proc.stdout


def test_the_collector_is_held_back_while_planning_and_as_usual_after():
    import gc

    from dflash_pipeline.core.planning import PLANNING_GC_THRESHOLDS, collect_as_usual, collect_rarely

    usual = gc.get_threshold()
    try:
        collect_rarely()
        collect_rarely()  # loading the rules twice keeps the usual thresholds to come back to
        assert gc.get_threshold() == PLANNING_GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
        collect_as_usual()
        assert gc.get_threshold() == usual
        collect_as_usual()
        assert gc.get_threshold() == usual
    finally:
        gc.set_threshold(*usual)
        gc.unfreeze()
