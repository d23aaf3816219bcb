"""The driver's planning without repeated work (real snakemake -n runs, counted with Snakemake's
own functions): each rule's fixed script is checked once per plan, scripts named by wildcards job
by job, a missing script is still refused; each job's log paths are expanded once; a rule's fixed
conda environment is expanded once and costs no job its params, while an environment that is a
function is still asked per job; function signatures are read once. Each patch is guarded by the
fingerprints of the functions it replaces."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_pipeline.snakemake_patches.planning import (
    PATCHES,
    _absolute_parts,
    install_planning_patches,
)

REPO = Path(__file__).resolve().parent.parent
JOBS = 20

# Counts calls of Snakemake's own functions: script lookups (snakemake.script.get_source) by
# script; log, params and conda environment expansions by rule.
SNAKEFILE = f"""
import atexit, json, sys
from collections import Counter

sys.path.insert(0, {str(REPO)!r})
from dflash_pipeline.snakemake_patches.planning import install_planning_patches

import snakemake.rules
import snakemake.script

install_planning_patches()
CALLS = Counter()
_get_source = snakemake.script.get_source


def counted_get_source(path, *args, **kwargs):
    CALLS[str(path)] += 1
    return _get_source(path, *args, **kwargs)


snakemake.script.get_source = counted_get_source


def count_rule_method(name):
    method = getattr(snakemake.rules.Rule, name)

    def counted(rule, *args, **kwargs):
        CALLS[f"{{name}} of {{rule.name}}"] += 1
        return method(rule, *args, **kwargs)

    setattr(snakemake.rules.Rule, name, counted)


for name in ("expand_log", "expand_params", "expand_conda_env"):
    count_rule_method(name)
atexit.register(lambda: open("calls.json", "w").write(json.dumps(CALLS)))


rule all:
    input:
        expand("out/fixed-{{i}}.txt", i=range({JOBS})),
        expand("out/named-{{kind}}.txt", kind=["x", "y"]),


rule fixed:
    output:
        "out/fixed-{{i}}.txt",
    log:
        "logs/fixed-{{i}}.log",
    params:
        shard=lambda wildcards: int(wildcards.i),
    conda:
        "envs/fixed.yaml"
    script:
        "scripts/fixed.py"


rule named:
    output:
        "out/named-{{kind}}.txt",
    conda:
        lambda wildcards: f"envs/{{wildcards.kind}}.yaml"
    script:
        "scripts/{{wildcards.kind}}.py"
"""


def dry_run(workdir: Path, **extra_env) -> subprocess.CompletedProcess:
    env = {**os.environ, **extra_env}
    # mtime alone, as the S3 profile plans: no rerun trigger reads params.
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--rerun-triggers", "mtime"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=env,
    )


@pytest.fixture
def workflow(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    for folder in ("scripts", "envs"):
        (tmp_path / folder).mkdir()
    for name in ("fixed", "x", "y"):
        (tmp_path / "scripts" / f"{name}.py").write_text("pass\n")
        (tmp_path / "envs" / f"{name}.yaml").write_text("dependencies: [python]\n")
    return tmp_path


def planning_calls(workflow, **extra_env) -> dict:
    proc = dry_run(workflow, **extra_env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads((workflow / "calls.json").read_text())


def test_planning_does_each_rule_level_thing_once(workflow):
    calls = planning_calls(workflow)
    assert calls.pop("scripts/fixed.py") == 1
    assert calls.pop("scripts/{wildcards.kind}.py") == 2  # a script named per job: checked per job
    assert calls.pop("expand_log of fixed") == JOBS  # once per job: building it into the plan
    assert calls.pop("expand_conda_env of fixed") == 1  # then kept by the rule
    # A job's for that expansion, and the (maybe other) job whose script check formats the path.
    assert calls.pop("expand_params of fixed") <= 2
    assert calls.pop("expand_conda_env of named") == 2  # a function of wildcards: asked per job
    assert calls.pop("expand_params of named") == 2
    assert set(calls) <= {"expand_log of named", "expand_log of all", "expand_params of all", "expand_conda_env of all"}


def test_snakemake_as_it_ships_repeats_them(workflow):
    calls = planning_calls(workflow, DFLASH_PLANNING_PATCHES="0")
    assert calls["scripts/fixed.py"] == JOBS
    assert calls["expand_log of fixed"] == 2 * JOBS  # built into the plan, then checked again
    assert calls["expand_params of fixed"] == JOBS


@pytest.mark.parametrize("missing", ["fixed", "y"])
def test_a_missing_script_is_still_refused(workflow, missing):
    (workflow / "scripts" / f"{missing}.py").unlink()
    proc = dry_run(workflow)
    assert proc.returncode != 0
    # Snakemake's own refusal, naming the file.
    assert f"No such file or directory: '{workflow / 'scripts' / missing}.py'" in proc.stderr + proc.stdout


def test_function_parameters_are_read_once_and_are_snakemakes():
    import snakemake.common
    import snakemake.rules

    assert install_planning_patches() == [p.name for p in PATCHES]

    def input_function(wildcards, input, threads=1):
        return []

    params = snakemake.common.get_function_params(input_function)
    assert params is snakemake.rules.get_function_params(input_function)  # the memo's
    assert list(params.items()) == list(inspect.signature(input_function).parameters.items())
    # Neither hashable nor weakly referenceable (a builtin): answered each time, the same.
    assert list(snakemake.common.get_function_params(divmod)) == list(inspect.signature(divmod).parameters)


@settings(max_examples=300)
@given(st.text(alphabet="ab/.", max_size=12))
def test_path_parts_are_pathlibs(path):
    cwd = "/srv/run"
    assert _absolute_parts(path, cwd) == PurePosixPath(cwd, path).parts


NESTED = """
rule all:
    input:
        "out/x",
        "out/x/y",


