"""CI (``CI=true``, set by .ci/run) installs everything the suite needs but a CUDA device: there a
missing tool fails its test instead of skipping it, so nothing is skipped without notice."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def skip_unless_ci(message: str) -> None:
    """Skip with ``message``, or fail with it in CI."""
    if in_ci():
        pytest.fail(f"{message} (CI=true: .ci/run installs it, so this test must run)")
    pytest.skip(message)
