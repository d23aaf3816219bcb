"""Prepare stage: ingest prompt files into one sorted table, then cut it into shards.

``ingest`` reads every dataset file (local or S3), validates each row, drops exact duplicates
(same prompt turns), gives each sample a stable id, assigns its shard (hash of the id) and its
split (held-out or train), and writes one parquet sorted by shard, one row group per shard.
``select_shard`` then reads one shard's row group cheaply: every per-shard job of the workflow
starts from a single small object.

Run by hand: ``python -m dflash_pipeline.stages.prepare ingest --help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_pipeline.data.prompts import BadRow, Prompt, prompt_hash, read_prompt_file
from dflash_pipeline.data.sharding import HELDOUT, shard_of, split_of
from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.storage import open_object, write_atomically

log = logging.getLogger(__name__)
# The `dataset` section's defaults (dflash_pipeline/config/schema.yaml), for ingest's keywords and command line.
DATASET_DEFAULTS = schema_defaults("dataset")


def run_fixed_values(num_shards: int, heldout_fraction: float, id_field: str) -> dict:
    """The config keys that decide each sample's shard and split (shard = hash(id) %
    num_shards, the split by a hash of the id against heldout_fraction, the id from id_field),
    by their config names: fixed for the life of a run. The ingest summary records them."""
    return {"num_shards": num_shards, "dataset.heldout_fraction": heldout_fraction, "dataset.id_field": id_field}


def run_fixed_changes(config: dict, summary: dict, where: str) -> list[str]:
    """One line per run-fixed key whose value in ``config`` differs from what the run in storage
    was ingested with (``summary``, its ingest summary at ``where``). A summary written before
    the keys were recorded gives num_shards alone."""
    recorded = summary.get("run_fixed")
    if not isinstance(recorded, dict):
        recorded = {"num_shards": summary["num_shards"]} if "num_shards" in summary else {}
    dataset = config["dataset"]
    now = run_fixed_values(config["num_shards"], dataset["heldout_fraction"], dataset["id_field"])
    return [
        f"config key '{key}': {now[key]!r}, but this run was ingested with {recorded[key]!r} ({where}): "
        "it decides which shard and split each sample is in, so it is fixed for the run; set it back "
        f"to {recorded[key]!r}, or start a new run (another `run` name)"
        for key in now
        if key in recorded and recorded[key] != now[key]
    ]


PROMPT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("shard", pa.int32()),
        ("split", pa.string()),
        (
            "messages",
            pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
        ),
        ("source", pa.string()),
    ]
)


class PrepareError(RuntimeError):
    """The dataset cannot be prepared; the message names the file, row and reason."""


@dataclass
class IngestResult:
    rows_read: int = 0
    bad: list[BadRow] = field(default_factory=list)
    duplicates: int = 0
    prompts: list[Prompt] = field(default_factory=list)
    rows_per_file: dict[str, int] = field(default_factory=dict)

    @property
    def bad_fraction(self) -> float:
        return len(self.bad) / self.rows_read if self.rows_read else 0.0


def add_rows(result: IngestResult, items: Iterable[Prompt | BadRow], seen: set[str]) -> None:
    """Count rows into ``result``: bad ones, exact duplicates (``seen`` dedupe keys), prompts."""
    for item in items:
        result.rows_read += 1
        if isinstance(item, BadRow):
            result.bad.append(item)
            continue
        key_hash = prompt_hash(item.prompt_turns)
        if key_hash in seen:
            result.duplicates += 1
            continue
        seen.add(key_hash)
        result.prompts.append(item)


def read_dataset(paths: list[str], max_row_bytes: int, id_field: str) -> IngestResult:
    """Read and validate every row of every file; keep the first of exact duplicates.

    A row never stops the read (it is quarantined); a file that cannot be read at all (not
    parquet, truncated) stops it with a PrepareError naming the file.
    """
    result = IngestResult()
    seen: set[str] = set()
    for url in paths:
        storage, key = open_object(url)
        if not storage.exists(key):
            raise PrepareError(f"dataset file {url} does not exist (config key dataset.paths)")
        before = result.rows_read
        with storage.local_copy(key) as local:
            try:
                add_rows(result, read_prompt_file(local, url, max_row_bytes, id_field), seen)
            except (OSError, pa.ArrowException) as err:
                raise PrepareError(
                    f"dataset file {url} cannot be read after {result.rows_read - before} rows: {err}"
                ) from err
        result.rows_per_file[url] = result.rows_read - before
        if not result.rows_per_file[url]:
            log.warning("dataset file %s has no rows (config key dataset.paths)", url)
    return result


def assign_ids(prompts: list[Prompt]) -> list[str]:
    """The source id where present and unique, else a hash of the prompt turns."""
    counts = Counter(p.source_id for p in prompts if p.source_id is not None)
    ids = [
        p.source_id if p.source_id is not None and counts[p.source_id] == 1 else prompt_hash(p.prompt_turns)
        for p in prompts
    ]
    clashes = [i for i, n in Counter(ids).items() if n > 1]
    if clashes:
        raise PrepareError(
            f"sample id {clashes[0]!r} is used by a source id and by a prompt hash; rename that source id"
        )
    return ids


def check_bad_fraction(result: IngestResult, max_bad_fraction: float) -> None:
    if result.rows_read == 0:
        raise PrepareError("the dataset has no rows (config key dataset.paths)")
    if result.bad_fraction > max_bad_fraction:
        first = result.bad[0]
        reasons = Counter(b.reason for b in result.bad).most_common()
        listed = ", ".join(f"{reason} {n}" for reason, n in reasons)
        # The first row is named once, then up to four more.
        more = "".join(f"\n  {b.describe()}" for b in result.bad[1:5])
        raise PrepareError(
            f"{len(result.bad)} of {result.rows_read} rows ({result.bad_fraction:.1%}) are bad, "
            f"above dataset.max_bad_fraction={max_bad_fraction}. First: {first.describe()}. "
            f"Reasons: {listed}." + (f" Next:{more}" if more else "")
        )
    if not result.prompts:
        raise PrepareError("no valid prompt rows remain after validation")


def build_table(prompts: list[Prompt], ids: list[str], num_shards: int, heldout_fraction: float) -> pa.Table:
    rows = sorted(
        (shard_of(sample_id, num_shards), sample_id, prompt) for sample_id, prompt in zip(ids, prompts, strict=True)
    )
    return pa.table(
        {
            "id": [r[1] for r in rows],
            "shard": [r[0] for r in rows],
            "split": [split_of(r[1], heldout_fraction) for r in rows],
            "messages": [[{"role": m[0], "content": m[1]} for m in r[2].messages] for r in rows],
            "source": [r[2].source for r in rows],
        },
        schema=PROMPT_SCHEMA,
    )


def write_by_shard(table: pa.Table, num_shards: int, out: str) -> None:
    """One row group per shard (empty shards get none), so a shard is read without a scan."""
    with write_atomically(out) as tmp:
        shards = table.column("shard").to_numpy()
        # Statistics of the shard column only: every prepare job reads the footer (a row group
        # per shard), and the text columns' min/max tripled it (1.6 MB at 1,000 shards).
        with pq.ParquetWriter(tmp, PROMPT_SCHEMA, write_statistics=["shard"]) as writer:
            start = 0
            for shard in range(num_shards):
                end = start
                while end < len(shards) and shards[end] == shard:
                    end += 1
                if end > start:
                    writer.write_table(table.slice(start, end - start))
                start = end


def summarize(
    result: IngestResult,
    table: pa.Table | None,
    num_shards: int,
    paths: list[str],
    stopped: str | None = None,
) -> dict:
    """The ingest's counts; ``table`` is None (no samples written) when it ``stopped``."""
    shard_col = table.column("shard").to_pylist() if table is not None else []
    split_col = table.column("split").to_pylist() if table is not None else []
    shards = Counter(shard_col)
    heldout = Counter(s for s, split in zip(shard_col, split_col) if split == HELDOUT)
    return {
        "files": paths,
        # Rows read per file (bad ones included), and the files that had none: an empty file
        # beside good ones is named, not silently accepted.
        "rows_per_file": dict(result.rows_per_file),
        "files_without_rows": [path for path, rows in result.rows_per_file.items() if not rows],
        "rows_read": result.rows_read,
        "bad_rows": len(result.bad),
        "bad_fraction": round(result.bad_fraction, 6),
        "bad_by_reason": dict(Counter(b.reason for b in result.bad).most_common()),
        "duplicates_dropped": result.duplicates,
        "samples": len(shard_col),
        "heldout_samples": sum(heldout.values()),
        "num_shards": num_shards,
        "samples_per_shard": [shards.get(s, 0) for s in range(num_shards)],
        "heldout_per_shard": [heldout.get(s, 0) for s in range(num_shards)],
        "stopped": stopped,
    }


