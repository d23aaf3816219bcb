"""Logging for pipeline jobs: one log file per job plus stderr, errors recorded before they rise."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.core.credentials import protect_storage_credentials

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def job_logging(
    log_file: str | Path | None, level: int = logging.INFO, copies: Sequence[str | Path] = ()
) -> Iterator[logging.Logger]:
    """Send the package's log records to ``log_file`` and stderr for the duration of a job.

    An exception leaving the block is written to the log first, so the job's log file (what the
    status page and the user read) always says why the job failed. ``copies`` get every record
    too (an attempt's own job log, which Snakemake does not empty when it retries the job).
    A job holding storage credentials in its environment makes itself non-dumpable, so that no
    engine (this job's or another's) reads them from its ``/proc`` files (``core.credentials``).
    """
    root = logging.getLogger()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    for path in [log_file, *copies] if log_file else list(copies):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    old_level = root.level
    root.setLevel(level)
    job_log = logging.getLogger("dflash_pipeline.job")
    protect_storage_credentials()  # after the handlers: its warning, if any, is in the job's log
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


# Every attempt of a job keeps its logs here, below the run root, one file per attempt and kind
# (``<attempt>.job.log``, ``<attempt>.engine.log``): Snakemake empties a job's declared logs when
# it starts the job again (a retry, a rerun), so a retry would erase the failure it retries.
ATTEMPTS_DIR = "logs/attempts"
# How much of an earlier attempt's logs the declared engine log repeats (the rest is named).
EARLIER_TAIL_LINES = 40
EARLIER_IN_DETAIL = 5


def attempt_of(resources) -> int:
    """Snakemake's attempt number of a running job (1, then one more per retry; a new
    invocation counts from 1 again), from the rule's ``attempt`` resource (rules/*.smk):
    Snakemake 9 gives it to resource functions, not to the script's ``snakemake`` object."""
    try:
        return int(getattr(resources, "attempt", 1) or 1)
    except (TypeError, ValueError):
        return 1


