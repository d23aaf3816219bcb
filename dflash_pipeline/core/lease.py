"""The run lease: one Snakemake driver per run root (a local folder or an S3 prefix).

Snakemake's own lock lives in the working directory's ``.snakemake/``, so two drivers started
from two checkouts (or two machines) on the same S3 prefix would both run, deleting each other's
generation parts and checkpoints. The lease is one object, ``_progress/LEASE.json`` in the run
root, naming its holder (host, pid, process start, when it started) with a heartbeat and an
expiry:

* the first driver creates it with a conditional write (S3 ``If-None-Match: *``; locally an
  exclusive create under ``flock``), so of two drivers starting together exactly one wins;
* a second driver finds it held and stops at once, with a message naming the holder;
* the holder refreshes it every ``ttl_s / 4`` seconds with ``If-Match`` on the version it last
  wrote, so a driver that lost its lease (it stalled past the expiry and another took over)
  finds out at its next heartbeat instead of silently overwriting the new holder;
* a lease is stale once its expiry has passed, or at once when its holder is a process of this
  host that no longer exists (a killed driver); a stale lease is taken over, again with
  ``If-Match``, so two drivers taking over the same stale lease cannot both win;
* a holder on another host whose heartbeat is already overdue is watched for one more beat
  interval: a live driver beats in that time (after a storage outage too: a failed beat is
  retried within seconds), so a lease that does not change is its dead holder's and is taken
  over then, without waiting for the rest of its expiry (a driver killed by an outage on
  another machine frees its run about 3 minutes after its last beat instead of 5, with the
  default ``lease.ttl_s`` of the config schema);
* the holder deletes it when the run ends (success or error);
* every one of these writes decides from what is stored, not from the answer to its last
  request: a write that timed out on a stalled server may land when it resumes, and its retry
  then fails its own precondition; a lease found holding this driver's token is its own write
  (``Storage.create_if_absent`` and the others settle the same way by content).

Only real executions take it (the workflow's ``onstart``): dry-runs, ``--lint``, reports and the
jobs themselves never do. ``python -m dflash_pipeline.core.lease show|break --run-url URL``
inspects it or removes one whose holder is known to be gone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import Storage, StorageError, open_storage

LEASE_KEY = layout.RUN_LEASE
# How late a beat may be (slow storage, clock skew between hosts) before its holder is watched.
WATCH_GRACE_S = 15.0
# A failed beat (storage unreachable) is tried again this soon, not a whole interval later.
RETRY_BEAT_S = 5.0
BREAK_COMMAND = "python -m dflash_pipeline.core.lease break --run-url {run_url}"


class LeaseHeld(RuntimeError):
    """Another driver holds the run's lease; the message names it."""


class LeaseLost(RuntimeError):
    """This driver's lease was taken over (it missed heartbeats past the expiry)."""