def write_report(result: IngestResult, summary: dict, out_summary: str, out_quarantine: str) -> None:
    """The quarantine (every bad row: file, row, reason, detail) and the summary."""
    with write_atomically(out_quarantine) as tmp:
        tmp.write_text("".join(json.dumps(b.to_json()) + "\n" for b in result.bad))
    with write_atomically(out_summary) as tmp:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")


def log_quarantined(result: IngestResult, already_said: str = "") -> None:
    """One warning per bad row (the first 20), skipping those a refusal's message names."""
    for bad in result.bad[:20]:
        if bad.describe() not in already_said:
            log.warning("quarantined: %s", bad.describe())


def ingest(
    paths: list[str],
    num_shards: int,
    out_prompts: str,
    out_summary: str,
    out_quarantine: str,
    *,
    heldout_fraction: float = DATASET_DEFAULTS["heldout_fraction"],
    max_bad_fraction: float = DATASET_DEFAULTS["max_bad_fraction"],
    max_row_bytes: int = DATASET_DEFAULTS["max_row_bytes"],
    id_field: str = DATASET_DEFAULTS["id_field"],
    refused_copy: str | Path | None = None,
) -> dict:
    """Validate, dedupe, id and shard the dataset; write the table, summary and quarantine.

    When the rows read are refused (too many bad rows, none valid, an id clash), the summary
    (with the reason in ``stopped``) and the quarantine are written first, then the PrepareError
    rises; no prompt table is written. A workflow deletes a failed job's outputs, so with
    ``refused_copy`` (a path stem beside the job's log) both are also kept as
    ``<stem>.refused-summary.json`` and ``<stem>.refused-quarantine.jsonl``, and the error says so.
    """
    result = read_dataset(paths, max_row_bytes, id_field)
    try:
        check_bad_fraction(result, max_bad_fraction)
        ids = assign_ids(result.prompts)
    except PrepareError as err:
        stopped = summarize(result, None, num_shards, paths, str(err))
        log_quarantined(result, already_said=str(err))
        write_report(result, stopped, out_summary, out_quarantine)
        if refused_copy is None:
            raise
        stem = Path(refused_copy)
        kept_summary = stem.with_name(stem.name + ".refused-summary.json")
        kept_quarantine = stem.with_name(stem.name + ".refused-quarantine.jsonl")
        write_report(result, stopped, str(kept_summary), str(kept_quarantine))
        raise PrepareError(
            f"{err}\n  every bad row (file, row, reason): {kept_quarantine}\n  summary: {kept_summary}"
        ) from err
    table = build_table(result.prompts, ids, num_shards, heldout_fraction)
    write_by_shard(table, num_shards, out_prompts)
    summary = summarize(result, table, num_shards, paths)
    summary["run_fixed"] = run_fixed_values(num_shards, heldout_fraction, id_field)
    log_quarantined(result)
    write_report(result, summary, out_summary, out_quarantine)
    log.info(
        "ingested %d rows: %d samples, %d bad, %d duplicates, %d held out, %d shards",
        result.rows_read,
        summary["samples"],
        summary["bad_rows"],
        result.duplicates,
        summary["heldout_samples"],
        num_shards,
    )
    return summary


