"""The benchmarks' shared helper (bench/benchlib.py): a measured run that failed ends the
benchmark with a non-zero exit and no figure written."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import benchlib  # noqa: E402


def measure(out, checks: dict[str, bool]) -> None:
    """A benchmark's end: its checks, then its record."""
    benchlib.require_success(checks, "last lines of the failed run")
    benchlib.emit({"benchmark": "x", "seconds": 1.0}, str(out))


def test_a_failed_measured_run_exits_non_zero_and_writes_no_figure(tmp_path, capsys):
    out = tmp_path / "record.json"
    with pytest.raises(SystemExit) as ended:
        measure(out, {"snakemake -n exits 0": False, "nothing to do": True, "plans the chains": False})
    assert ended.value.code == 1
    assert not out.exists()
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing printed as a figure either
    assert "benchmark failed, no figure written: snakemake -n exits 0, plans the chains" in captured.err
    assert "last lines of the failed run" in captured.err
    measure(out, {"snakemake -n exits 0": True})
    assert out.exists()
