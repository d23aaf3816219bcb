"""GPU slots: give each job its own devices when several run side by side on one machine.

Snakemake's ``--resources gpu=4`` only counts GPUs; it never says WHICH device a job may use.
Every GPU rule therefore runs through this wrapper: it takes a non-blocking ``flock`` on one lock
file per device until it holds as many as the job asked for, sets ``CUDA_VISIBLE_DEVICES`` to
those ids, and runs the command. The lock file descriptors stay open in the command's process
(``exec`` keeps them), so the kernel frees them when the job ends, even on SIGKILL.

Because Snakemake never starts more GPU jobs than ``--resources gpu`` allows, and the pool has at
least that many devices, a job never waits long; if it does (the pool is smaller than the limit,
or another Snakemake shares the machine), it waits with a jittered back-off and says so.

    python -m dflash_pipeline.core.gpu_slots --gpus 2 --pool 4 -- torchrun ... train.py
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


def default_lock_dir() -> Path:
    # Node-local and per user: flock over a shared file system is not reliable.
    return Path(tempfile.gettempdir()) / f"dflash-gpu-locks-{os.getuid()}"


def nvidia_smi(*query: str) -> list[str] | None:
    """The non-empty output lines of ``nvidia-smi QUERY...`` (e.g. ``--query-gpu=name
    --format=csv,noheader``); None where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def count_gpus() -> int:
    """Devices visible to ``nvidia-smi`` (0 where it is missing or fails)."""
    return len(nvidia_smi("--query-gpu=index", "--format=csv,noheader") or [])


def pool_from_config(config: dict) -> tuple[int, str]:
    """(pool size, lock folder) from the workflow config's `gpus` and `gpu_lock_dir`: the
    Snakefile and the jobs both call this, so neither travels in a rule's params (a pool counted
    on another node must not rerun finished work)."""
    size = config["gpus"] if config.get("gpus") is not None else count_gpus()
    return size, str(config.get("gpu_lock_dir") or default_lock_dir())


def device_pool(pool_size: int, inherited: str | None = None) -> list[str]:
    """The device ids jobs may take.

    An inherited ``CUDA_VISIBLE_DEVICES`` (set by a cluster scheduler, or by the user to keep
    some GPUs free) IS the pool; otherwise the pool is ``0..pool_size-1``.
    """
    if inherited is not None and inherited.strip():
        return [d.strip() for d in inherited.split(",") if d.strip()]
    return [str(i) for i in range(pool_size)]


class GpuLease:
    """Holds ``count`` device locks out of a pool of device ids until released."""

    def __init__(self, count: int, pool: list[str], lock_dir: str | Path | None = None):
        if count < 0:
            raise ValueError(f"a job cannot ask for {count} GPUs")
        if count > len(pool):
            raise ValueError(
                f"the job asks for {count} GPUs but the pool has {len(pool)} ({pool}; "
                "config key `gpus`, nvidia-smi's count, or an inherited CUDA_VISIBLE_DEVICES)"
            )
        self.count = count
        self.pool = list(pool)
        self.lock_dir = Path(lock_dir) if lock_dir else default_lock_dir()
        self.devices: list[str] = []
        self._fds: list[int] = []

    def _try_take(self) -> bool:
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        # Start at a random device so concurrent jobs do not all race for device 0 first.
        start = random.randrange(len(self.pool)) if self.pool else 0
        for offset in range(len(self.pool)):
            if len(self.devices) == self.count:
                break
            device = self.pool[(start + offset) % len(self.pool)]
            fd = os.open(self.lock_dir / f"gpu{device}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.set_inheritable(fd, True)
            self.devices.append(device)
            self._fds.append(fd)
        if len(self.devices) == self.count:
            self.devices.sort(key=self.pool.index)
            return True
        self.release()  # all or nothing: holding some while waiting for others can deadlock
        return False

    def acquire(self, timeout: float | None = None, poll: float = 1.0) -> list[str]:
        """Block until ``count`` devices are held; returns their ids."""
        if self.count == 0:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        while not self._try_take():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"no {self.count} free GPUs out of {len(self.pool)} after {timeout} s (locks in {self.lock_dir})"
                )
            if not waited:
                log.warning(
                    "waiting for %d free GPU(s) of %d (locks in %s)",
                    self.count,
                    len(self.pool),
                    self.lock_dir,
                )
                waited = True
            time.sleep(poll * (0.5 + random.random()))
        return self.devices

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._fds.clear()
        self.devices.clear()

    @property
    def visible_devices(self) -> str:
        return ",".join(self.devices)

    def __enter__(self) -> GpuLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.core.gpu_slots",
        description="Run a command on N free GPUs of this machine (CUDA_VISIBLE_DEVICES).",
    )
    parser.add_argument("--gpus", type=int, required=True, help="devices the command needs")
    parser.add_argument(
        "--pool",
        type=int,
        default=None,
        help="devices on this machine (default: nvidia-smi); an inherited CUDA_VISIBLE_DEVICES wins",
    )
    parser.add_argument("--lock-dir", default=None)
    parser.add_argument("--timeout", type=float, default=None, help="give up after seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command [args...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu_slots %(message)s")
    pool_size = count_gpus() if args.pool is None else args.pool
    pool = device_pool(pool_size, os.environ.get("CUDA_VISIBLE_DEVICES"))
    lease = GpuLease(args.gpus, pool, args.lock_dir)
    lease.acquire(timeout=args.timeout)
    os.environ["CUDA_VISIBLE_DEVICES"] = lease.visible_devices
    log.info("CUDA_VISIBLE_DEVICES=%s for: %s", lease.visible_devices, " ".join(command))
    sys.stdout.flush()
    sys.stderr.flush()
    # exec keeps the locked descriptors open in the command itself: the locks live exactly as
    # long as the job, whatever way it ends.
    os.execvp(command[0], command)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())


@contextlib.contextmanager
def job_devices(count: int, pool_size: int, lock_dir: str | Path | None):
    """The in-process form of the wrapper, for script rules: lease ``count`` devices of the pool
    (the inherited ``CUDA_VISIBLE_DEVICES`` or ``0..pool_size-1``) for the job's lifetime and
    make them the only ones the job sees."""
    pool = device_pool(pool_size, os.environ.get("CUDA_VISIBLE_DEVICES"))
    with GpuLease(count, pool, lock_dir) as lease:
        os.environ["CUDA_VISIBLE_DEVICES"] = lease.visible_devices
        yield lease