rule parent:
    output:
        "out/x",
    shell:
        "touch {output}"


rule child:
    output:
        "out/x/y",
    shell:
        "touch {output}"
"""


def test_an_output_inside_another_is_refused_as_snakemake_refuses_it(tmp_path):
    (tmp_path / "Snakefile").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from dflash_pipeline.snakemake_patches.planning import install_planning_patches\n\n"
        "install_planning_patches()\n" + NESTED
    )
    patched, shipped = dry_run(tmp_path), dry_run(tmp_path, DFLASH_PLANNING_PATCHES="0")
    assert patched.returncode != 0 and shipped.returncode != 0
    refusal = (
        f"File/directory is a child to another output:\n({tmp_path / 'out/x'!r}, parent)\n"
        f"({tmp_path / 'out/x/y'!r}, child)"
    )
    for proc in (patched, shipped):
        assert refusal in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_every_patch_is_written_against_the_installed_functions():
    """The fingerprints pinned in the patches are those of the installed Snakemake, storage
    interface, S3 plugin and Slurm executor plugin: a drift in any of them fails here first (and
    turns exactly that patch off in a run, with a warning)."""
    modules = sorted(p.stem for p in (REPO / "dflash_pipeline/snakemake_patches").glob("[!_]*.py"))
    script = (  # a fresh interpreter: this one's functions may already be the patches
        "import importlib\n"
        "import snakemake.api\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module('dflash_pipeline.snakemake_patches.' + name)\n"
        "    for patch in getattr(module, 'PATCHES', []):\n"
        "        print(patch.name, patch.changed())\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    lines = proc.stdout.splitlines()
    # planning 5, s3_inventory 4, refusals, rerun_checks, slurm_states, execution and storage_outage 1 each.
    assert len(lines) == 14 and all(line.endswith(" []") for line in lines), proc.stdout


def test_a_patch_whose_function_changed_turns_itself_off_with_a_warning():
    """Simulated drift: Snakemake's nested-output check replaced before install. That patch stays
    off, named in one warning; the others are put in place."""
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "import snakemake.api\n"
        "from snakemake.dag import DAG\n"
        "def check_directory_outputs(self):\n"
        "    pass  # a Snakemake release that does this differently\n"
        "DAG.check_directory_outputs = check_directory_outputs\n"
        "from dflash_pipeline.snakemake_patches.planning import install_planning_patches\n"
        "applied = install_planning_patches()\n"
        "print(sorted(applied))\n"
        "print(DAG.check_directory_outputs is check_directory_outputs)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    from dflash_pipeline.snakemake_patches.planning import PATCHES

    names = sorted(p.name for p in PATCHES if p.name != "nested-output check by path parts")
    assert proc.stdout.splitlines() == [repr(names), "True"]
    warnings = [line for line in proc.stderr.splitlines() if "is off" in line]
    assert len(warnings) == 1, proc.stderr
    assert "snakemake patch 'nested-output check by path parts' is off" in warnings[0]
    assert "snakemake.dag:DAG.check_directory_outputs" in warnings[0]
