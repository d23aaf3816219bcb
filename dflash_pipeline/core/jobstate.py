"""In-flight state of a running shard job: parts of finished rows and live telemetry.

Everything lives under ``_progress/<stage>/shard-NNNNN/`` of the run (local or S3) and is written
by the job through the storage layer, each object atomically. A restarted job reads the parts
back, so a crash costs only the rows not yet in a part; the status page reads the telemetry.
"""

from __future__ import annotations

import io
import json
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import Storage, StorageError, open_storage

TELEMETRY = "telemetry.json"


class ShardProgress:
    def __init__(self, run: Storage, stage: str, shard: int):
        self.run = run
        self.stage = stage
        self.shard = shard
        self.prefix = layout.progress_prefix(stage, shard)

    def part_keys(self) -> list[str]:
        return [
            o.key
            for o in self.run.list(self.prefix + "part-")
            if o.key.endswith(".parquet")
        ]

    def load_parts(self, schema: pa.Schema) -> pa.Table:
        """Every row saved so far (later parts win for a repeated id)."""
        tables = []
        for key in self.part_keys():
            try:
                tables.append(pq.read_table(io.BytesIO(self.run.read_bytes(key)), schema=schema))
            except (StorageError, pa.ArrowInvalid) as err:
                # A part is written atomically, so an unreadable one is foreign or damaged:
                # say so and regenerate its rows rather than trust it.
                raise StorageError(f"unreadable progress part {self.run.join(key)}: {err}") from err
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def save_reusable(self, table: pa.Table) -> None:
        """Keep the finished shard so a later rebuild of it reuses its rows."""
        sink = io.BytesIO()
        pq.write_table(table, sink)
        self.run.write_bytes(layout.reuse_key(self.stage, self.shard), sink.getvalue())

    def load_reusable(self, schema: pa.Schema) -> pa.Table:
        key = layout.reuse_key(self.stage, self.shard)
        if not self.run.exists(key):
            return schema.empty_table()
        return pq.read_table(io.BytesIO(self.run.read_bytes(key)), schema=schema)

    def write_part(self, table: pa.Table) -> str:
        # Time-ordered names: parts sort in the order they were written.
        key = f"{self.prefix}part-{time.time_ns():020d}-{uuid.uuid4().hex[:6]}.parquet"
        sink = io.BytesIO()
        pq.write_table(table, sink)
        self.run.write_bytes(key, sink.getvalue())
        return key

    def clear_parts(self) -> int:
        keys = self.part_keys()
        for key in keys:
            self.run.delete(key)
        return len(keys)

    def write_telemetry(self, record: dict) -> None:
        record = {"stage": self.stage, "shard": self.shard, "updated_at": time.time(), **record}
        self.run.write_text(self.prefix + TELEMETRY, json.dumps(record, indent=1))

    def read_telemetry(self) -> dict | None:
        try:
            return json.loads(self.run.read_text(self.prefix + TELEMETRY))
        except StorageError:
            return None


def read_stage_telemetry(run_url: str, stage: str, shards: list[str]) -> dict[str, dict]:
    """The last telemetry of each shard of ``stage`` that left one, keyed by shard name."""
    run = open_storage(run_url)
    found = {}
    for shard in shards:
        try:
            found[shard] = json.loads(run.read_text(layout.progress_prefix(stage, shard) + TELEMETRY))
        except (StorageError, ValueError):
            continue  # no telemetry kept (or unreadable): the figure shows the job rate only
    return found


def read_train_metrics(text: str) -> list[dict]:
    """Parse a training ``metrics.jsonl``; a line cut by a crash or an upload is skipped."""
    points = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            points.append(record)
    return points
