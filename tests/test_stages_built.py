"""Which stages a run builds (dflash_pipeline.core.layout.stages_built): the one answer the rules,
the preflight, verify, the status page and the report read, for each shape of config."""

from __future__ import annotations

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config


def built(**config) -> tuple[str, ...]:
    return layout.stages_built(validate_config(config))


NO_TUNE = {"tune": {"enabled": False}}


@pytest.mark.parametrize(
    ("until", "stages"),
    [
        ("prepare", ("prepare",)),
        ("generate", ("prepare", "generate")),
        ("tokenize", ("prepare", "generate", "tokenize")),
        ("train", ("prepare", "generate", "tokenize", "train")),
        ("evaluate", ("prepare", "generate", "tokenize", "train", "evaluate")),
    ],
)
def test_an_online_run_without_tune_builds_the_stages_up_to_until(until, stages):
    assert built(until=until, **NO_TUNE) == stages


@pytest.mark.parametrize(
    ("until", "extracts"),
    [("prepare", False), ("generate", False), ("tokenize", False), ("train", True), ("evaluate", True)],
)
def test_offline_training_adds_extract_before_train_where_the_run_trains(until, extracts):
    stages = built(until=until, train={"mode": "offline"}, **NO_TUNE)
    assert ("extract" in stages) == extracts
    if extracts:
        assert stages[stages.index("extract") + 1] == "train"
    assert "extract" not in built(until=until, train={"mode": "online"}, **NO_TUNE)


@pytest.mark.parametrize(
    ("until", "tunes"),
    [("prepare", False), ("generate", True), ("tokenize", True), ("train", True), ("evaluate", True)],
)
def test_tune_comes_before_generate_where_the_run_generates_with_a_server_it_launches(until, tunes):
    stages = built(until=until, tune={"enabled": True})
    assert ("tune" in stages) == tunes
    if tunes:
        assert stages[stages.index("tune") + 1] == "generate"
    assert "tune" not in built(until=until, tune={"enabled": False})
    # An endpoint's server is not the run's to measure.
    assert "tune" not in built(until=until, tune={"enabled": True}, generation={"engine": "endpoint"})


def test_a_full_offline_run_that_tunes_builds_every_stage_in_pipeline_order():
    full = built(until="evaluate", tune={"enabled": True}, train={"mode": "offline"})
    assert full == ("prepare", "tune", "generate", "tokenize", "extract", "train", "evaluate")
