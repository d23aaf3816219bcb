"""The workflow stays lint-clean and formatted; conda env files are valid and pinned alike."""

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


def project_pins() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(re.match(r"([\w-]+)==([\w.]+)", d).groups() for d in deps if "==" in d)
    assert set(PINNED) <= set(pins)
    return pins


@pytest.mark.parametrize("env_file", sorted((REPO / "envs").glob("*.yaml")), ids=lambda p: p.name)
def test_conda_env_files_are_valid_and_pin_the_workflow_stack_like_pyproject(env_file):
    env = yaml.safe_load(env_file.read_text())
    assert env["name"] and env["channels"]
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert any(d.startswith("python=") for d in conda) and "pip" in conda
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = project_pins()
    for name in PINNED:
        assert f"{name}=={pins[name]}" in pip, f"{env_file.name}: {name} not pinned to {pins[name]}"


def test_every_rule_uses_a_conda_env_that_exists():
    for smk in (REPO / "rules").glob("*.smk"):
        for env in re.findall(r'conda:\s*\n\s*"([^"]+)"', smk.read_text()):
            assert (smk.parent / env).resolve().is_file(), f"{smk.name}: {env}"


def test_bundled_demo_prompts_are_reproducible_from_their_generator():
    committed = (REPO / "data/demo/prompts.jsonl").read_text().splitlines()
    assert committed == demo_rows()