def process_start(pid: int) -> str | None:
    """An identifier of when process ``pid`` started (Linux: its start time in clock ticks), so
    a reused pid is not mistaken for the holder; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime) counted after the command name, which may itself hold spaces.
    return stat.rsplit(")", 1)[1].split()[19]


def process_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    now_started = process_start(pid)
    return started is None or now_started is None or now_started == started


def is_stale(record: dict, now: float, host: str | None = None) -> bool:
    """Whether a lease record may be taken over: expired, or held by a dead local process."""
    host = socket.gethostname() if host is None else host
    try:
        if float(record["expires_at"]) <= now:
            return True
        owner = record["owner"]
        if owner["host"] == host and not process_alive(int(owner["pid"]), owner.get("process_start")):
            return True
    except (KeyError, TypeError, ValueError):
        return True  # not a lease this code wrote (objects are written whole): not a holder
    return False


def describe_holder(record: dict) -> str:
    owner = record.get("owner") or {}

    def utc(t):
        try:
            return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t)))
        except (TypeError, ValueError):
            return "?"

    return (
        f"host {owner.get('host', '?')} pid {owner.get('pid', '?')} "
        f"(working directory {owner.get('cwd', '?')}, started {utc(owner.get('started_at'))}, "
        f"last heartbeat {utc(record.get('heartbeat_at'))}, expires {utc(record.get('expires_at'))})"
    )


class RunLease:
    """This process's claim on one run root, valid ``ttl_s`` seconds (the config's ``lease.ttl_s``)
    past each heartbeat."""

    def __init__(
        self,
        storage: Storage,
        ttl_s: float,
        *,
        host: str | None = None,
        pid: int | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be positive, got {ttl_s}")
        self.storage, self.ttl_s, self.clock, self.sleep = storage, float(ttl_s), clock, sleep
        pid = os.getpid() if pid is None else pid
        self.owner = {
            "host": socket.gethostname() if host is None else host,
            "pid": pid,
            "process_start": process_start(pid),
            "cwd": os.getcwd(),
            "started_at": clock(),
            "token": uuid.uuid4().hex,
        }
        self.tag: str | None = None  # version of the lease object this process last wrote
        self.took_over: dict | None = None  # the stale record replaced by acquire(), if any
        self.takeover_reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.storage.join(LEASE_KEY)

    @property
    def beat_every_s(self) -> float:
        return self.ttl_s / 4

    def _record(self) -> bytes:
        now = self.clock()
        record = {
            "owner": self.owner,
            "heartbeat_at": now,
            "expires_at": now + self.ttl_s,
            "ttl_s": self.ttl_s,
            "heartbeat_every_s": self.beat_every_s,
        }
        return json.dumps(record, indent=1).encode("utf-8")

    def _silent_holder(self, record: dict, tag: str) -> bool:
        """Whether the holder of a lease that has not expired is dead by its heartbeat: its
        last beat is overdue, and the lease stays unchanged for one more beat interval."""
        try:
            every = float(record.get("heartbeat_every_s") or float(record["ttl_s"]) / 4)
            overdue = self.clock() - float(record["heartbeat_at"]) > every + WATCH_GRACE_S
        except (KeyError, TypeError, ValueError):
            return False
        if not overdue:
            return False
        watch = every + WATCH_GRACE_S
        logging.getLogger(__name__).warning(
            "the run lease %s is held by %s, whose heartbeat is overdue; watching it for %.0f s "
            "before taking the run over", self.url, describe_holder(record), watch,
        )  # fmt: skip
        self.sleep(watch)
        current = self.storage.read_tagged(LEASE_KEY)
        return current is not None and current[1] == tag

    def _ours(self, record: dict) -> bool:
        """Whether a stored lease record was written by this lease (its owner token): a write
        whose answer was lost (a client timeout while the storage stalled) may have landed."""
        owner = record.get("owner")
        return isinstance(owner, dict) and owner.get("token") == self.owner["token"]

    def _read(self) -> tuple[dict, str] | None:
        current = self.storage.read_tagged(LEASE_KEY)
        if current is None:
            return None
        try:
            record = json.loads(current[0])
        except ValueError:
            record = {}
        return (record if isinstance(record, dict) else {}), current[1]

    def acquire(self) -> RunLease:
        """Take the lease, or raise LeaseHeld naming the live holder."""
        takeover = None  # the stale record and why, while this driver's takeover is unconfirmed
        for _ in range(5):  # each retry follows a change by another driver
            tag = self.storage.create_if_absent(LEASE_KEY, self._record())
            if tag is not None:
                self.tag = tag
                return self
            current = self._read()
            if current is None:
                continue  # released between our two requests
            record, current_tag = current
            if self._ours(record):  # a create or takeover of ours landed; its answer was lost
                self.tag = current_tag
                if takeover is not None:
                    self.took_over, self.takeover_reason = takeover
                return self
            if is_stale(record, self.clock(), self.owner["host"]):
                reason = "expired, or its holder's process is gone"
            elif self._silent_holder(record, current_tag):
                reason = "its holder's heartbeat stopped (overdue, and none while watched)"
            else:
                raise LeaseHeld(
                    f"the run at {self.storage.url} is driven by another Snakemake: "
                    f"{describe_holder(record)}. Two drivers on one run delete each other's "
                    "in-flight work, so this one stops. Wait for it to finish; if that driver is "
                    "gone, the next driver takes the run over once the lease shows its heartbeat "
                    "stopped (or it expires), or remove the lease now with: "
                    + BREAK_COMMAND.format(run_url=self.storage.url)
                )
            takeover = (record, reason)
            tag = self.storage.replace_if_tag(LEASE_KEY, self._record(), current_tag)
            if tag is not None:
                self.tag, self.took_over, self.takeover_reason = tag, record, reason
                return self
        raise LeaseHeld(f"could not take the lease {self.url}: it kept changing under this driver")

    def heartbeat(self) -> None:
        """Push the expiry forward; LeaseLost if another driver took the lease over.

        A beat whose precondition failed reads the lease: still this driver's (by its token) it
        is a beat of ours that landed late or lost its answer, and is beaten again from there;
        only another driver's token (or no lease at all) means the lease was lost."""
        if self.tag is None:
            raise LeaseLost(f"{self.url}: this driver does not hold the lease")
        for _ in range(3):  # each retry follows a late write of this driver's own
            tag = self.storage.replace_if_tag(LEASE_KEY, self._record(), self.tag)
            if tag is not None:
                self.tag = tag
                return
            current = self._read()
            if current is None or not self._ours(current[0]):
                self.tag = None
                holder = describe_holder(current[0]) if current else "nobody (it was removed)"
                raise LeaseLost(f"the lease {self.url} was taken over; it is now held by {holder}")
            self.tag = current[1]
        raise StorageError(f"{self.url}: the lease kept changing under this driver's own heartbeat")

    def release(self) -> bool:
        """Give the lease up (only a version this process wrote); whether it is gone."""
        self.stop_heartbeat()
        if self.tag is None:
            return False
        deleted = self.storage.delete_if_tag(LEASE_KEY, self.tag)
        if not deleted:  # a beat of ours that landed after its answer was lost changed the tag
            current = self._read()
            if current is not None and self._ours(current[0]):
                deleted = self.storage.delete_if_tag(LEASE_KEY, current[1])
        self.tag = None
        return deleted

    def start_heartbeat(self, on_error: Callable[[Exception], None]) -> None:
        """Heartbeat from a daemon thread. Storage trouble is retried until the next beat;
        ``on_error`` gets a LeaseLost (and the beats end) or each storage error."""

        def beat():
            wait = self.beat_every_s
            while not self._stop.wait(wait):
                wait = self.beat_every_s
                try:
                    self.heartbeat()
                except LeaseLost as err:
                    on_error(err)
                    return
                except StorageError as err:
                    on_error(err)
                    # Soon again: a watching driver must see this live holder beat once the
                    # storage is back.
                    wait = min(RETRY_BEAT_S, self.beat_every_s)

        self._thread = threading.Thread(target=beat, name="run-lease", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = None


# The lease token of the driver that starts a job: set in the driver's environment when it takes
# the lease, so every job it starts (locally, or through sbatch, which passes the environment on)
# knows which driver it works for.
DRIVER_TOKEN_ENV = "DFLASH_RUN_LEASE_TOKEN"


class DriverGone(RuntimeError):
    """The driver that started this job no longer drives the run; the job stops, keeping what it
    saved, and the next driver's run resumes from there."""


def driver_problem(storage: Storage, token: str, now: float | None = None, host: str | None = None) -> str | None:
    """Why the driver holding lease ``token`` no longer drives the run (None while it does):
    the lease is gone, was taken over by another driver, or is stale (expired, or held by a
    process of this host that no longer exists: a killed driver)."""
    record = read_lease(storage)
    if record is None:
        return "the run lease is gone (its driver ended, or the lease was broken)"
    owner = record.get("owner") or {}
    if owner.get("token") != token:
        return f"another driver took the run over: {describe_holder(record)}"
    if is_stale(record, time.time() if now is None else now, host) and not _alive_here(owner, host):
        return f"its driver is gone: {describe_holder(record)}"
    return None


def _alive_here(owner: dict, host: str | None) -> bool:
    """Whether the lease's holder is a live process of this host: its lease expired only because
    a storage outage longer than the lease kept its heartbeats out (it beats once storage is back)."""
    try:
        here = socket.gethostname() if host is None else host
        return owner["host"] == here and process_alive(int(owner["pid"]), owner.get("process_start"))
    except (KeyError, TypeError, ValueError):
        return False


def raise_if_driverless(storage: Storage, job: str) -> None:
    """DriverGone when this job's driver (``DRIVER_TOKEN_ENV``) no longer drives the run; nothing
    when the job was started without a lease (lease.enabled false, or by hand)."""
    token = os.environ.get(DRIVER_TOKEN_ENV)
    if not token:
        return
    problem = driver_problem(storage, token)
    if problem:
        raise DriverGone(f"{job} stopped: {problem}. What it finished is saved; run the workflow again to resume")


def read_lease(storage: Storage) -> dict | None:
    current = storage.read_tagged(LEASE_KEY)
    if current is None:
        return None
    try:
        record = json.loads(current[0])
    except ValueError:
        return {"unreadable": current[0][:200].decode("utf-8", "replace")}
    return record if isinstance(record, dict) else {"unreadable": repr(record)[:200]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.core.lease", description="Show or break a run's lease."
    )
    parser.add_argument("action", choices=["show", "break"])
    parser.add_argument("--run-url", required=True, help="the run root (local folder or s3:// URL)")
    args = parser.parse_args(argv)
    storage = open_storage(args.run_url)
    record = read_lease(storage)
    if record is None:
        print(f"{storage.join(LEASE_KEY)}: no lease (no driver runs this run)")
        return 0
    print(f"{storage.join(LEASE_KEY)}: held by {describe_holder(record)}")
    if args.action == "break":
        storage.delete(LEASE_KEY)
        print("lease removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
