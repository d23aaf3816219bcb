"""The training sequences and their deterministic order.

Batches are a pure function of (seed, step): epoch e is a seeded permutation of all training rows,
bucketed by length (rows sorted by length inside windows of a few batches, so a batch pads
little) and then shuffled batch-wise. Resuming at step t therefore needs nothing but t, and every
rank of a DDP job takes its own slice of the same global batch.

The rows are not held in memory. Each tokenized shard (parquet, compressed) is converted once per
machine into an uncompressed Arrow IPC file in a local cache folder (``train.data_cache_dir``)
and opened with ``pa.memory_map``: the ranks of a job, and the next segments' jobs, share the same
file pages through the page cache, and a batch reads only its own rows. What each rank keeps is
three small integer arrays per training row (shard, row, length): ~12 MB for 1M rows, where the
whole set read into every rank took ~18 GB per rank at 1M rows x 3k tokens.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import torch

from dflash_pipeline.data.shard_kinds import kind_problem
from dflash_pipeline.data.sharding import TRAIN

BUCKET_WINDOW_BATCHES = 16
# The columns training reads, and what the cached copy of a shard holds.
COLUMNS = ["id", "split", "input_ids", "loss_mask", "num_tokens", "num_supervised"]
CONVERT_BATCH_ROWS = 1024  # rows decoded at a time while a shard is converted


class TrainingDataError(ValueError):
    pass


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"dflash-train-data-{os.getuid()}"


class _ShardColumns:
    """One shard's memory-mapped table: rows are read from the mapped pages on demand."""

    def __init__(self, table: pa.Table):
        self.ids = table["input_ids"]
        self.mask = table["loss_mask"]
        self.sample_ids = table["id"]
        # The IPC file holds several record batches, so columns are chunked; combining them
        # would copy the whole shard into memory, so a row is found in its chunk instead.
        sizes = [len(chunk) for chunk in self.ids.chunks]
        self.chunk_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _locate(self, row: int) -> tuple[int, int]:
        chunk = int(np.searchsorted(self.chunk_starts, row, side="right")) - 1
        return chunk, row - int(self.chunk_starts[chunk])

    def values(self, column, row: int) -> np.ndarray:
        chunk, i = self._locate(row)
        return column.chunk(chunk)[i].values.to_numpy()

    def sample_id(self, row: int) -> str:
        chunk, i = self._locate(row)
        return self.sample_ids.chunk(chunk)[i].as_py()


@dataclass
class TrainingRow:
    """One training row of a batch; its tokens stay in the shard's mapped file until read."""

    shard: str
    row: int  # row index in its tokenized shard (offline taps are indexed the same way)
    length: int
    _source: _ShardColumns

    @property
    def sample_id(self) -> str:
        return self._source.sample_id(self.row)

    @property
    def input_ids(self) -> np.ndarray:
        return self._source.values(self._source.ids, self.row).astype(np.int64)

    @property
    def loss_mask(self) -> np.ndarray:
        return self._source.values(self._source.mask, self.row).astype(np.int64)


class TrainingSet:
    """The training rows of several shards, in a fixed order (shards sorted by name, rows in
    shard order): ``len``, ``lengths`` (for the batch plan) and ``set[i]`` / ``set[a:b]``, which
    build ``TrainingRow``s for the rows asked for only."""

    def __init__(
        self,
        shards: list[str],
        sources: list[_ShardColumns],
        shard_of: np.ndarray,
        row_of: np.ndarray,
        lengths: np.ndarray,
    ):
        self.shards = shards
        self.sources = sources
        self.shard_of = shard_of
        self.row_of = row_of
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        shard = int(self.shard_of[index])
        return TrainingRow(self.shards[shard], int(self.row_of[index]), int(self.lengths[index]), self.sources[shard])


def _cache_name(path: Path) -> tuple[str, str]:
    """(prefix naming the source file, full file name also naming its size and mtime): a shard
    rewritten in place (re-tokenized) gets a new copy, and the old one is removed."""
    stat = path.stat()
    source = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    version = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return source, f"{source}-{version}.arrow"


