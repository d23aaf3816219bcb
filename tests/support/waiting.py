"""Waiting in tests for something another process does: never a speed requirement, only a guard
against waiting forever (the timeout is generous and the message says what never happened)."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, what: str, poll_s: float = 0.2) -> None:
    """Return once ``predicate()`` is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
