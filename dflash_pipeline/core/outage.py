"""Riding out storage outages: the one retry policy of the package's storage calls.

An S3 endpoint that is down for minutes (maintenance, a failing gateway) is ordinary, and a run
of days must not end with it. Every S3 request of the jobs' storage layer, of the run lease's
heartbeat, of the attempt-log uploads and of the Snakemake S3 plugin (in the driver and in each
job) goes through ``ride_out``, installed on its boto client (``install``): a transient failure
(no connection, a timeout, HTTP 5xx, throttling) is tried again with bounded exponential backoff
until the storage answers or the outage has lasted ``outage_tolerance_s`` (the config key
``storage.outage_tolerance_s``, default 900 s, which the driver hands to its jobs through
``DFLASH_STORAGE_OUTAGE_TOLERANCE_S``); each try is one warning, and giving up is one
``StorageOutage`` naming when the outage started, how long it lasted and the endpoint. Answers
that retrying cannot change (NoSuchKey, AccessDenied, a failed precondition) are never retried.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash_pipeline.core.storage_api import StorageError

OUTAGE_TOLERANCE_ENV = "DFLASH_STORAGE_OUTAGE_TOLERANCE_S"
DEFAULT_OUTAGE_TOLERANCE_S = 900.0
# The first retry comes soon (a dropped connection is often alone); the wait doubles up to a
# minute, so a long outage costs one request per endpoint and process a minute, not a storm.
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 60.0

# Error codes S3 (and compatible servers) answer while overloaded: worth another try.
TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "SlowDown",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
    }
)

log = logging.getLogger("dflash_pipeline.storage")


class StorageOutage(StorageError):
    """The storage stayed unreachable for longer than the outage tolerance."""


def outage_tolerance_s(env: dict[str, str] | None = None) -> float:
    """Seconds of outage a storage call rides out (``DFLASH_STORAGE_OUTAGE_TOLERANCE_S``, set by
    the driver from ``storage.outage_tolerance_s``; 900 when unset)."""
    env = os.environ if env is None else env
    value = env.get(OUTAGE_TOLERANCE_ENV) or ""
    try:
        return max(0.0, float(value)) if value else DEFAULT_OUTAGE_TOLERANCE_S
    except ValueError:
        raise StorageError(f"{OUTAGE_TOLERANCE_ENV}={value!r} is not a number of seconds") from None


def backoff_delay(retry: int, rand: float = 1.0) -> float:
    """The wait before retry number ``retry`` (1, 2, ...): 1, 2, 4, ... s up to a minute, times
    ``rand`` in [0.5, 1] (jitter: the jobs of a run do not all come back in the same second)."""
    return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (retry - 1)) * rand


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@dataclass
class Outage:
    """One request's run of failed tries: ``next_delay`` says how long to wait before the next
    try, or raises ``StorageOutage`` once the outage has lasted the tolerance. The clock, the
    wall clock and the jitter are injectable (tests step through the schedule without sleeping)."""

    where: str  # what the warnings name: the object's URL, or the endpoint
    endpoint: str
    tolerance_s: float = field(default_factory=outage_tolerance_s)
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    jitter: Callable[[], float] = field(default=lambda: random.uniform(0.5, 1.0))
    retries: int = 0
    started: float | None = None
    started_at: float | None = None

    def next_delay(self, error: str) -> float:
        now = self.clock()
        if self.started is None:
            self.started, self.started_at = now, self.wall()
        elapsed = now - self.started
        left = self.tolerance_s - elapsed
        if left <= 0:
            raise StorageOutage(
                f"storage {self.where} unreachable since {_utc(self.started_at)} ({elapsed:.0f} s, "
                f"{self.retries + 1} tries; last: {error}) at endpoint {self.endpoint}: gave up after "
                f"the outage tolerance of {self.tolerance_s:.0f} s (storage.outage_tolerance_s)"
            )
        self.retries += 1
        delay = min(backoff_delay(self.retries, self.jitter()), left)
        log.warning(
            "storage %s unreachable (%s); retry %d in %.0f s, giving up after %.0f s of outage",
            self.where, error, self.retries, delay, self.tolerance_s,
        )  # fmt: skip
        return delay


def transient_error(caught_exception: BaseException | None, response) -> str | None:
    """How a failed try reads in a warning when it is worth another try (no connection, a
    timeout, HTTP 5xx or 429, a throttling code); None for an answer retrying cannot change."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    if caught_exception is not None:
        if isinstance(caught_exception, (BotoConnectionError, HTTPClientError)):
            return type(caught_exception).__name__  # its message repeats the URL
        return None
    if not response:
        return None
    parsed = response[1] or {}
    status = parsed.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    code = parsed.get("Error", {}).get("Code", "")
    if status >= 500 or status == 429 or code in TRANSIENT_CODES:
        return f"HTTP {status}{' ' + code if code else ''}"
    return None


def _where(request_dict: dict | None, endpoint: str) -> str:
    """``s3://bucket/key`` of a request where botocore's context names them, else the endpoint."""
    params = ((request_dict or {}).get("context") or {}).get("input_params") or {}
    bucket = params.get("Bucket")
    if not bucket:
        return endpoint
    key = params.get("Key") or params.get("Prefix") or ""
    return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"


def ride_out(storage_endpoint: str, caught_exception=None, response=None, request_dict=None, operation=None, **_):
    """botocore's ``needs-retry`` handler: the seconds to wait before the next try of a
    transient failure, None for anything else (botocore then returns or raises it as it is).
    The outage is the request's own (kept in its context across its tries)."""
    error = transient_error(caught_exception, response)
    if error is None:
        return None
    context = (request_dict or {}).setdefault("context", {})
    outage = context.get("dflash_outage")
    if outage is None:
        where = _where(request_dict, storage_endpoint)
        outage = context["dflash_outage"] = Outage(where, storage_endpoint)
    name = getattr(operation, "name", None)
    return outage.next_delay(f"{name} {error}" if name else error)


def install(client) -> None:
    """Ride out outages on every request of the boto S3 ``client`` (idempotent). First among
    the ``needs-retry`` handlers, so its answer is the one botocore acts on whatever retry
    count the client was configured with (the plugin's ``storage-s3-retries``)."""
    import functools

    if getattr(client.meta, "dflash_outage_retries", False):
        return
    url = client.meta.endpoint_url or ""
    endpoint = "AWS S3" if url.endswith(".amazonaws.com") else url
    client.meta.events.register_first("needs-retry.s3", functools.partial(ride_out, endpoint))
    client.meta.dflash_outage_retries = True
