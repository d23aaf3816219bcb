"""Storage outages are ridden out (dflash_pipeline.core.outage): the backoff schedule step by
step (no sleeping), which failures are retried, and SeaweedFS stopped for longer than the old
retry count tolerated while jobs' storage calls, a lease heartbeat and a log upload are under way."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time

import pytest

from dflash_pipeline.core.outage import Outage, StorageOutage, backoff_delay, outage_tolerance_s, transient_error
from tests.conftest import REPO


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_backoff_doubles_to_a_minute_and_gives_up_at_the_tolerance(caplog):
    clock = FakeClock()
    outage = Outage(
        "s3://b/run/x.json",
        "http://s3.example:9000",
        tolerance_s=200,
        clock=clock,
        wall=lambda: 0.0,
        jitter=lambda: 1.0,
    )
    delays = []
    with caplog.at_level("WARNING", logger="dflash_pipeline.storage"), pytest.raises(StorageOutage) as failure:
        while True:
            delay = outage.next_delay("PutObject EndpointConnectionError")
            delays.append(delay)
            clock.now += delay  # the sleep, injected
    # 1, 2, 4 ... 32, then a minute a try; the last wait ends exactly at the tolerance.
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 17]
    assert clock.now == 200
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == len(delays)  # one warning per try
    assert messages[0] == (
        "storage s3://b/run/x.json unreachable (PutObject EndpointConnectionError); "
        "retry 1 in 1 s, giving up after 200 s of outage"
    )
    assert "retry 9 in 17 s" in messages[-1]
    text = str(failure.value)
    for part in ("since 1970-01-01T00:00:00Z", "(200 s, 10 tries", "http://s3.example:9000", "s3://b/run/x.json"):
        assert part in text, text


def test_the_jitter_shortens_a_wait_by_at_most_half():
    assert backoff_delay(1) == 1 and backoff_delay(3) == 4 and backoff_delay(30) == 60
    assert backoff_delay(7, rand=0.5) == 30


def test_the_tolerance_comes_from_the_environment():
    assert outage_tolerance_s({}) == 900
    assert outage_tolerance_s({"DFLASH_STORAGE_OUTAGE_TOLERANCE_S": "60"}) == 60
    zero = Outage("s3://b/k", "e", tolerance_s=0, clock=FakeClock())
    with pytest.raises(StorageOutage):
        zero.next_delay("ReadTimeoutError")  # no tolerance: the first failure is final


def test_the_read_timeout_comes_from_the_environment(monkeypatch):
    from dflash_pipeline.core.s3 import READ_TIMEOUT_ENV, s3_client
    from dflash_pipeline.core.storage_api import StorageError

    monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv(READ_TIMEOUT_ENV, raising=False)
    assert s3_client().meta.config.read_timeout == 60  # botocore's
    monkeypatch.setenv(READ_TIMEOUT_ENV, "5")
    assert s3_client().meta.config.read_timeout == 5
    monkeypatch.setenv(READ_TIMEOUT_ENV, "soon")
    with pytest.raises(StorageError, match=f"^{READ_TIMEOUT_ENV}='soon' is not a positive number of seconds$"):
        s3_client()


def test_connection_errors_5xx_and_throttling_are_retried_4xx_answers_are_not():
    from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

    def answer(status, code=""):
        return (None, {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}})

    assert transient_error(EndpointConnectionError(endpoint_url="http://x"), None) == "EndpointConnectionError"
    assert transient_error(ReadTimeoutError(endpoint_url="http://x"), None)
    assert transient_error(None, answer(503, "ServiceUnavailable")) == "HTTP 503 ServiceUnavailable"
    assert transient_error(None, answer(500, "InternalError"))
    assert transient_error(None, answer(429))
    assert transient_error(None, answer(503, "SlowDown"))
    assert transient_error(None, answer(400, "RequestTimeout"))
    for status, code in (
        (404, "NoSuchKey"),
        (403, "AccessDenied"),
        (412, "PreconditionFailed"),
        (400, "InvalidRequest"),
    ):
        assert transient_error(None, answer(status, code)) is None, code
    assert transient_error(None, answer(200)) is None
    assert transient_error(ValueError("a bug"), None) is None


def test_a_missing_key_or_a_refused_access_fails_at_once(s3_server, s3_env, monkeypatch, caplog):
    from dflash_pipeline.core.s3 import S3Storage
    from dflash_pipeline.core.storage import NotFound, StorageError

    store = S3Storage(f"s3://{s3_server.bucket}/outage-4xx")
    with caplog.at_level("WARNING", logger="dflash_pipeline.storage"):
        with pytest.raises(NotFound), counted_requests(store.client) as sent:
            store.read_bytes("missing.json")
        assert sent == ["GetObject"]
        monkeypatch.setenv("SNAKEMAKE_STORAGE_S3_SECRET_KEY", "wrong")
        refused = S3Storage(f"s3://{s3_server.bucket}/outage-4xx")
        with pytest.raises(StorageError, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId"):
            with counted_requests(refused.client) as sent:
                refused.write_bytes("x.json", b"{}")
        assert sent == ["PutObject"]
    assert not caplog.records  # no retry, no warning


@contextlib.contextmanager
def counted_requests(client):
    """The name of every HTTP request a boto3 client sends in the block, retries included."""
    sent = []

    def note(request, **kwargs):
        sent.append(kwargs["event_name"].rsplit(".", 1)[-1])

    client.meta.events.register("before-send", note)
    try:
        yield sent
    finally:
        client.meta.events.unregister("before-send", note)


# A job's storage calls in a child process, configured only by its environment (as a job is): a
# lease heartbeat, object writes, reads and file uploads, one per step, PROGRESS counting steps.
CHILD = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from dflash_pipeline.core.lease import RunLease
    from dflash_pipeline.core.storage import open_storage

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    url, progress, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    store = open_storage(url)
    lease = RunLease(store, ttl_s=600).acquire()
    log = progress.with_name("attempt.log")
    for i in range(steps):
        store.write_bytes(f"parts/{i:03d}.json", str(i).encode())
        assert store.read_bytes(f"parts/{i:03d}.json") == str(i).encode()
        lease.heartbeat()
        log.write_text(f"step {i}\\n")
        store.upload_file(f"logs/{i:03d}.log", log)
        progress.write_text(str(i + 1))
        if i == 2:
            sys.stdin.readline()  # held until the test has stopped the server
    assert lease.release()
    print(" ".join(o.key for o in store.list("parts/")))
    """
)

