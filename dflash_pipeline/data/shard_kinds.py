"""Which stage wrote a parquet shard, told by its columns, and the check every shard reader makes.

Each shard stage writes a fixed schema (prepare: ``stages.prepare.PROMPT_SCHEMA``, generate:
``engines.regenerate.GENERATED_SCHEMA``, tokenize: ``data.tokenized.TOKENIZED_SCHEMA``, its
held-out object too), and each has columns no other stage writes. A reader given another
stage's shard would otherwise fail deep inside (``KeyError: 'turns'`` from tokenize given a
prepare shard); ``require_kind`` refuses it first, in one line naming the file, what it is and
what the reader reads. Only the parquet footer is read (``pq.read_schema``), never a row.
"""

from __future__ import annotations

from collections.abc import Iterable

# Columns that only this stage's shards hold (tests/test_shard_kinds.py checks them against the
# writers' schemas). Kept here, not imported from the writers, so a reader's check loads neither
# an engine client nor a tokenizer.
MARKERS: dict[str, tuple[str, ...]] = {
    "prepare": ("source",),
    "generate": ("turns", "fingerprint"),
    "tokenize": ("input_ids", "loss_mask"),
}


class ShardKindError(ValueError):
    """A shard of another stage (or of none) was given to a reader; the message is one line."""


def shard_kind(columns: Iterable[str]) -> str | None:
    """The stage whose marker columns are all in ``columns``, or None."""
    names = set(columns)
    for stage, markers in MARKERS.items():
        if names.issuperset(markers):
            return stage
    return None


def kind_problem(columns: Iterable[str], path: str, expected: str, reader: str) -> str | None:
    """None when ``columns`` are those of an ``expected`` shard; else the one-line reason."""
    columns = list(columns)
    kind = shard_kind(columns)
    if kind == expected:
        return None
    what = f"a {kind} shard" if kind else "not a shard of any stage"
    return f"{path}: {what} (columns {', '.join(columns)}), {reader} reads {expected} shards"


def require_kind(columns: Iterable[str], path: str, expected: str, reader: str) -> None:
    """Raise ShardKindError unless ``columns`` are those of an ``expected`` shard."""
    problem = kind_problem(columns, path, expected, reader)
    if problem:
        raise ShardKindError(problem)


def require_file_kind(path: str, expected: str, reader: str) -> None:
    """``require_kind`` on a parquet file (local or ``s3://``), reading its footer only; a file
    that is no parquet at all is a ShardKindError too (storage errors pass as they are)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except pa.ArrowInvalid as err:
        raise ShardKindError(f"{path}: not a parquet file ({err}), {reader} reads {expected} shards") from None
    require_kind(names, path, expected, reader)
