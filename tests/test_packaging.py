"""The package works installed, not only from its checkout: a non-editable `pip install` of a copy
of the project into a fresh environment imports every module and loads the config schema (package
data) from a folder that is not the checkout, and its console script plans a run from the folder
of the run's config and data. Nothing is downloaded: --no-deps and
--no-build-isolation, the dependencies and setuptools from the running environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import venv
from pathlib import Path


from tests.conftest import REPO

# What the build reads: the project file, its readme and the packages it finds.
BUILD_FILES = ["pyproject.toml", "README.md", "dflash_pipeline", "snakemake_logger_plugin_dflash"]

CHECK = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import dflash_pipeline, snakemake_logger_plugin_dflash
    from dflash_pipeline.core.config import SCHEMA_PATH, load_schema, validate_config
    names = [m.name for m in pkgutil.walk_packages(dflash_pipeline.__path__, "dflash_pipeline.")]
    for name in names:
        importlib.import_module(name)
    print(json.dumps({
        "package": dflash_pipeline.__file__,
        "plugin": snakemake_logger_plugin_dflash.__file__,
        "modules": names,
        "schema": str(SCHEMA_PATH),
        "sections": sorted(load_schema()["properties"]),
        "default_run": validate_config({})["run"],
    }))
    """
)


def test_a_non_editable_install_imports_every_module_and_loads_the_schema(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in BUILD_FILES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    env = tmp_path / "env"
    # --system-site-packages reaches the base interpreter's packages, not a virtualenv's: a .pth
    # file adds the running environment's (a plain path line, so its own .pth files, such as the
    # checkout's editable install, are not read and the checkout stays off sys.path).
    # No pip of its own (Python 3.11's ensurepip would bring an old setuptools, before the running
    # environment's on sys.path): the running environment's pip installs into it (--python).
    venv.create(env, system_site_packages=True, with_pip=False)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "zz_running_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--no-index", str(source)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The installed copy alone: a PYTHONPATH naming the checkout (as developers run the tests)
    # would put the checkout's package first.
    clean_env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run([python, "-c", CHECK], capture_output=True, text=True, cwd=elsewhere, env=clean_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("package", "plugin", "schema"):
        assert Path(result[key]).is_relative_to(site), (key, result[key])
    assert result["schema"].endswith("dflash_pipeline/config/schema.yaml")
    assert {"dataset", "train", "evaluate"} <= set(result["sections"])
    assert result["default_run"]
    expected = {p.stem for p in (REPO / "dflash_pipeline" / "stages").glob("*.py")} - {"__init__"}
    assert {f"dflash_pipeline.stages.{name}" for name in expected} <= set(result["modules"])

    # The console script, from a folder that is not the checkout: its commands.
    usage = subprocess.run(
        [env / "bin" / "dflash-pipeline"], capture_output=True, text=True, cwd=elsewhere, env=clean_env
    )
    assert usage.returncode == 0 and "  plan " in usage.stdout and "  clear-halt " in usage.stdout, usage

    # Its plan of a run whose config and data sit in that folder, as a user's would: relative
    # paths from the working directory (as Snakemake reads them), no checkout's benchmark records.
    shutil.copy2(REPO / "config.yaml", elsewhere / "config.yaml")
    dataset = elsewhere / "data" / "demo" / "prompts.jsonl"
    dataset.parent.mkdir(parents=True)
    dataset.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Add {i} and 1."}], "id": f"p{i}"}) + "\n"
            for i in range(3)
        )
    )
    plan = subprocess.run(
        [env / "bin" / "dflash-pipeline", "plan", "--configfile", "config.yaml"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=clean_env,
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert plan.stdout.startswith("Plan of run 'demo'") and "prompts            3  (counted" in plan.stdout, plan.stdout
    assert not plan.stderr, plan.stderr

    # The status page's assets ship too (package data since before).
    assets = {p.name for p in (REPO / "dflash_pipeline" / "status" / "assets").iterdir()}
    assert assets and assets <= {p.name for p in (site / "dflash_pipeline" / "status" / "assets").iterdir()}


def test_no_engine_extra_and_gpu_env_extras_carry_no_test_tooling():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any("sglang" in dep or "vllm" in dep for deps in extras.values() for dep in deps)
    assert not any(dep.startswith(("pytest", "hypothesis", "ruff", "selenium")) for dep in extras["slurm"])
    assert "dflash-pipeline[slurm]" in extras["test"]  # the tests plan the SLURM profile
