"""The run lease on a local folder and on a real S3 server (SeaweedFS): one holder, a second
driver refused with the holder's name, stale leases taken over, release by the holder only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from dflash_pipeline.core.lease import (
    LEASE_KEY,
    LeaseHeld,
    LeaseLost,
    RunLease,
    is_stale,
    main as lease_cli,
    read_lease,
)
from dflash_pipeline.core.storage import StorageError, open_storage


class FakeClock:
    """A clock the test moves by hand: expiry is tested without waiting."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_conditional_writes(store):
    tag = store.create_if_absent("k.json", b"one")
    assert tag is not None
    assert store.create_if_absent("k.json", b"two") is None
    assert store.read_tagged("k.json") == (b"one", tag)
    assert store.replace_if_tag("k.json", b"three", "wrong-tag") is None
    new = store.replace_if_tag("k.json", b"three", tag)
    assert new is not None and new != tag
    assert store.delete_if_tag("k.json", tag) is False
    assert store.read_bytes("k.json") == b"three"
    assert store.delete_if_tag("k.json", new) is True
    assert store.read_tagged("k.json") is None
    assert store.replace_if_tag("k.json", b"x", new) is None
    assert [o.key for o in store.list()] == []  # lock files never show in listings


def test_second_driver_is_refused_with_the_holders_name(store):
    first = RunLease(store, ttl_s=60, host="node-a", pid=os.getpid()).acquire()
    with pytest.raises(LeaseHeld) as err:
        RunLease(store, ttl_s=60, host="node-b").acquire()
    message = str(err.value)
    assert "node-a" in message and f"pid {os.getpid()}" in message
    assert store.url in message and "lease break" in message
    assert read_lease(store)["owner"]["token"] == first.owner["token"]


def test_only_one_of_many_simultaneous_drivers_wins(store):
    winners, refused = [], []

    def start(i):
        lease = RunLease(store, ttl_s=60, host=f"node-{i}")
        try:
            winners.append(lease.acquire())
        except LeaseHeld:
            refused.append(i)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1 and len(refused) == 5
    assert read_lease(store)["owner"]["token"] == winners[0].owner["token"]


def test_expired_lease_is_taken_over_and_the_old_holder_finds_out(store):
    clock = FakeClock()
    old = RunLease(store, ttl_s=60, host="node-a", clock=clock).acquire()
    clock.now += 30
    old.heartbeat()  # pushes the expiry to now + 60

    def old_beats_while_watched(seconds):
        clock.now += seconds
        old.heartbeat()

    clock.now += 59
    # Overdue (beats are due every 15 s), so node-b watches; node-a beats: alive, refused.
    with pytest.raises(LeaseHeld):
        RunLease(store, ttl_s=60, host="node-b", clock=clock, sleep=old_beats_while_watched).acquire()
    clock.now += 61  # past the expiry: stale, taken over without watching
    new = RunLease(store, ttl_s=60, host="node-b", clock=clock, sleep=_no_sleep).acquire()
    assert new.took_over["owner"]["host"] == "node-a"
    assert new.takeover_reason.startswith("expired")
    with pytest.raises(LeaseLost, match="node-b"):
        old.heartbeat()
    assert old.release() is False  # the old holder cannot delete the new holder's lease
    assert read_lease(store)["owner"]["host"] == "node-b"
    assert new.release() is True
    assert read_lease(store) is None


def _no_sleep(seconds):
    raise AssertionError(f"the driver watched the lease ({seconds} s) where it needed not")


def test_a_holder_whose_heartbeat_stopped_is_taken_over_before_its_expiry(store):
    """A driver on another host that died (say, of a storage outage) stops beating: a new
    driver that finds its beat overdue watches one beat interval, sees no beat and takes over,
    long before the lease's expiry; a holder with a recent beat is refused without a watch."""
    clock = FakeClock()
    dead = RunLease(store, ttl_s=300, host="node-a", clock=clock).acquire()
    clock.now += 10  # a recent beat: refused at once (no watch)
    with pytest.raises(LeaseHeld):
        RunLease(store, ttl_s=300, host="node-b", clock=clock, sleep=_no_sleep).acquire()
    clock.now += 81  # the beat due at 75 s never came (nor within the grace)
    watched = []

    def watch(seconds):
        watched.append(seconds)
        clock.now += seconds

    new = RunLease(store, ttl_s=300, host="node-b", clock=clock, sleep=watch).acquire()
    assert watched == [75 + 15]  # one beat interval and the grace
    assert clock.now - dead.owner["started_at"] <= 181 < 300  # its last beat + 2 x (75 + 15), not + 300
    assert new.took_over["owner"]["host"] == "node-a"
    assert "heartbeat stopped" in new.takeover_reason
    with pytest.raises(LeaseLost):
        dead.heartbeat()  # had it been alive after all, it finds out at its next beat