def read_shard(ingested: str | Path, shard: int) -> pa.Table:
    """The rows of one shard of the ingested table (local or ``s3://``): its row group, found by
    the row groups' statistics in the footer and read by byte range. A prepare job of a run of
    10,000 shards fetches its own rows, not the whole table (``bench/results``)."""
    storage, key = open_object(ingested)
    with storage.open_ranged(key) as raw:
        parquet = pq.ParquetFile(raw)
        groups = [i for i in range(parquet.num_row_groups) if _holds_shard(parquet.metadata.row_group(i), shard)]
        if not groups:
            return PROMPT_SCHEMA.empty_table()
        table = parquet.read_row_groups(groups)
    table = table.filter(pc.equal(table.column("shard"), shard))
    return table.cast(PROMPT_SCHEMA)


def _holds_shard(group, shard: int) -> bool:
    """Whether a row group may hold rows of ``shard`` (by its ``shard`` column's min and max;
    without statistics it must be read)."""
    names = [group.column(i).path_in_schema for i in range(group.num_columns)]
    stats = group.column(names.index("shard")).statistics
    if stats is None or not stats.has_min_max:
        return True
    return stats.min <= shard <= stats.max


def select_shard(ingested: str, shard: int, out: str) -> int:
    """Write one shard's prompts as its own parquet object; returns the row count."""
    table = read_shard(ingested, shard)
    with write_atomically(out) as tmp:
        pq.write_table(table, tmp)
    log.info("shard %05d: %d prompts", shard, table.num_rows)
    return table.num_rows


