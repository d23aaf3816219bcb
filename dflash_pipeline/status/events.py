"""Snakemake job events as JSON lines: written by the ``dflash`` logger plugin, read by the page.

The plugin (``snakemake_logger_plugin_dflash``) runs in Snakemake's main process and appends one
JSON object per job event to a local file. ``EventTail`` reads what was appended since its last
call; ``JobBoard`` folds that into the state of every job of the latest run (planned, running,
done, failed); ``RunJobBoard`` keeps only the Snakemake runs whose jobs write into one run root.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from logging import LogRecord
from pathlib import Path

from dflash_pipeline.core import layout

# Relative to Snakemake's working directory, beside the local logs of the demo-model rule.
DEFAULT_EVENTS_FILE = "logs/snakemake-events.jsonl"

# Snakemake's LogEvent values (snakemake_interface_logger_plugins.common) that we keep.
KEPT_EVENTS = {
    "workflow_started",
    "run_info",
    "job_info",
    "job_started",
    "job_finished",
    "job_error",
    "progress",
    "error",
}


def _gpus(resources) -> int:
    """A job's ``gpu`` resource (rules/common.smk), 0 where it has none."""
    try:
        return int((resources or {}).get("gpu") or 0)
    except (AttributeError, TypeError, ValueError):
        return 0