def test_a_failed_heartbeat_is_retried_within_seconds(store):
    """After a beat fails (storage unreachable) the next one comes within RETRY_BEAT_S, not a
    whole interval later, so a watching driver sees a live holder beat once storage is back."""
    from dflash_pipeline.core.lease import RETRY_BEAT_S

    lease = RunLease(store, ttl_s=400).acquire()  # beats every 100 s
    outcomes = iter([StorageError("storage unreachable"), None, None])

    def heartbeat():
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    class Waits:  # the heartbeat thread's timer, recorded instead of waited
        seen: list[float] = []

        def wait(self, timeout):
            self.seen.append(timeout)
            return len(self.seen) > 3  # three beats, then stop

        def set(self):
            pass

    lease.heartbeat, lease._stop = heartbeat, Waits()
    errors = []
    lease.start_heartbeat(errors.append)
    lease._thread.join(30)
    assert Waits.seen == [100, RETRY_BEAT_S, 100, 100]
    assert [str(e) for e in errors] == ["storage unreachable"]


def test_lease_of_a_dead_local_process_is_stale_at_once(store):
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(proc.stdout)
    RunLease(store, ttl_s=3600, pid=dead_pid).acquire()  # this host, a process that has exited
    lease = RunLease(store, ttl_s=3600).acquire()
    assert lease.took_over["owner"]["pid"] == dead_pid


def test_is_stale_rules():
    now = 1000.0
    live = {"owner": {"host": "elsewhere", "pid": 1}, "expires_at": now + 1}
    assert not is_stale(live, now, host="here")
    assert is_stale({**live, "expires_at": now}, now, host="here")
    assert is_stale({"not": "a lease"}, now, host="here")
    mine_alive = {"owner": {"host": "here", "pid": os.getpid()}, "expires_at": now + 1}
    assert not is_stale(mine_alive, now, host="here")


def test_damaged_lease_object_is_taken_over(store):
    store.write_bytes(LEASE_KEY, b"{not json")
    lease = RunLease(store, ttl_s=60).acquire()
    assert lease.took_over == {}


def test_heartbeat_thread_keeps_the_lease_and_release_stops_it(store):
    lease = RunLease(store, ttl_s=0.4).acquire()
    first = read_lease(store)["heartbeat_at"]
    errors = []
    beat = threading.Event()
    original = lease.heartbeat

    def counting():
        original()
        beat.set()

    lease.heartbeat = counting
    lease.start_heartbeat(errors.append)
    assert beat.wait(60)
    assert read_lease(store)["heartbeat_at"] > first
    assert lease.release() is True
    assert errors == [] and read_lease(store) is None


def test_cli_show_and_break(store, capsys):
    assert lease_cli(["show", "--run-url", store.url]) == 0
    assert "no lease" in capsys.readouterr().out
    RunLease(store, ttl_s=60, host="node-z").acquire()
    lease_cli(["show", "--run-url", store.url])
    assert "node-z" in capsys.readouterr().out
    lease_cli(["break", "--run-url", store.url])
    assert "removed" in capsys.readouterr().out
    assert read_lease(store) is None


def test_ttl_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="ttl_s"):
        RunLease(open_storage(tmp_path), ttl_s=0)


def test_lease_record_names_the_owner(store):
    lease = RunLease(store, ttl_s=60).acquire()
    record = json.loads(store.read_bytes(LEASE_KEY))
    assert record["owner"]["pid"] == os.getpid()
    assert record["expires_at"] == pytest.approx(record["heartbeat_at"] + 60)
    lease.release()


def test_a_job_knows_when_its_driver_no_longer_drives_the_run(store, monkeypatch):
    from dflash_pipeline.core.lease import DRIVER_TOKEN_ENV, DriverGone, driver_problem, raise_if_driverless

    lease = RunLease(store, ttl_s=60).acquire()
    token = lease.owner["token"]
    assert driver_problem(store, token) is None
    assert "another driver took the run over" in driver_problem(store, "someone-else")
    # The holder is a process of this host that no longer exists: a SIGKILLed driver.
    dead = RunLease(store, ttl_s=60, pid=2**22 + 17)
    store.write_bytes(LEASE_KEY, dead._record())
    assert driver_problem(store, dead.owner["token"]).startswith("its driver is gone")
    store.delete(LEASE_KEY)
    assert "the run lease is gone" in driver_problem(store, token)
    monkeypatch.setenv(DRIVER_TOKEN_ENV, token)
    with pytest.raises(DriverGone, match=r"^generate shard 00001 stopped: the run lease is gone.*resume"):
        raise_if_driverless(store, "generate shard 00001")
    monkeypatch.delenv(DRIVER_TOKEN_ENV)
    raise_if_driverless(store, "generate shard 00001")  # started by hand, without a lease: no check
