"""How `make setup` and `make vllm-env` install torch (tools/install_torch.py), without a network:
the pip arguments tried in turn, and the script run against a fake python whose pip records its
arguments and, like a stock PyPI, has no +cpu build until PyTorch's index is named."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "tools" / "install_torch.py"
_spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
it = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(it)

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_configured_indexes_first_then_pytorchs_index_of_the_builds_tag():
    assert it.install_attempts([]) == [
        ["torch==2.13.0+cpu"],
        ["torch==2.13.0+cpu", "--extra-index-url", CPU_INDEX],
    ]
    assert it.install_attempts(["torch==2.11.0+cu130"])[1][-1] == "https://download.pytorch.org/whl/cu130"


def test_torch_index_takes_torch_from_that_index_and_its_dependencies_from_pypi():
    assert it.install_attempts(["torch==2.13.0+cpu"], "https://mirror.example/whl/cpu") == [
        ["torch==2.13.0+cpu", "--index-url", "https://mirror.example/whl/cpu", "--extra-index-url", it.PYPI]
    ]


@pytest.mark.parametrize(
    "words",
    [
        ["torch==2.11.0", "--index-url", "https://download.pytorch.org/whl/cu130"],
        ["torch==2.11.0", "--index-url=https://download.pytorch.org/whl/cu130"],
        ["torch==2.13.0+cpu", "--find-links", "/some/wheels"],
        ["torch==2.13.0"],  # no build tag: no PyTorch index to fall back to
    ],
)
def test_a_requirement_that_names_its_index_or_no_build_is_tried_as_given(words):
    assert it.install_attempts(words) == [words]


FAKE_PYTHON = """#!{python}
# A stand-in for an environment's python: no torch imports; its pip logs its arguments and
# answers as pip does when no index holds the build ({mode}).
import json, os, sys
args = sys.argv[1:]
if args[:1] == ["-c"]:
    sys.exit(0 if os.environ.get("FAKE_TORCH_IMPORTS") else 1)
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
mode = os.environ["FAKE_PIP_MODE"]
if mode == "stock" and "--extra-index-url" not in args and "--index-url" not in args:
    print("ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu")
    print("ERROR: No matching distribution found for torch==2.13.0+cpu")
    sys.exit(1)
if mode == "offline":
    print("ERROR: Could not install packages due to an OSError: connection refused")
    sys.exit(1)
"""


def run_script(tmp_path: Path, mode: str, *words: str, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable, mode=mode))
    python.chmod(0o755)
    log = tmp_path / "pip.log"
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX"}
    environ.update(FAKE_PIP_LOG=str(log), FAKE_PIP_MODE=mode, **env)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--python", str(python), *words], env=environ, capture_output=True, text=True
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def test_a_stock_pip_gets_the_cpu_build_from_pytorchs_index_on_the_second_try(tmp_path):
    proc, calls = run_script(tmp_path, "stock", "torch==2.13.0+cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls == [
        ["-m", "pip", "install", "--quiet", "torch==2.13.0+cpu"],
        ["-m", "pip", "install", "--quiet", "torch==2.13.0+cpu", "--extra-index-url", CPU_INDEX],
    ]
    assert "No matching distribution" in proc.stdout  # pip's own answer is shown, then the retry


def test_a_pip_whose_indexes_hold_the_build_never_contacts_pytorchs_index(tmp_path):
    proc, calls = run_script(tmp_path, "provided")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls == [["-m", "pip", "install", "--quiet", "torch==2.13.0+cpu"]]


def test_any_other_pip_failure_is_reported_not_retried(tmp_path):
    proc, calls = run_script(tmp_path, "offline", "torch==2.13.0+cpu")
    assert proc.returncode == 1 and len(calls) == 1
    assert "connection refused" in proc.stdout


def test_torch_index_from_the_environment_one_try(tmp_path):
    proc, calls = run_script(tmp_path, "stock", "torch==2.13.0+cpu", TORCH_INDEX=CPU_INDEX)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls == [
        ["-m", "pip", "install", "--quiet", "torch==2.13.0+cpu", "--index-url", CPU_INDEX, "--extra-index-url", it.PYPI]
    ]


def test_a_quoted_torch_with_its_own_index_is_split_and_passed_as_given(tmp_path):
    proc, calls = run_script(tmp_path, "provided", "torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130")
    assert calls == [
        ["-m", "pip", "install", "--quiet", "torch==2.11.0", "--index-url", "https://download.pytorch.org/whl/cu130"]
    ]


def test_an_importable_torch_is_never_replaced(tmp_path):
    proc, calls = run_script(tmp_path, "stock", FAKE_TORCH_IMPORTS="1")
    assert proc.returncode == 0 and calls == []
    assert "left as it is" in proc.stdout


def test_make_setup_and_vllm_env_install_torch_through_the_script(tmp_path):
    env = {**os.environ, "TORCH_INDEX": CPU_INDEX}
    setup = subprocess.run(
        ["make", "-n", "setup", f"VENV={tmp_path / 'venv'}"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert setup.returncode == 0, setup.stderr
    assert f"tools/install_torch.py --python {tmp_path / 'venv'}/bin/python torch==2.13.0+cpu" in setup.stdout
    assert '-e ".[model,test]"' in setup.stdout
    gpu = subprocess.run(
        ["make", "-n", "gpu-env", f"VENV={tmp_path / 'gpu'}"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert '-e ".[model,slurm]"' in gpu.stdout and "test" not in gpu.stdout.split("-e ", 1)[1].split("\n")[0]
    vllm = subprocess.run(
        ["make", "-n", "vllm-env", f"VLLM_VENV={tmp_path / 'vllm'}"], cwd=REPO, capture_output=True, text=True
    )
    assert f'tools/install_torch.py --python {tmp_path / "vllm"}/bin/python "torch==2.13.0+cpu"' in vllm.stdout
    assert 'pip install --quiet "torch==2.13.0+cpu"' not in vllm.stdout
