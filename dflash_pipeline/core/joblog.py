"""Logging for pipeline jobs: one log file per job plus stderr, errors recorded before they rise."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def job_logging(log_file: str | Path | None, level: int = logging.INFO) -> Iterator[logging.Logger]:
    """Send the package's log records to ``log_file`` and stderr for the duration of a job.

    An exception leaving the block is written to the log first, so the job's log file (what the
    status page and the user read) always says why the job failed.
    """
    root = logging.getLogger()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    old_level = root.level
    root.setLevel(level)
    job_log = logging.getLogger("dflash_pipeline.job")
    try:
        yield job_log
    except Exception as err:
        job_log.error("job failed: %s", err)
        raise
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(old_level)


def bundle_logs(folder: str | Path, out: str | Path, absent: str) -> None:
    """Every file of ``folder`` (an engine's server logs, its captured metrics) into the one log
    file ``out``, each under a header: a rule can declare only files as logs, and only declared
    logs reach the run root of an S3 run (the logs of failed jobs too). ``absent`` is written when
    the folder holds nothing."""
    files = sorted(p for p in Path(folder).glob("*") if p.is_file()) if Path(folder).is_dir() else []
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        if not files:
            fh.write(absent.rstrip("\n") + "\n")
        for path in files:
            fh.write(f"===== {path.name} =====\n")
            text = path.read_text(encoding="utf-8", errors="replace")
            fh.write(text if text.endswith("\n") or not text else text + "\n")