def main(argv: list[str] | None = None) -> int:
    from dflash_pipeline.stages.cli import (
        existing_file,
        int_range,
        non_negative_int,
        or_s3,
        positive_int,
        probability,
    )

    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.prepare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ing = sub.add_parser("ingest", help="validate, dedupe, id and shard a prompt dataset")
    ing.add_argument("paths", nargs="+", type=or_s3(existing_file), help=".jsonl/.parquet files, local or s3://")
    ing.add_argument("--num-shards", type=int_range(1, 99999), required=True)
    ing.add_argument("--out-prompts", required=True)
    ing.add_argument("--out-summary", required=True)
    ing.add_argument("--out-quarantine", required=True)
    ing.add_argument("--heldout-fraction", type=probability, default=DATASET_DEFAULTS["heldout_fraction"])
    ing.add_argument("--max-bad-fraction", type=probability, default=DATASET_DEFAULTS["max_bad_fraction"])
    ing.add_argument("--max-row-bytes", type=positive_int, default=DATASET_DEFAULTS["max_row_bytes"])
    ing.add_argument("--id-field", default=DATASET_DEFAULTS["id_field"])
    sel = sub.add_parser("select", help="write one shard of an ingested table")
    sel.add_argument("ingested", type=or_s3(existing_file), help="the ingested prompts parquet")
    sel.add_argument("--shard", type=non_negative_int, required=True)
    sel.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.command == "ingest":
            ingest(
                args.paths,
                args.num_shards,
                args.out_prompts,
                args.out_summary,
                args.out_quarantine,
                heldout_fraction=args.heldout_fraction,
                max_bad_fraction=args.max_bad_fraction,
                max_row_bytes=args.max_row_bytes,
                id_field=args.id_field,
            )
        else:
            select_shard(args.ingested, args.shard, args.out)
    except PrepareError as err:
        log.error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
