"""Launch an inference server for a generation job, and make sure it dies with the job.

The job starts the server in its own process group with a parent-death signal (Linux
``PR_SET_PDEATHSIG``), so a SIGKILLed job takes its server down with it; a pid file per port lets a
restarted job reap a leftover that still holds the port. The server's output goes to a log file
that every error message names. The server gets no storage credentials, and a job that holds
them makes itself non-dumpable before it starts one, so the server cannot read them from the job's
``/proc/<pid>/environ`` either; as root the server starts without the capabilities that read
other processes (``CAP_SYS_PTRACE`` and the like), which leaves it no other root process's
``/proc`` files (``dflash_pipeline.core.credentials``).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dflash_pipeline.core.credentials import confine_child, confinement_problem, protect_storage_credentials
from dflash_pipeline.engines.client import HEALTH_PATH, EngineError
from dflash_pipeline.engines.environments import engine_env, engine_python, server_module_command

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


@dataclass
class ServerSpec:
    """What to launch: built from the ``generation`` config section."""

    engine: str  # sglang | vllm | transformers
    model: str
    port: int
    host: str = "127.0.0.1"
    tp: int = 1
    dp: int = 1
    mem_fraction: float | None = None
    reasoning_parser: str | None = None
    speculative: dict = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    # The engine's own interpreter (engines.<engine>.python) and its process environment
    # (engines.<engine>.env over this process's, storage credentials withheld).
    python: str | None = None
    env: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def from_config(cls, engine: str, model: str, port: int, server: dict, engines: dict | None = None) -> ServerSpec:
        """From the `generation.server` config section and the `engines` section."""
        keys = ("tp", "dp", "mem_fraction", "reasoning_parser", "speculative", "extra_args")
        return cls(
            engine=engine,
            model=model,
            port=port,
            python=engine_python(engine, engines),
            env=engine_env(engine, engines),
            **{k: server[k] for k in keys},
        )

    def interpreter(self) -> str:
        """The Python that runs the engine: the spec's, else the configured default."""
        return self.python or engine_python(self.engine, None)

    def speculative_settings(self) -> dict:
        """The speculative-decoding settings that are set, or {} when it is off."""
        settings = {k: v for k, v in self.speculative.items() if v is not None}
        return settings if settings.get("algorithm") else {}


# Each engine's spelling of the flags both servers take: model, tensor and data parallel sizes,
# the GPU memory share.
SERVER_FLAGS = {
    "sglang": ("--model-path", "--tp-size", "--dp-size", "--mem-fraction-static"),
    "vllm": ("--model", "--tensor-parallel-size", "--data-parallel-size", "--gpu-memory-utilization"),
}


def server_base_command(spec: ServerSpec, engine: str) -> list[str]:
    model, tp, dp, mem = SERVER_FLAGS[engine]
    cmd = server_module_command(spec.interpreter(), engine) + [model, spec.model]
    cmd += ["--host", spec.host, "--port", str(spec.port), tp, str(spec.tp), dp, str(spec.dp)]
    if spec.mem_fraction is not None:
        cmd += [mem, str(spec.mem_fraction)]
    if spec.reasoning_parser:
        cmd += ["--reasoning-parser", spec.reasoning_parser]
    return cmd


def sglang_command(spec: ServerSpec) -> list[str]:
    cmd = server_base_command(spec, "sglang")
    spec_cfg = spec.speculative_settings()
    if spec_cfg:
        cmd += ["--speculative-algorithm", spec_cfg["algorithm"]]
        for key, flag in (
            ("num_steps", "--speculative-num-steps"),
            ("eagle_topk", "--speculative-eagle-topk"),
            ("num_draft_tokens", "--speculative-num-draft-tokens"),
            ("draft_model", "--speculative-draft-model-path"),
        ):
            if key in spec_cfg:
                cmd += [flag, str(spec_cfg[key])]
    return cmd + list(spec.extra_args)


