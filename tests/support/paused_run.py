"""A module run as ``python -m MODULE ARGS`` runs it, held still right after it first writes a
local storage object whose key ends with a given suffix, until the test lets it go on.

A test that must act at a point of a run (send SIGTERM after the first step, SIGKILL after the
first periodic checkpoint) does so while the run is held there: the run can neither finish before
the test acts nor be caught elsewhere, however fast or loaded the machine is.

``python -m tests.support.paused_run SUFFIX FOLDER MODULE ARGS...``: when held, the run leaves
``FOLDER/paused`` (holding the key it wrote), ``FOLDER/signalled`` once a SIGTERM has reached it
meanwhile, and waits for ``FOLDER/resume``. Files, not pipes,
so that it also works in the ranks torchrun starts (which inherit no descriptors). ``Pause`` is
the test's side.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def hold_after_write(suffix: str, folder: Path) -> None:
    """Patch local storage's one write path so the first write of a key ending in ``suffix``
    leaves the marker and waits for the resume file (in the main thread, where the training
    loop writes its metrics and checkpoint pointer, and where signal handlers run)."""
    from dflash_pipeline.core.storage import LocalStorage

    original = LocalStorage.write_bytes
    held = False

    def write_bytes(self, key: str, data: bytes) -> None:
        nonlocal held
        original(self, key, data)
        if held or not key.endswith(suffix):
            return
        held = True
        previous = signal.getsignal(signal.SIGTERM)

        def noted(signum, frame):
            if callable(previous):
                previous(signum, frame)
                (folder / "signalled").touch()  # the run's own handler has seen it: it may go on
            else:
                signal.signal(signum, previous)
                os.kill(os.getpid(), signum)

        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:  # only there can handlers be set
            signal.signal(signal.SIGTERM, noted)
        marker = folder / "paused"
        marker.with_suffix(".tmp").write_text(key)
        os.replace(marker.with_suffix(".tmp"), marker)  # whole or absent for the test
        try:
            while not (folder / "resume").exists():
                time.sleep(0.05)  # waiting on the test; a signal meanwhile runs its handler
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)

    LocalStorage.write_bytes = write_bytes


class Pause:
    """The test's side: the command that runs a module held after a write, and the waits."""

    def __init__(self, folder: Path, suffix: str):
        self.folder, self.suffix = folder, suffix
        folder.mkdir(parents=True, exist_ok=True)

    def command(self, python_args: list[str]) -> list[str]:
        """``python_args`` (``[..., "-m", MODULE, ARGS...]``, a torchrun command too) with the
        module run through this one."""
        at = len(python_args) - 1 - python_args[::-1].index("-m")
        module = python_args[at + 1]
        return [*python_args[: at + 1], "tests.support.paused_run", self.suffix, str(self.folder), module,
                *python_args[at + 2 :]]  # fmt: skip

    @staticmethod
    def env() -> dict[str, str]:
        """The environment the command needs: this checkout's ``tests`` importable."""
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "PYTHONPATH": path}

    def wait_held(self, proc: subprocess.Popen, timeout: float) -> str:
        """The key after which the run is held; AssertionError if it ended first."""
        marker = self.folder / "paused"
        wait_until(lambda: marker.exists() or proc.poll() is not None, timeout, f"a write of *{self.suffix}")
        assert marker.exists(), f"the run ended ({proc.returncode}) before it wrote *{self.suffix}"
        return marker.read_text()

    def resume(self) -> None:
        (self.folder / "resume").touch()

    def resume_once_signalled(self, proc: subprocess.Popen, timeout: float) -> None:
        """Let the run go on once its SIGTERM handler has run (a signal forwarded by torchrun
        arrives when it does): it stops at the step it is held in."""
        signalled = self.folder / "signalled"
        wait_until(lambda: signalled.exists() or proc.poll() is not None, timeout, "the held run's SIGTERM")
        assert signalled.exists(), f"the run ended ({proc.returncode}) before its SIGTERM handler ran"
        self.resume()


def main() -> None:
    suffix, folder, module, *args = sys.argv[1:]
    hold_after_write(suffix, Path(folder))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
