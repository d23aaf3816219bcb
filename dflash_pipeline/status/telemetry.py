"""Reading the telemetry that shard jobs leave under ``_progress/`` (dflash_pipeline.progress)."""

from __future__ import annotations

import json

from dflash_pipeline import layout
from dflash_pipeline.progress import TELEMETRY
from dflash_pipeline.status.readonly import ReadOnlyStorage
from dflash_pipeline.storage import StorageError


def read_stage_telemetry(run_url: str, stage: str, shards: list[str]) -> dict[str, dict]:
    """The last telemetry of each shard of ``stage`` that left one, keyed by shard name."""
    run = ReadOnlyStorage.open(run_url)
    found = {}
    for shard in shards:
        try:
            found[shard] = json.loads(run.read_text(layout.progress_prefix(stage, shard) + TELEMETRY))
        except (StorageError, ValueError):
            continue  # no telemetry kept (or unreadable): the figure shows the job rate only
    return found