def vllm_command(spec: ServerSpec) -> list[str]:
    cmd = server_base_command(spec, "vllm")
    spec_cfg = spec.speculative_settings()
    if spec_cfg:
        cmd += ["--speculative-config", json.dumps(vllm_speculative_config(spec_cfg))]
    return cmd + list(spec.extra_args)


VLLM_METHODS = {"NEXTN": "mtp", "EAGLE": "eagle", "EAGLE3": "eagle3", "DFLASH": "dflash"}


def vllm_speculative_config(spec_cfg: dict) -> dict:
    """vLLM's ``--speculative-config`` for the SGLang-named settings of the config.

    ``num_speculative_tokens`` is the number of drafted tokens per step: SGLang's ``num_steps``
    for chain drafters (EAGLE, MTP). DFlash drafts a whole block in one step: the anchor plus
    B - 1 mask slots, and SGLang's ``num_draft_tokens`` is B, so vLLM gets B - 1 (vLLM 0.20.1
    ``DFlashProposer``: 1 + num_speculative_tokens query slots per request).
    """
    algorithm = spec_cfg["algorithm"]
    method = VLLM_METHODS.get(algorithm.upper(), algorithm.lower())
    if method == "dflash" and "num_draft_tokens" in spec_cfg:
        num_tokens = spec_cfg["num_draft_tokens"] - 1
    else:
        num_tokens = spec_cfg.get("num_steps", 1)
    vllm_spec = {"method": method}
    if "draft_model" in spec_cfg:
        vllm_spec["model"] = spec_cfg["draft_model"]
    vllm_spec["num_speculative_tokens"] = num_tokens
    if "draft_sample_method" in spec_cfg:
        vllm_spec["draft_sample_method"] = spec_cfg["draft_sample_method"]
    return vllm_spec


def transformers_command(spec: ServerSpec) -> list[str]:
    cmd = server_module_command(spec.interpreter(), "transformers") + ["serve"]
    cmd += ["--host", spec.host, "--port", str(spec.port)]
    cmd += ["--continuous-batching", "--device", "auto"]
    if spec.mem_fraction is not None:
        cmd += ["--cb-max-memory-percent", str(spec.mem_fraction)]
    return cmd + list(spec.extra_args) + [spec.model]


COMMANDS = {"sglang": sglang_command, "vllm": vllm_command, "transformers": transformers_command}


def server_command(spec: ServerSpec) -> list[str]:
    try:
        return COMMANDS[spec.engine](spec)
    except KeyError:
        raise EngineError(f"unknown engine {spec.engine!r} (sglang, vllm, transformers)") from None


def exit_status(code: int | None) -> str:
    """``-9`` -> "killed by signal SIGKILL"; ``1`` -> "exit code 1"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _die_with_parent() -> None:
    """Runs in the child before exec: its own process group, SIGKILL when the parent dies, and
    as root none of the capabilities that read other processes (core.credentials.confine_child)."""
    os.setsid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    confine_child()


def start_engine_process(cmd: list[str], env: dict[str, str], out) -> subprocess.Popen:
    """Start an engine's process, writing to ``out``, with ``env`` (``engine_env``: no
    credentials). It cannot read them from other processes either: a job holding one makes
    itself non-dumpable first (no core dump and no debugger attach for it), and as root the
    engine starts without the capabilities that read other processes (core.credentials)."""
    protect_storage_credentials()
    problem = confinement_problem()
    if problem:
        log.warning("%s: the engine may read storage credentials from other root processes", problem)
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_port(port_base: int) -> int:
    """A GPU job's port follows its first device, so a restart finds (and reaps) its leftover;
    a CPU job takes any free port."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if devices[0].strip().isdigit():
        return port_base + int(devices[0])
    return free_port()


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_leftover(pid_file: Path, host: str, port: int, timeout: float = 30) -> None:
    """Kill the process group recorded for this port by an earlier job that did not clean up."""
    if not pid_file.exists():
        return
    try:
        pgid = int(pid_file.read_text().split()[0])
    except (ValueError, IndexError):
        pid_file.unlink(missing_ok=True)
        return
    if _process_alive(pgid):
        log.warning("reaping leftover server (process group %d) holding port %d", pgid, port)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout / 2
            while time.monotonic() < deadline and _process_alive(pgid):
                time.sleep(0.2)
    pid_file.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    while port_in_use(host, port) and time.monotonic() < deadline:
        time.sleep(0.3)


