"""The workflow stays lint-clean and formatted; the conda env file installs the project's pins."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.demo.prompt_set import demo_rows

REPO = Path(__file__).resolve().parent.parent
PINNED = ("snakemake", "snakemake-storage-plugin-s3", "snakemake-interface-storage-plugins")


def test_snakemake_lint_is_clean():
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


def test_snakefmt_leaves_the_workflow_unchanged():
    snakefmt = Path(sys.executable).parent / "snakefmt"
    files = ["Snakefile", *sorted(str(p.relative_to(REPO)) for p in (REPO / "rules").glob("*.smk"))]
    proc = subprocess.run([snakefmt, "--check", *files], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=" ".join)
def test_ruff_finds_nothing_in_the_python_tree(command):
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([ruff, *command, "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_conda_env_installs_the_pins_of_make_gpu_env():
    # The only env file: the project itself (pyproject.toml pins the workflow stack) on top of the
    # GPU machine's torch requirements, both as make gpu-env installs them, so nothing drifts.
    assert sorted(p.name for p in (REPO / "envs").glob("*.yaml")) == ["pipeline.yaml"]
    env = yaml.safe_load((REPO / "envs" / "pipeline.yaml").read_text())
    assert env["name"] and env["channels"]
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert any(d.startswith("python=") for d in conda) and "pip" in conda
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip == ["-r gpu/pipeline-cu130.txt", "-e ..[model,slurm]"]
    assert (REPO / "envs" / "gpu" / "pipeline-cu130.txt").is_file()
    makefile = (REPO / "Makefile").read_text()
    assert "-r envs/gpu/pipeline-cu130.txt" in makefile and "setup EXTRAS=model,slurm" in makefile
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {f"{name}==" for name in PINNED} <= {re.match(r"[\w-]+==", d).group(0) for d in deps if "==" in d}


def test_every_rule_uses_the_conda_env():
    # snakemake --lint asks every rule for a conda environment or a container.
    for smk in (REPO / "rules").glob("*.smk"):
        for env in re.findall(r'conda:\s*\n(?:\s*#.*\n)*\s*"([^"]+)"', smk.read_text()):
            assert env == "../envs/pipeline.yaml", f"{smk.name}: {env}"


def test_bundled_demo_prompts_are_reproducible_from_their_generator():
    committed = (REPO / "data/demo/prompts.jsonl").read_text().splitlines()
    assert committed == demo_rows()