OUTAGE_S = 25


def test_a_storage_outage_longer_than_the_old_retries_is_ridden_out(tmp_path):
    """SeaweedFS stopped for 25 s while a job's storage calls run. The old retry count of this
    configuration (DFLASH_S3_MAX_ATTEMPTS=4: botocore's backoff of at most 1+2+4+8 s) gave up
    after at most 15 s; with the outage tolerance at 60 s every call waits the outage out, each
    try said, and every object is there once."""
    from tests.support.seaweed import start_seaweed
    from tests.support.waiting import wait_until

    server = start_seaweed(tmp_path / "weed")  # its own server: the session's stays up
    progress = tmp_path / "progress"
    try:
        env = {
            **__import__("os").environ,
            **server.env,
            "DFLASH_S3_MAX_ATTEMPTS": "4",
            "DFLASH_STORAGE_OUTAGE_TOLERANCE_S": "60",
        }
        url = f"s3://{server.bucket}/outage-run"
        steps = 24
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(progress), str(steps)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(lambda: progress.is_file() and progress.read_text() == "3", 300, "three steps")
            server.stop()
            # The job's next calls come once the storage is gone, however fast the machine.
            child.stdin.write("go on\n")
            child.stdin.flush()
            stopped = time.monotonic()
            time.sleep(OUTAGE_S)  # the outage itself (a fault injected, not a wait for a result)
            server.start_again()
            out, err = child.communicate(timeout=120)
            waited = time.monotonic() - stopped
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 0, err[-3000:]
        assert waited >= OUTAGE_S
        assert out.split() == [f"parts/{i:03d}.json" for i in range(steps)]  # every object, once
        warnings = [line for line in err.splitlines() if "unreachable (" in line]
        assert warnings and "retry 1 in 1 s, giving up after 60 s of outage" in warnings[0], err[-3000:]
        assert any("retry 5 in" in line for line in warnings), warnings  # rode past the old limit
    finally:
        server.stop()