class ManagedServer:
    """A server process owned by this job: started, health-checked, stopped, logged."""

    def __init__(
        self,
        spec: ServerSpec,
        log_path: str | Path,
        run_dir: str | Path,
        startup_timeout: float = 1800,
        log_label: str | None = None,
    ):
        self.spec = spec
        self.log_path = Path(log_path)
        # How error messages name the log, where that is more than its path (e.g. the job's
        # declared log beside this attempt's own file).
        self.log_label = log_label or str(self.log_path)
        self.pid_file = Path(run_dir) / f"server-{spec.port}.pid"
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self._end_noted = False

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def fail(self, what: str) -> EngineError:
        return EngineError(
            f"{self.spec.engine} server {what}; see its log {self.log_label}. Last lines:\n{self.log_tail()}"
        )

    def start(self) -> None:
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        reap_leftover(self.pid_file, self.spec.host, self.spec.port)
        if port_in_use(self.spec.host, self.spec.port):
            raise EngineError(
                f"port {self.spec.port} is held by a process this pipeline did not start; "
                "free it or set generation.server.port_base"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = server_command(self.spec)
        log.info("starting %s server: %s (log: %s)", self.spec.engine, " ".join(cmd), self.log_path)
        # The spec's environment (engines.<engine>.env applied), else this process's; either way
        # without storage credentials or the job's thread limits.
        env = engine_env(self.spec.engine, None, self.spec.env)
        self._end_noted = False
        with open(self.log_path, "ab") as out:
            self.process = start_engine_process(cmd, env, out)
        self.pid_file.write_text(f"{self.process.pid}\n{' '.join(cmd)}\n")
        self.wait_healthy()

    def healthy(self) -> bool:
        try:
            resp = httpx.get(self.spec.url + HEALTH_PATH, timeout=5)
            return resp.status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.alive():
                self.stop()  # what it started (an engine core, its workers) must not outlive it
                raise self.fail(f"exited with code {self.process.returncode} while starting")
            if self.healthy():
                log.info("%s server healthy at %s", self.spec.engine, self.spec.url)
                return
            time.sleep(1)
        self.stop()
        raise self.fail(f"did not become healthy within {self.startup_timeout:.0f} s")

    def stop(self, timeout: float = 30) -> None:
        if self.process is None:
            return
        died = self.process.poll()
        how = "SIGTERM"
        if died is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                # A stopped server (SIGSTOP, a debugger) would hold the signal until the timeout.
                os.killpg(self.process.pid, signal.SIGCONT)
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                how = f"SIGTERM, then SIGKILL after {timeout:.0f} s"
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        # The rest of its process group goes too: a server that died (or exited on SIGTERM)
        # leaves its own children running otherwise (vLLM's engine core and workers, holding
        # the GPU's memory; the death signal reaches only the server's own process).
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.pid_file.unlink(missing_ok=True)
        # The server's own log cannot say that it was killed: its end is noted there, once.
        if died is None:
            self.note_end(f"stopped by the job with {how} ({exit_status(self.process.returncode)})")
        else:
            self.note_end(f"died before the job stopped it: {exit_status(died)}")
        log.info("%s server stopped", self.spec.engine)

    def note_end(self, what: str) -> None:
        if self._end_noted:
            return
        self._end_noted = True
        try:
            with open(self.log_path, "a", encoding="utf-8") as out:
                out.write(f"\n[dflash-pipeline] {self.spec.engine} server (pid {self.process.pid}) {what}\n")
        except OSError:
            pass

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