def logs_folder(log_file: str | Path) -> Path:
    """The local folder behind the run root's ``logs/`` that holds ``log_file`` (a rule's
    declared log, at any depth below it)."""
    path = Path(log_file)
    for folder in path.parents:
        if folder.name == Path(ATTEMPTS_DIR).parent.name:
            return folder
    return path.parent


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _tail(data: bytes, lines: int) -> str:
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class JobAttempt:
    """One attempt of one job and where its logs live: a local file per kind under
    ``<local logs>/attempts/<job>/`` (the run root's own ``logs/`` in a local run, Snakemake's
    local copy of it in an S3 run) and the same key below the run root (``keep`` copies it
    there). Attempts are named ``<UTC start>-attempt-<N>``: Snakemake's N alone repeats with
    every invocation, and the time stamp sorts them in the order they ran."""

    run_url: str
    job: str  # "generate-00001", "evaluate"
    number: int
    local_logs: Path  # the local folder behind the run root's logs/
    started: str = field(default_factory=_utc_stamp)

    _store: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.run_url = str(self.run_url)
        self.local_logs = Path(self.local_logs)

    @classmethod
    def of(cls, smk, job: str, log_file: str | Path) -> JobAttempt:
        """The running Snakemake job's attempt (a script's ``snakemake`` object: its run_url
        param and attempt resource); ``log_file`` is one of its declared logs, below logs/."""
        return cls(smk.params.run_url, job, attempt_of(smk.resources), logs_folder(log_file))

    @contextlib.contextmanager
    def logging(self, log_file: str | Path) -> Iterator[logging.Logger]:
        """``job_logging`` into the declared ``log_file`` and this attempt's own copy, which is
        kept in the run root when the block ends, however it ends (``keep``). The log opens
        with the attempt's number and names the earlier attempts' kept logs."""
        try:
            with job_logging(log_file, copies=[self.local("job")]) as log:
                log.log(
                    logging.INFO if self.number == 1 else logging.WARNING,
                    "attempt %d of this job in this run of Snakemake (%s); its logs are kept in %s",
                    self.number, self.name, self.storage().join(self.prefix),
                )  # fmt: skip
                earlier = self.earlier()
                if earlier:
                    log.info(
                        "%d earlier attempt(s) of this job, the last %s: their logs are kept there too",
                        len(earlier),
                        earlier[-1],
                    )
                yield log
        finally:
            self.keep()

    @property
    def name(self) -> str:
        return f"{self.started}-attempt-{self.number}"

    @property
    def prefix(self) -> str:
        """This job's attempts folder, relative to the run root (ends with "/")."""
        return f"{ATTEMPTS_DIR}/{self.job}/"

    @property
    def local_dir(self) -> Path:
        return self.local_logs / Path(ATTEMPTS_DIR).name / self.job

    def key(self, kind: str) -> str:
        """Run-root key of this attempt's ``kind`` log ("job", "engine")."""
        return f"{self.prefix}{self.name}.{kind}.log"

    def local(self, kind: str) -> Path:
        """Where this attempt writes its ``kind`` log on this machine."""
        return self.local_dir / f"{self.name}.{kind}.log"

    def storage(self):
        """The run root (opened once)."""
        if self._store is None:
            from dflash_pipeline.core.storage import open_storage

            self._store = open_storage(self.run_url)
        return self._store

    def url(self, kind: str) -> str:
        """The full URL (or local path) of the kept copy of this attempt's ``kind`` log."""
        return self.storage().join(self.key(kind))

    def where(self, kind: str) -> str:
        """This attempt's ``kind`` log as an error message names it: the local file, and its
        place in the run root when that is elsewhere (S3)."""
        url = self.url(kind)
        if _same_file(url, self.local(kind)):
            return str(self.local(kind))
        return f"{self.local(kind)}, in the run root {url}"

    def label(self, declared: str | Path, kind: str = "engine") -> str:
        """How a message names the log: the rule's declared log (every attempt's, rewritten
        when the job starts again) and this attempt's own file, which nothing rewrites."""
        return f"{declared} (this attempt's own: {self.where(kind)})"

    def earlier(self) -> list[str]:
        """Names of this job's other attempts whose logs are kept, oldest first: in the run
        root, and on this machine (an attempt killed before it could copy its logs)."""
        names: set[str] = set()
        try:
            from dflash_pipeline.core.storage import open_storage

            # Listed from the folder itself: a local run root's listing walks every file below it.
            folder = open_storage(self.storage().join(self.prefix))
            names |= {_attempt_name(o.key.rsplit("/", 1)[-1]) for o in folder.list()}
        except Exception as err:  # noqa: BLE001 (the logs must not fail the job)
            logging.getLogger(__name__).warning("cannot list %s: %s", self.prefix, err)
        if self.local_dir.is_dir():
            names |= {_attempt_name(p.name) for p in self.local_dir.glob("*.log")}
        names.discard(None)
        names.discard(self.name)
        return sorted(names)

    def keep(self) -> list[str]:
        """Copy this attempt's local log files to the run root, and every earlier attempt's that
        the run root lacks (one killed before its own ``keep``). A no-op where the local folder
        is the run root's. Never raises: a failure is logged (the job's own error matters more).
        Returns the keys written."""
        written: list[str] = []
        if not self.local_dir.is_dir():
            return written
        try:
            store = self.storage()
        except Exception as err:  # noqa: BLE001
            logging.getLogger(__name__).warning("cannot keep the logs of %s: %s", self.name, err)
            return written
        for path in sorted(self.local_dir.glob("*.log")):
            key = self.prefix + path.name
            try:
                if _same_file(store.join(key), path):
                    continue
                if path.name.startswith(self.name + ".") or not store.exists(key):
                    store.upload_file(key, path)
                    written.append(key)
            except Exception as err:  # noqa: BLE001
                logging.getLogger(__name__).warning("cannot keep %s as %s: %s", path, store.join(key), err)
        return written

    def _read(self, name: str) -> tuple[bytes, str] | None:
        """An attempt's file: the local copy where there is one, else the run root's."""
        path = self.local_dir / name
        if path.is_file():
            return path.read_bytes(), self.storage().join(self.prefix + name)
        try:
            store = self.storage()
            return store.read_bytes(self.prefix + name), store.join(self.prefix + name)
        except Exception:  # noqa: BLE001 (absent, or storage unreachable)
            return None

    def bundle(self, out: str | Path, kind: str = "engine", absent: str = "(no log)") -> None:
        """Write the declared ``out``: this attempt's ``kind`` log whole (``absent`` where it
        has none), after the last lines of every earlier attempt's job and ``kind`` logs with
        the URLs of their full copies. With no earlier attempt it is this attempt's log alone.
        Never raises: a failure is logged (the job's own error matters more)."""
        try:
            self._bundle(out, kind, absent)
        except Exception as err:  # noqa: BLE001
            logging.getLogger(__name__).warning("cannot write %s: %s", out, err)

    def _bundle(self, out: str | Path, kind: str, absent: str) -> None:
        earlier = self.earlier()
        current = self.local(kind)
        # Bytes, decoded: read_text would turn a progress bar's carriage returns into newlines.
        text = current.read_bytes().decode("utf-8", errors="replace") if current.is_file() else ""
        if not text.strip():
            text = absent.rstrip("\n") + "\n"
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as fh:
            if earlier:
                shown = earlier[-EARLIER_IN_DETAIL:]
                fh.write(
                    f"===== {len(earlier)} earlier attempt(s) of this job; their full logs are kept in "
                    f"{self.storage().join(self.prefix)} =====\n"
                )
                if len(earlier) > len(shown):
                    fh.write(f"(only the last {len(shown)} are shown: {', '.join(earlier[: -len(shown)])} are not)\n")
                for name in shown:
                    for part in ("job", kind):
                        found = self._read(f"{name}.{part}.log")
                        if found is None:
                            fh.write(f"----- {name}.{part}.log: not kept -----\n")
                            continue
                        data, url = found
                        fh.write(f"----- {name}.{part}.log: last {EARLIER_TAIL_LINES} lines of {url} -----\n")
                        tail = _tail(data, EARLIER_TAIL_LINES)
                        fh.write(tail + "\n" if tail else "(empty)\n")
                fh.write(f"===== this attempt: {self.name} ({self.where(kind)}) =====\n")
            fh.write(text if text.endswith("\n") else text + "\n")


def _attempt_name(file_name: str) -> str | None:
    """``20250102T030405Z-attempt-2.engine.log`` -> ``20250102T030405Z-attempt-2``."""
    stem, dot, rest = file_name.partition(".")
    return stem if dot and "-attempt-" in stem and rest.endswith("log") else None


def _same_file(url: str, path: Path) -> bool:
    """Whether the run-root ``url`` is the local ``path`` itself (a local run)."""
    if str(url).startswith("s3://"):
        return False
    return Path(url).resolve() == Path(path).resolve()
