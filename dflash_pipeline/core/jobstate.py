"""In-flight state of a running job: parts of finished rows and live telemetry; the run's halt.

Everything lives under ``_progress/<stage>/shard-NNNNN/`` of the run (local or S3) and is written
by the job through the storage layer, each object atomically. A restarted job reads the parts
back, so a crash costs only the rows not yet in a part; the status page reads the telemetry.

``_progress/HALT.json`` stops a whole run: the tokenize stage writes it when a shard fails the
data-quality gate, because every other shard is being generated with the same settings, and a
training segment when it diverged (``training.divergence``), so that no later segment trains on.
While it exists no generate, extract or train job starts (``raise_if_halted``), and a running
generate job stops after its next part. Only an explicit command removes it (``clear_halt``; the CLI is
``python -m dflash_pipeline.stages.tokenize clear-halt``): Snakemake's ``keep-going`` and reruns
cannot.
"""

from __future__ import annotations

import io
import json
import logging
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.core import layout
from dflash_pipeline.core.digest import Digest, Hasher
from dflash_pipeline.core.storage import NotFound, Storage, StorageError, open_storage

log = logging.getLogger(__name__)

TELEMETRY = "telemetry.json"
CLEAR_HALT_COMMAND = "python -m dflash_pipeline.stages.tokenize clear-halt --run-url {run_url}"


class RunHalted(RuntimeError):
    """The run is halted (``_progress/HALT.json``); the message names the cause and the fix."""


def read_halt(storage: Storage) -> dict | None:
    """The run's halt record, or None when the run is not halted."""
    try:
        text = storage.read_text(layout.HALT)
    except NotFound:
        return None  # other storage trouble raises: never mistaken for "not halted"
    try:
        halt = json.loads(text)
    except ValueError:
        halt = None
    if not isinstance(halt, dict):
        # A damaged halt still halts: it can only have been written by a failed gate.
        return {"stage": "?", "shard": "?", "cause": f"unreadable halt object: {text[:200]!r}"}
    return halt


