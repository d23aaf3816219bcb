"""The run lease on a local folder and on a real S3 server (SeaweedFS): one holder, a second
driver refused with the holder's name, stale leases taken over, release by the holder only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

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


def test_a_conditional_call_repeated_after_it_landed_answers_as_the_first(store):
    """A retry of a request whose answer was lost finds its own write in place (412 against its
    own version, 404 on what it deleted): the storage decides from what is stored."""
    tag = store.create_if_absent("k.json", b"one")
    assert store.create_if_absent("k.json", b"one") == tag
    new = store.replace_if_tag("k.json", b"two", tag)
    assert store.replace_if_tag("k.json", b"two", tag) == new
    assert store.replace_if_tag("k.json", b"three", tag) is None  # another version: not ours
    assert store.delete_if_tag("k.json", new) is True
    assert store.delete_if_tag("k.json", new) is True  # gone: the delete took effect


def _losing_answers(storage):
    """Make every PutObject/DeleteObject of ``storage``'s client land on the server, then lose
    its answer once, as a client timeout does while the server stalls: botocore sends the same
    request again, which then fails its own precondition."""
    lost = []

    def lose(response=None, caught_exception=None, operation=None, request_dict=None, **_):
        if caught_exception is None and operation.name in ("PutObject", "DeleteObject"):
            context = request_dict.setdefault("context", {})
            if not context.get("answer_lost"):
                context["answer_lost"] = True
                lost.append(operation.name)
                return 0  # retry at once
        return None

    storage.client.meta.events.register_first("needs-retry.s3", lose)
    return lost


def test_lease_writes_that_landed_with_their_answers_lost_are_the_drivers_own(s3_server, s3_env):
    from dflash_pipeline.core.s3 import S3Storage, s3_client

    # A client of its own (the shared one serves the rest of the session).
    storage = S3Storage(f"s3://{s3_server.bucket}/lost-{uuid.uuid4().hex[:8]}", client=s3_client(read_timeout=30))
    lost = _losing_answers(storage)
    lease = RunLease(storage, ttl_s=60).acquire()
    lease.heartbeat()
    lease.heartbeat()
    assert read_lease(storage)["owner"]["token"] == lease.owner["token"]
    assert lease.release() is True
    assert read_lease(storage) is None
    assert lost == ["PutObject", "PutObject", "PutObject", "DeleteObject"]  # each op retried once


@pytest.mark.parametrize("operation", ["acquire", "heartbeat", "release"])
def test_a_lease_write_timed_out_on_a_stalled_server_is_recognised_as_ours(s3_server, s3_env, operation):
    """The S3 server freezes (SIGSTOP, as a stalled gateway does) while a lease write is in
    flight: the client times out and retries, the server comes back and takes the timed-out
    write and then the retry, whose precondition fails against that write. The driver keeps its
    lease (acquire, heartbeat) or gives it up (release), never "taken over by" itself."""
    import logging
    import signal

    from dflash_pipeline.core.s3 import S3Storage, s3_client

    # A read timeout of 1 s stands for botocore's 60: what matters is that it passes while the
    # server is frozen with the request in its socket.
    client = s3_client(connect_timeout=1, read_timeout=1)
    storage = S3Storage(f"s3://{s3_server.bucket}/stall-{uuid.uuid4().hex[:8]}", client=client)
    lease = RunLease(storage, ttl_s=60)
    if operation != "acquire":
        lease.acquire()

    timed_out = threading.Event()

    class Retried(logging.Handler):  # outage.ride_out warns once per failed try
        def emit(self, record):
            timed_out.set()

    handler = Retried(logging.WARNING)
    logging.getLogger("dflash_pipeline.storage").addHandler(handler)
    outcome = {}

    def run():
        try:
            outcome["result"] = getattr(lease, operation)()
        except Exception as err:  # reported by the assertion below
            outcome["error"] = err

    worker = threading.Thread(target=run)
    os.kill(s3_server.process.pid, signal.SIGSTOP)
    try:
        worker.start()
        assert timed_out.wait(120), "the client never timed out against the frozen server"
    finally:
        os.kill(s3_server.process.pid, signal.SIGCONT)
        logging.getLogger("dflash_pipeline.storage").removeHandler(handler)
    worker.join(300)
    assert "error" not in outcome, outcome.get("error")
    stored = read_lease(storage)
    if operation == "release":
        assert outcome["result"] is True and stored is None
    else:
        assert stored["owner"]["token"] == lease.owner["token"]
        assert storage.read_tagged(LEASE_KEY)[1] == lease.tag
        lease.heartbeat()  # and it goes on beating from the version it found
        assert lease.release() is True