def test_a_live_driver_whose_lease_expired_in_an_outage_still_drives_the_run(tmp_path):
    """An outage longer than lease.ttl_s keeps the heartbeats out; the jobs of a live driver of
    this host keep working, and it beats again once the storage is back."""
    from dflash_pipeline.core.lease import RunLease, driver_problem
    from dflash_pipeline.core.storage import open_storage

    store = open_storage(tmp_path)
    lease = RunLease(store, ttl_s=60).acquire()
    after_outage = time.time() + 15 * 60
    assert driver_problem(store, lease.owner["token"], now=after_outage) is None
    elsewhere = driver_problem(store, lease.owner["token"], now=after_outage, host="another-host")
    assert elsewhere.startswith("its driver is gone")
    lease.release()


def test_the_s3_plugin_rides_out_outages_too(monkeypatch):
    """The driver's S3 plugin (its existence checks, uploads of declared outputs and logs) gets
    the same handler: an unreachable endpoint is retried, then fails naming the outage."""
    import types

    import boto3
    import snakemake_storage_plugin_s3 as plugin

    from dflash_pipeline.snakemake_patches.storage_outage import ride_out_plugin_outages
    from tests.support.seaweed import free_port

    monkeypatch.setenv("DFLASH_STORAGE_OUTAGE_TOLERANCE_S", "1")
    provider = object.__new__(plugin.StorageProvider)  # as the registry holds it, settings aside
    provider.s3c = boto3.resource(
        "s3",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        aws_access_key_id="k",
        aws_secret_access_key="s",
        region_name="us-east-1",
        config=boto3.session.Config(retries={"max_attempts": 15, "mode": "standard"}),  # the profile's
    )
    assert ride_out_plugin_outages(types.SimpleNamespace(_storages={"s3": provider})) == 1
    with pytest.raises(StorageOutage, match=r"s3://b/k unreachable since .*gave up after the outage tolerance of 1 s"):
        with counted_requests(provider.s3c.meta.client) as sent:
            provider.s3c.meta.client.head_object(Bucket="b", Key="k")
    assert 1 < len(sent) < 15, sent  # retried, and the tolerance, not the plugin's 15 attempts, decides


def test_a_changed_s3_plugin_turns_the_outage_patch_off_with_a_warning():
    """Simulated drift: another plugin release's provider set-up. The patch stays off (the
    provider is the plugin's own), named in one warning with the function that changed."""
    script = (
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "import snakemake_storage_plugin_s3 as plugin\n"
        "def __post_init__(self):\n"
        "    pass  # a release that makes its client differently\n"
        "plugin.StorageProvider.__post_init__ = __post_init__\n"
        "from dflash_pipeline.snakemake_patches.storage_outage import ride_out_plugin_outages\n"
        "print(ride_out_plugin_outages(), plugin.StorageProvider.__post_init__ is __post_init__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    assert proc.stdout.splitlines() == ["0 True"], proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "is off" in line]
    assert len(warnings) == 1, proc.stderr
    assert "snakemake patch 'S3 plugin rides out storage outages' is off" in warnings[0]
    assert "snakemake_storage_plugin_s3:StorageProvider.__post_init__" in warnings[0]
