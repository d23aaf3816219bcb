"""What every benchmark record carries (commit, date) and how it is emitted (printed, and written
to ``--out``). Imported by the scripts of this folder (``python bench/<name>.py``)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The checkout's commit; ``BENCH_COMMIT`` where the tree was copied without its .git."""
    return (
        os.environ.get("BENCH_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    )


def provenance(device: str) -> dict:
    return {"device": device, "commit": commit(), "date": time.strftime("%Y-%m-%d")}


class MeasuredRunFailed(SystemExit):
    """A measured run failed: the benchmark exits non-zero and writes no figure (a record of a
    failed run would read as a measurement)."""


def require_success(checks: dict[str, bool], detail: str = "") -> None:
    """Raise MeasuredRunFailed (exit 1, nothing emitted) naming every check that is false;
    ``detail`` (e.g. the failed run's last lines) goes with it to stderr. Call it before
    ``emit``."""
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        print(f"benchmark failed, no figure written: {', '.join(failed)}", file=sys.stderr)
        if detail:
            print(detail, file=sys.stderr)
        raise MeasuredRunFailed(1)


def emit(record: dict, out: str | None, indent: int = 2) -> None:
    text = json.dumps(record, indent=indent)
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def copy_workflow(dest: Path, extra: tuple[str, ...] = ()) -> Path:
    """The workflow's files (the ones the workflow tests copy, and ``extra``) copied into
    ``dest``: each benchmark runs Snakemake in a folder of its own. Returns ``dest``."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import WORKFLOW_FILES

    dest.mkdir(parents=True, exist_ok=True)
    for name in (*WORKFLOW_FILES, *extra):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def run_snakemake(workdir: Path, args: list[str], log: Path, what: str) -> float:
    """``snakemake ARGS`` in ``workdir`` (a ``copy_workflow`` folder) with this checkout's package
    first on the path, its output in ``log``; the seconds it took. A failed run stops the
    benchmark in one line naming ``what`` and the log."""
    command = [sys.executable, "-m", "snakemake", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"the {what} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - started


def cpu_model() -> str:
    """The CPU's model name, for records of CPU benchmarks."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class RequestCounter:
    """Counts the S3 calls a boto3 client makes (botocore's before-call event)."""

    def __init__(self, client):
        self.count = 0
        client.meta.events.register("before-call.s3.*", self._seen)

    def _seen(self, **_):
        self.count += 1