def _files(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return [str(v) for v in value]


def event_from_record(record: LogRecord, now: float | None = None) -> dict | None:
    """The JSON event for a Snakemake log record, or None for records the page does not need."""
    kind = getattr(record, "event", None)
    if kind is None or str(kind) not in KEPT_EVENTS:
        return None
    kind = str(kind)
    event: dict = {"event": kind, "time": now if now is not None else record.created}
    if kind == "workflow_started":
        event["workflow_id"] = str(getattr(record, "workflow_id", "") or "")
    elif kind == "run_info":
        stats = getattr(record, "stats", None) or {}
        event["job_counts"] = {str(k): int(v) for k, v in dict(stats).items() if str(k) != "total"}
    elif kind == "job_info":
        event.update(
            jobid=int(record.jobid),
            rule=str(getattr(record, "rule_name", "")),
            wildcards={str(k): str(v) for k, v in dict(getattr(record, "wildcards", None) or {}).items()},
            log=_files(getattr(record, "log", None)),
            output=_files(getattr(record, "output", None)),
            gpus=_gpus(getattr(record, "resources", None)),
        )
    elif kind == "job_started":
        event["jobids"] = [int(j) for j in (getattr(record, "jobs", None) or [])]
    elif kind == "job_finished":
        event["jobid"] = int(record.job_id)
    elif kind == "job_error":
        event.update(
            jobid=int(record.jobid),
            rule=str(getattr(record, "rule_name", "")),
            log=_files(getattr(record, "log", None)),
            message=str(getattr(record, "rule_msg", "") or ""),
        )
    elif kind == "progress":
        event.update(done=int(record.done), total=int(record.total))
    elif kind == "error":
        event["message"] = str(record.getMessage())[:2000]
    return event


class EventWriter:
    """Appends events to the file, one line each, flushed at once so a reader never waits."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, event: dict) -> None:
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self.write_closed_marker()
                self._fh.close()

    def write_closed_marker(self) -> None:
        # Snakemake closes its handlers when it exits: after this, nothing of the run still runs.
        self._fh.write(json.dumps({"event": "run_ended", "time": time.time()}) + "\n")
        self._fh.flush()


@dataclass
class Job:
    jobid: int
    rule: str
    wildcards: dict[str, str]
    log: list[str]
    output: list[str]
    state: str = "planned"  # planned | running | done | failed | interrupted
    gpus: int = 0  # its `gpu` resource: the headline's GPU-hours
    started_at: float | None = None
    ended_at: float | None = None
    message: str = ""


@dataclass
class RunEvents:
    """What the latest Snakemake run (since its last ``workflow_started``) said about its jobs."""

    started_at: float | None = None
    ended_at: float | None = None
    steps_done: int = 0
    steps_total: int = 0
    job_counts: dict[str, int] = field(default_factory=dict)
    jobs: dict[int, Job] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        if self.started_at is None:
            return "unknown"
        if any(j.state == "failed" for j in self.jobs.values()) or self.errors:
            return "failed" if self.ended_at is not None else "running, with failures"
        if self.ended_at is not None:
            return "finished" if self.steps_total and self.steps_done >= self.steps_total else "stopped"
        return "running"

    def apply(self, event: dict) -> None:
        kind = event.get("event")
        t = event.get("time")
        if kind == "workflow_started":
            # A new Snakemake run: job ids start again, so forget the previous run's jobs.
            self.__init__(started_at=t)
        elif kind == "run_info":
            self.job_counts = dict(event.get("job_counts", {}))
        elif kind == "job_info":
            # Snakemake announces a job as started just before it logs the job's details.
            job = self.jobs.setdefault(event["jobid"], Job(event["jobid"], "", {}, [], []))
            job.rule, job.wildcards = event["rule"], event["wildcards"]
            job.log, job.output = event["log"], event["output"]
            job.gpus = int(event.get("gpus") or 0)
        elif kind == "job_started":
            for jobid in event.get("jobids", []):
                job = self.jobs.setdefault(jobid, Job(jobid, "", {}, [], []))
                job.state, job.started_at = "running", t
        elif kind == "job_finished":
            job = self.jobs.get(event["jobid"])
            if job is not None:
                job.state, job.ended_at = "done", t
        elif kind == "job_error":
            job = self.jobs.get(event["jobid"])
            if job is None:
                job = self.jobs[event["jobid"]] = Job(event["jobid"], event["rule"], {}, event["log"], [])
            job.state, job.ended_at, job.message = "failed", t, event.get("message", "")
            job.log = job.log or event["log"]
        elif kind == "progress":
            self.steps_done, self.steps_total = event["done"], event["total"]
        elif kind == "error":
            self.errors.append(event.get("message", ""))
        elif kind == "run_ended":
            self.ended_at = t
            for job in self.jobs.values():
                if job.state == "running":
                    job.state = "interrupted"


class EventTail:
    """Incremental reader of an events file (it may not exist yet, or be replaced): each ``read``
    returns the events appended since the last one, and whether the file started over (a new
    file, or a truncated one: everything read before no longer holds)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._offset = 0
        self._inode = None
        self._partial = b""

    def read(self) -> tuple[bool, list[dict]]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return False, []
        restarted = st.st_ino != self._inode or st.st_size < self._offset
        if restarted:
            self._offset, self._inode, self._partial = 0, st.st_ino, b""
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next read
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash; the next ones are still good
            if isinstance(event, dict):
                events.append(event)
        return restarted, events


class JobBoard:
    """The events file folded into the state of its (latest) run."""

    def __init__(self, path: str | os.PathLike):
        self.tail = EventTail(path)
        self.run = RunEvents()

    def refresh(self) -> RunEvents:
        restarted, events = self.tail.read()
        if restarted:
            self.run = RunEvents()
        for event in events:
            self.run.apply(event)
        return self.run


# A file name in a job event carries Snakemake's annotation, e.g. " (send to storage)".
FILE_ANNOTATION = re.compile(r" \([^()]*\)$")


# Where Snakemake keeps the local copy of a storage file while the job writes it
# (its --local-storage-prefix default, then provider, bucket and key).
LOCAL_STORAGE_PREFIX = ".snakemake/storage"


def local_log_path(name: str) -> str:
    """The local file behind a log name in a job event: the path itself, or for an S3 log
    (``s3://bucket/key (send to storage)``) Snakemake's local copy of it."""
    name = FILE_ANNOTATION.sub("", name.strip())
    if name.startswith("s3://"):
        return f"{LOCAL_STORAGE_PREFIX}/s3/{name[len('s3://') :]}"
    return name


class RunJobBoard:
    """The job events of this run root's Snakemake runs, read incrementally from an events file
    that may also hold other runs' (the plugin writes one file per working directory).

    Each Snakemake run (from one ``workflow_started`` to the next) is this run root's once one of
    its jobs names an output or log inside the root (S3 jobs name theirs by URL:
    ``s3://bucket/prefix/results/<run>/outputs/... (send to storage)``); it is another run's once
    a job names a run-root output elsewhere (``.../outputs/<name>`` of another root, local or in
    storage) while none of its jobs has named this root. Until either (a run just started, or
    its jobs name no files) it is shown as before. The board shows the latest Snakemake run that
    is not another run's; when the latest is another run's, the last one of this root (ended by
    the next run's start), or nothing.
    """

    def __init__(self, path, run_url: str, workdir: Path = Path(".")):
        self.tail = EventTail(path)
        root = run_url.rstrip("/")
        self._remote = "://" in root
        self._workdir = os.path.abspath(workdir)
        # A local root, as given and with its links resolved (job paths are relative to workdir).
        self._roots = {root} if self._remote else {os.path.abspath(root), os.path.realpath(root)}
        self._reset()

    def _reset(self) -> None:
        self._current: RunEvents | None = None  # the latest Snakemake run in the file
        self._current_owner: str | None = None  # "this" | "another" | None (not known yet)
        self._ours: RunEvents | None = None  # the latest run known to be this root's

    @property
    def source(self) -> str:
        """Whose Snakemake run ``refresh`` returns: "this run"; "unknown" (the latest run's jobs
        named no files yet); "another run" (the file holds only other runs': none is shown);
        "none" (no run in the file)."""
        if self._current is None:
            return "none"
        if self._current_owner is None:
            return "unknown"
        return "this run" if self._ours is not None else "another run"

    @property
    def run(self) -> RunEvents:
        if self._current is not None and self._current_owner is None:
            return self._current
        return self._ours if self._ours is not None else RunEvents()

    def refresh(self) -> RunEvents:
        restarted, events = self.tail.read()
        if restarted:
            self._reset()
        for event in events:
            self._apply(event)
        return self.run

    def _apply(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "workflow_started" or self._current is None:
            if self._current is not None and self._current_owner == "this" and self._current.ended_at is None:
                # A new Snakemake run in this working directory: the last one is over (killed
                # without its closing event); its running jobs are no longer running.
                self._current.apply({"event": "run_ended", "time": event.get("time")})
            self._current, self._current_owner = RunEvents(), None
        self._current.apply(event)
        if self._current_owner != "this" and kind in ("job_info", "job_error"):
            owner = self._owner(event)
            if owner == "this":
                self._current_owner, self._ours = "this", self._current
            elif owner == "another":
                self._current_owner = "another"

    def _owner(self, event: dict) -> str | None:
        foreign = False
        for kind in ("output", "log"):
            for name in event.get(kind) or []:
                name = FILE_ANNOTATION.sub("", str(name).strip())
                if not name:
                    continue
                remote = "://" in name
                if remote == self._remote:
                    path = name if remote else os.path.normpath(os.path.join(self._workdir, name))
                    if any(path.startswith(root + "/") for root in self._roots):
                        return "this"
                # Every output of a run root lies in its outputs/ folder (core/layout.py); the
                # demo model and other local helpers lie elsewhere and say nothing.
                if kind == "output" and os.path.basename(os.path.dirname(name.rstrip("/"))) == layout.OUTPUTS_DIR:
                    foreign = True
        return "another" if foreign else None