def _convert(path: Path, out: Path) -> None:
    """Stream the parquet shard into an uncompressed Arrow IPC file, a batch of rows at a time
    (never the whole shard in memory), written to a temporary name and renamed into place."""
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise TrainingDataError(f"{path}: not a readable tokenized shard ({err})") from None
    problem = kind_problem(parquet.schema_arrow.names, str(path), "tokenize", "train")
    if problem:
        raise TrainingDataError(problem)
    missing = [c for c in COLUMNS if c not in parquet.schema_arrow.names]
    if missing:
        raise TrainingDataError(f"{path}: no column(s) {missing} (is it a tokenize stage output?)")
    schema = pa.schema([parquet.schema_arrow.field(c) for c in COLUMNS])
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with ipc.new_file(str(tmp), schema) as writer:
            for batch in parquet.iter_batches(batch_size=CONVERT_BATCH_ROWS, columns=COLUMNS):
                writer.write_batch(batch)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def local_arrow_copy(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The memory-mappable copy of tokenized shard ``path`` in ``cache_dir``, made on first use.
    A file lock per shard makes concurrent ranks and jobs of one machine convert it once; the
    others wait for it and then map the same file."""
    path = Path(path)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    try:
        source, name = _cache_name(path)
    except FileNotFoundError:
        raise TrainingDataError(f"tokenized shard {path} does not exist") from None
    out = cache / name
    if out.exists():
        return out
    with open(cache / f"{source}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            for old in cache.glob(f"{source}-*.arrow"):
                old.unlink(missing_ok=True)
            _convert(path, out)
    return out


def _open_mapped(path: Path) -> pa.Table:
    source = pa.memory_map(str(path))
    try:
        table = ipc.open_file(source).read_all()
    finally:
        source.close()  # the table's buffers keep the mapping alive; no descriptor per shard
    return table


def read_training_sequences(
    paths: dict[str, str], min_supervised: int = 2, cache_dir: str | Path | None = None, rank: int = 0, world: int = 1
) -> TrainingSet:
    """Train-split rows of the tokenized shards ``{shard: path}`` with enough supervised tokens
    for a block (held-out rows stay out of training), memory-mapped from ``cache_dir``.

    ``rank`` of ``world`` (the local rank and the ranks on this machine) only staggers which shard
    each process converts first, so the ranks of a job convert different shards at the same time
    instead of queuing on one lock; the set is the same for every rank."""
    names = sorted(paths)
    if names:
        first = (rank * len(names)) // max(1, world)
        for name in names[first:] + names[:first]:
            local_arrow_copy(paths[name], cache_dir)
    shards, sources, shard_of, row_of, lengths = [], [], [], [], []
    for name in names:
        table = _open_mapped(local_arrow_copy(paths[name], cache_dir))
        keep = pc.and_(pc.equal(table["split"], TRAIN), pc.greater_equal(table["num_supervised"], min_supervised))
        rows = np.flatnonzero(keep.to_numpy(zero_copy_only=False)).astype(np.int64)
        if not len(rows):
            continue
        shard_of.append(np.full(len(rows), len(shards), dtype=np.int32))
        row_of.append(rows)
        lengths.append(table["num_tokens"].to_numpy()[rows].astype(np.int64))
        shards.append(name)
        sources.append(_ShardColumns(table))
    if not shards:
        raise TrainingDataError(f"no training rows in {sorted(paths.values())} (all held out or too short)")
    return TrainingSet(shards, sources, np.concatenate(shard_of), np.concatenate(row_of), np.concatenate(lengths))


class BatchOrder:
    def __init__(self, lengths: list[int], global_batch: int, seed: int):
        if len(lengths) < global_batch:
            raise TrainingDataError(
                f"{len(lengths)} training sequences are fewer than one global batch ({global_batch})"
            )
        self.lengths = np.asarray(lengths)
        self.global_batch = global_batch
        self.seed = seed
        self.batches_per_epoch = len(lengths) // global_batch
        self._epoch_cache: tuple[int, list[np.ndarray]] | None = None

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        if self._epoch_cache and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.lengths))
        order = order[: self.batches_per_epoch * self.global_batch]
        window = BUCKET_WINDOW_BATCHES * self.global_batch
        batches = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches.extend(np.split(chunk, len(chunk) // self.global_batch))
        batches = [batches[i] for i in rng.permutation(len(batches))]
        self._epoch_cache = (epoch, batches)
        return batches

    def global_batch_at(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.batches_per_epoch)
        return self._epoch(epoch)[index]

    def rank_batch_at(self, step: int, rank: int, world: int) -> np.ndarray:
        batch = self.global_batch_at(step)
        per_rank = self.global_batch // world
        return batch[rank * per_rank : (rank + 1) * per_rank]


def collate(sequences: list[TrainingRow], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``loss_mask`` [b, S_max] (padding: id 0, mask 0)."""
    longest = max(s.length for s in sequences)
    ids = np.zeros((len(sequences), longest), dtype=np.int64)
    mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for i, s in enumerate(sequences):
        ids[i, : s.length] = s.input_ids
        mask[i, : s.length] = s.loss_mask
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)