def write_halt(
    storage: Storage,
    stage: str,
    shard: int | str,
    cause: str,
    message: str,
    details: dict | None = None,
    unit: str = "shard",
) -> dict:
    """Halt the run. The first cause stays: a later failure is logged by its own job, and
    re-writing the object would hide which shard stopped the run (two shards failing at the same
    moment may leave either one's record; both halt). ``unit``: what ``shard`` numbers (a
    training job's is its ``segment``)."""
    existing = read_halt(storage)
    if existing is not None:
        return existing
    halt = {
        "stage": stage,
        "unit": unit,
        "shard": layout.shard_name(shard),
        "cause": cause,
        "message": message,
        "details": details or {},
        "halted_at": time.time(),
        "halted_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    storage.write_text(layout.HALT, json.dumps(halt, indent=1))
    return halt


def clear_halt(storage: Storage) -> dict | None:
    """Remove the halt; returns what it said (None when the run was not halted)."""
    halt = read_halt(storage)
    if halt is not None:
        storage.delete(layout.HALT)
    return halt


def describe_halt(halt: dict, storage: Storage) -> str:
    """What a refused job says: the cause, where the halt lives, how to clear it."""
    when = halt.get("halted_at_utc") or "?"
    if halt.get("stage") == "train":
        advice = (
            "Fix what made training diverge (a lower train.learning_rate, a higher warmup_ratio; the "
            "halt's message names the step, its loss and gradient norm and the last good checkpoint, "
            "which the segment restarts from)"
        )
    else:
        advice = (
            "Do what that message advises for the cause (with unchanged settings a greedy run "
            "regenerates the same text), regenerate that shard (delete its "
            "outputs/generate-NNNNN.parquet, or change the generation config)"
        )
    return (
        f"the run is halted since {when}: {halt.get('stage')} {halt.get('unit', 'shard')} "
        f"{halt.get('shard')} {halt.get('cause')}. No generate, extract or train job of this run "
        f"starts while {storage.join(layout.HALT)} exists (it holds the full message). {advice}, "
        "then clear the halt: " + CLEAR_HALT_COMMAND.format(run_url=storage.url)
    )


def raise_if_halted(storage: Storage, job: str) -> None:
    """Refuse to start (or go on with) ``job`` while the run is halted."""
    halt = read_halt(storage)
    if halt is not None:
        raise RunHalted(f"{job} stopped: {describe_halt(halt, storage)}")


def write_telemetry(storage: Storage, prefix: str, identity: dict, record: dict) -> None:
    """The one writer of ``telemetry.json``: the job's identity, the time, its record."""
    document = {**identity, "updated_at": time.time(), **record}
    storage.write_text(prefix + TELEMETRY, json.dumps(document, indent=1))


# The counts of a finished shard kept in its stage's totals object (what the status page sums).
TOTALS_FIELDS = ("tokens_generated", "samples_done", "samples_resumed", "errors", "elapsed_s")
# Conditional-write attempts when other jobs of the stage update the object at the same moment.
TOTALS_ATTEMPTS = 20


class StageTotals:
    """``_progress/<stage>/totals.json``: each finished shard's final counts, keyed by shard.

    A status page opening a run of 10,000 finished shards read every shard's telemetry to sum
    ``tokens_generated`` (20,000 reads, minutes on S3); this object holds the same sums for one
    read. Each job adds its own shard when it finishes, with a conditional write (S3 If-Match,
    local flock) retried on conflict, so concurrent jobs never lose each other's entries; an
    entry is replaced, never added twice, when a shard is rebuilt. ``rebuild`` recomputes it
    from the telemetry objects (an entry lost to a storage error, an older run)."""

    def __init__(self, storage: Storage, stage: str):
        self.storage, self.stage = storage, stage
        self.key = layout.stage_totals_key(stage)

    def read(self) -> dict[int, dict]:
        try:
            document = json.loads(self.storage.read_text(self.key))
        except (StorageError, ValueError):
            return {}
        return parse_totals(document)

    def add(self, shard: int, record: dict) -> bool:
        """Put ``shard``'s counts (the TOTALS_FIELDS of its final telemetry) in; whether it
        was written (False after TOTALS_ATTEMPTS conflicts, logged)."""
        entry = {k: record[k] for k in TOTALS_FIELDS if k in record}
        for attempt in range(TOTALS_ATTEMPTS):
            current = self.storage.read_tagged(self.key)
            try:
                document = json.loads(current[0]) if current else {}
            except ValueError:
                document = {}
            shards = document.get("shards") if isinstance(document.get("shards"), dict) else {}
            shards[layout.shard_name(shard)] = entry
            data = json.dumps({"stage": self.stage, "shards": dict(sorted(shards.items()))}).encode()
            if current is None:
                written = self.storage.create_if_absent(self.key, data)
            else:
                written = self.storage.replace_if_tag(self.key, data, current[1])
            if written is not None:
                return True
            time.sleep(0.05 * (attempt + 1))  # another job wrote in between: read it again
        log.warning(
            "%s: shard %s not added after %d conflicting writes",
            self.storage.join(self.key),
            layout.shard_name(shard),
            TOTALS_ATTEMPTS,
        )
        return False

    def rebuild(self, shards: list[int]) -> dict[int, dict]:
        """Recompute the object from the telemetry of ``shards`` (those whose output exists)."""
        found = {}
        for shard in shards:
            record = ShardProgress(self.storage, self.stage, shard).read_telemetry()
            if record and record.get("state") == "done":
                found[shard] = {k: record[k] for k in TOTALS_FIELDS if k in record}
        self.replace(found)
        return found

    def replace(self, entries: dict[int, dict]) -> None:
        """Write the whole object: ``entries`` keyed by shard number."""
        document = {"stage": self.stage, "shards": {layout.shard_name(s): e for s, e in sorted(entries.items())}}
        self.storage.write_text(self.key, json.dumps(document))


def parse_totals(document) -> dict[int, dict]:
    """A totals object's entries keyed by shard number (nothing for a foreign document)."""
    shards = document.get("shards") if isinstance(document, dict) else None
    if not isinstance(shards, dict):
        return {}
    return {int(k): v for k, v in shards.items() if str(k).isdigit() and isinstance(v, dict)}


class Telemetry:
    """A job's live state for the status page, the same shape for every stage: units (samples or
    steps) done of a total, tokens, rate and ETA; written at most every ``every_s`` seconds while
    running (``update``) and at every state change (``write``). Without storage it only counts."""

    def __init__(
        self,
        storage: Storage | None,
        prefix: str,
        identity: dict,
        total: int,
        *,
        every_s: float,
        resumed: int = 0,
        unit: str = "samples",
        token_field: str | None = None,
    ):
        self.storage, self.prefix, self.identity = storage, prefix, identity
        self.total, self.resumed, self.done = total, resumed, resumed
        self.unit, self.token_field, self.every_s = unit, token_field, every_s
        self.tokens = 0
        self.errors = 0
        self.state = "running"
        self.started = time.time()
        self.last_write = 0.0

    def record(self, **fields) -> dict:
        elapsed = max(time.time() - self.started, 1e-6)
        rate = (self.done - self.resumed) / elapsed
        record = {
            "state": self.state,
            f"{self.unit}_total": self.total,
            f"{self.unit}_done": self.done,
            f"{self.unit}_resumed": self.resumed,
            "errors": self.errors,
            "tokens_per_s": round(self.tokens / elapsed, 2),
            "elapsed_s": round(elapsed, 1),
            "eta_s": round((self.total - self.done) / rate, 1) if rate > 0 else None,
        }
        if self.token_field:
            record[self.token_field] = self.tokens
        return {**record, **fields}

    def update(self, done: int, tokens: int, **fields) -> None:
        self.done, self.tokens = done, tokens
        if time.time() - self.last_write >= self.every_s:
            self.write(**fields)

    def write(self, state: str | None = None, **fields) -> None:
        """Best effort: telemetry is for the status page, so a storage error (an S3 outage
        outlasting the client's retries) is logged, never raised into the job it describes."""
        if state is not None:
            self.state = state
        if self.storage is not None:
            self.last_write = time.time()
            record = self.record(**fields)
            try:
                write_telemetry(self.storage, self.prefix, self.identity, record)
                if self.state == "done" and {"stage", "shard"} <= self.identity.keys():
                    StageTotals(self.storage, self.identity["stage"]).add(self.identity["shard"], record)
            except StorageError as err:
                log.warning("telemetry not written (the job goes on): %s", err)


# The checksum record of a progress part or reuse copy: beside it, ``<key>.sha256.json``
# (``core.digest``'s format). What a resume or a repair reads back is checked against it, so a
# damaged saved row is dropped and generated again, never rebuilt into a shard that then gets a
# fresh, valid checksum of its own.
SAVED_RECORD_SUFFIX = ".sha256.json"


class ShardProgress:
    def __init__(self, run: Storage, stage: str, shard: int):
        self.run = run
        self.stage = stage
        self.shard = shard
        self.prefix = layout.progress_prefix(stage, shard)

    def part_keys(self) -> list[str]:
        return [o.key for o in self.run.list(self.prefix + "part-") if o.key.endswith(".parquet")]

    def _write_checked(self, key: str, table: pa.Table) -> None:
        """``table`` as one parquet object at ``key``, its record written first: a crash
        between the two leaves a record without its object (harmless), or, for the reuse copy
        it replaces, an object its record does not match (dropped when read)."""
        sink = io.BytesIO()
        pq.write_table(table, sink)
        data = sink.getvalue()
        digest = Hasher().update_all([data]).digest()
        record = {"key": key, **digest.fields(), "written_at": time.time()}
        self.run.write_text(key + SAVED_RECORD_SUFFIX, json.dumps(record) + "\n")
        self.run.write_bytes(key, data)

    def _read_checked(self, key: str, schema: pa.Schema, what: str) -> pa.Table | None:
        """The table saved at ``key`` if it matches its record; else None, the object and its
        record deleted and the reason logged (its rows are generated again)."""
        try:
            data = self.run.read_bytes(key)
        except NotFound:
            return None
        try:
            problem = Digest.of(json.loads(self.run.read_bytes(key + SAVED_RECORD_SUFFIX))).problem(
                Hasher().update_all([data]).digest()
            )
        except NotFound:
            problem = f"has no checksum record {self.run.join(key + SAVED_RECORD_SUFFIX)}"
        except (ValueError, KeyError, TypeError) as err:
            problem = f"has an unreadable checksum record ({type(err).__name__}: {err})"
        table = None
        if problem is None:
            try:
                table = pq.read_table(io.BytesIO(data), schema=schema)
            except (pa.ArrowInvalid, OSError) as err:
                problem = f"matches its record but is no parquet of generated rows ({err})"
        if problem is not None:
            log.warning("%s %s %s: dropped; its rows are generated again", what, self.run.join(key), problem)
            self.run.delete(key)
            self.run.delete(key + SAVED_RECORD_SUFFIX)
            return None
        return table

    def load_parts(self, schema: pa.Schema) -> pa.Table:
        """Every row saved so far that its part's record vouches for (later parts win for a
        repeated id); a damaged or unrecorded part is dropped, named in the log."""
        tables = [self._read_checked(key, schema, "progress part") for key in self.part_keys()]
        tables = [t for t in tables if t is not None]
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def save_reusable(self, table: pa.Table) -> None:
        """Keep the finished shard so a later rebuild of it reuses its rows."""
        self._write_checked(layout.reuse_key(self.stage, self.shard), table)

    def load_reusable(self, schema: pa.Schema) -> pa.Table:
        """The rows of the shard's earlier build, if its reuse copy matches its record."""
        table = self._read_checked(layout.reuse_key(self.stage, self.shard), schema, "reuse copy")
        return schema.empty_table() if table is None else table

    def write_part(self, table: pa.Table) -> str:
        # Time-ordered names: parts sort in the order they were written.
        key = f"{self.prefix}part-{time.time_ns():020d}-{uuid.uuid4().hex[:6]}.parquet"
        self._write_checked(key, table)
        return key

    def clear_parts(self) -> int:
        """Delete the parts and their records; how many parts there were."""
        objects = [o.key for o in self.run.list(self.prefix + "part-")]
        for key in objects:
            self.run.delete(key)
        return sum(key.endswith(".parquet") for key in objects)

    def telemetry(self, total: int, every_s: float, **options) -> Telemetry:
        """The shard job's live telemetry, written at most every ``every_s`` seconds (its stage's
        ``telemetry_every_seconds``) while running; ``Telemetry`` options: resumed, token_field."""
        return Telemetry(
            self.run, self.prefix, {"stage": self.stage, "shard": self.shard}, total, every_s=every_s, **options
        )

    def write_telemetry(self, record: dict) -> None:
        write_telemetry(self.run, self.prefix, {"stage": self.stage, "shard": self.shard}, record)

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
