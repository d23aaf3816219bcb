"""Storage credentials kept out of reach of the engines a job starts.

An engine (vLLM, SGLang, ``transformers serve``) runs code this pipeline does not control, as the
same user as the job. Its own environment holds no credentials
(``engines.environments.engine_env``), but Linux lets any process of a user read the environment
another process of that user was started with (``/proc/<pid>/environ``) and its memory
(``/proc/<pid>/mem``): those of the job that launched the engine, of the Snakemake job process
above it and of the driver, each started with the credentials in its environment. Removing them
from ``os.environ`` changes neither.

So a process of ours whose environment holds a credential makes itself non-dumpable (Linux
``prctl(PR_SET_DUMPABLE, 0)``): the kernel then owns its ``/proc/<pid>`` files as root and lets
only a process with ``CAP_SYS_PTRACE`` read its environment or memory. The price, for these
processes only and only while a credential is in their environment: they write no core dump,
and no debugger or profiler (gdb, ``py-spy dump``) attaches to them except as root. The flag
does not pass through ``exec``: an engine, started without credentials, is an ordinary process.

Where: the Snakemake driver and a job's Snakemake process (when they read the Snakefile,
``rules/common.smk``), each job's script process (``core.joblog.job_logging``) and a job that
launches an engine (``engines.launch.ManagedServer.start``), whoever called it. What stays
readable to the user's other processes is outside the pipeline: the shell that exported the
credentials, ``make``, the batch script of a Slurm job, and a ``~/.aws`` credentials file.

Root is the exception: a process running as root reads every root process's ``/proc`` files,
non-dumpable ones too, while it holds ``CAP_SYS_PTRACE``, ``CAP_SYS_ADMIN`` or ``CAP_PERFMON``
(the last two: Linux lets a "perfmon-capable" process read another's memory and environment;
measured on Linux 6.18, where dropping ``CAP_SYS_PTRACE`` alone still let a root child read the
environment of its non-dumpable parent). So a program the pipeline starts but does not control
(an engine, the probe of an engine's environment) is started without those three
(``confine_child``, dropped from its bounding set before ``exec``, so nothing the engine starts
gets them back; engines need none of them). Without them the kernel also refuses it any process
whose capabilities exceed its own (Linux's capability check of ptrace access): every ordinary
root process, the driver, the Snakemake job process and the shell that exported the credentials
included, whether dumpable or not.

Standard library only, and nothing else of the package: a test runs this module as an ordinary
user with the system's Python, which cannot import the package's dependencies.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

# The variables that hold storage credentials (the S3 plugin's and boto's): never shown
# (status page) and never left readable by other processes of the user (this module).
SECRET_ENV_VARS = (
    "SNAKEMAKE_STORAGE_S3_ACCESS_KEY",
    "SNAKEMAKE_STORAGE_S3_SECRET_KEY",
    "SNAKEMAKE_STORAGE_S3_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
CAP_SETPCAP = 8
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
# Each lets a root process read other root processes' environment and memory (see above).
PROCESS_READING_CAPS = (CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_PERFMON)


def _start_environment() -> dict[str, str]:
    """The environment this process was started with, as other processes see it
    (``/proc/self/environ``); {} where there is none to read."""
    try:
        with open("/proc/self/environ", "rb") as src:
            raw = src.read()
    except OSError:
        return {}
    env = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            env[name.decode(errors="replace")] = value.decode(errors="replace")
    return env


def secrets_in_environment(env: dict[str, str] | None = None) -> list[str]:
    """The credential variables set in ``env``; by default in this process's environment now and
    in the one it was started with (still readable after ``os.environ`` dropped them)."""
    envs = [env] if env is not None else [os.environ, _start_environment()]
    return [name for name in SECRET_ENV_VARS if any(e.get(name) for e in envs)]


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def is_dumpable() -> bool | None:
    """Whether other processes of this user may read this one's environment and memory (None
    where the system has no such flag)."""
    prctl = _prctl()
    return None if prctl is None else bool(prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))


def protect_storage_credentials(env: dict[str, str] | None = None) -> bool:
    """Make this process non-dumpable when a storage credential is in its environment (see the
    module's docstring for why, and what else that changes). True when the process is protected
    now; False when there was nothing to protect or the system cannot (a warning says which)."""
    prctl = _prctl()
    if prctl is not None and not prctl(PR_GET_DUMPABLE, 0, 0, 0, 0):
        # Already protected; its start environment is now unreadable to itself as well.
        return True
    secrets = secrets_in_environment(env)
    if not secrets:
        return False
    if prctl is None:
        log.warning(
            "%s is in the environment and %s has no non-dumpable flag: other processes of this "
            "user (an engine) can read it",
            " and ".join(secrets),
            sys.platform,
        )
        return False
    if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning(
            "could not make this process non-dumpable (%s): other processes of this user (an "
            "engine) can read %s from its environment",
            os.strerror(err),
            " and ".join(secrets),
        )
        return False
    return True


def secret_values(env: dict[str, str] | None = None) -> set[str]:
    """The values of the credential variables set in ``env`` (this process's by default): a
    child's environment drops any variable holding one, whatever its name."""
    env = os.environ if env is None else env
    return {env[name] for name in SECRET_ENV_VARS if env.get(name)}


def _effective_capabilities() -> int:
    try:
        with open("/proc/self/status") as src:
            for line in src:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def confinement_problem() -> str | None:
    """Why a child started through ``confine_child`` would keep a capability that reads other
    processes (root without ``CAP_SETPCAP`` to drop it), None when it will not (or this is no
    root)."""
    prctl = _prctl()
    if prctl is None or os.geteuid() != 0:
        return None
    kept = [cap for cap in PROCESS_READING_CAPS if prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1]
    if not kept or _effective_capabilities() & (1 << CAP_SETPCAP):
        return None
    return f"this root process lacks CAP_SETPCAP, so its children keep capabilities {kept}"


def confine_child() -> None:
    """For ``subprocess.Popen(preexec_fn=...)``, run in the child before it execs a program the
    pipeline does not control: as root, drop ``PROCESS_READING_CAPS`` from its bounding set (see
    the module's docstring). Nothing to do for an ordinary user; a failure leaves the child as
    it was (``confinement_problem`` tells the parent beforehand)."""
    if os.geteuid() != 0:
        return
    prctl = _prctl()
    if prctl is not None:
        for cap in PROCESS_READING_CAPS:
            prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL for a capability this kernel lacks
