"""The training-data reader as it was before shards were memory-mapped: every row of every shard
read into each rank's memory. Kept as the reference the memory-mapped reader must match row for
row and batch for batch (tests/test_training_data.py), and as the baseline of
bench/train_memory.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_pipeline.data.sharding import TRAIN
from dflash_pipeline.training.data import TrainingDataError


@dataclass
class TrainingRow:
    """One training row. Its tokens stay in the shard's Arrow column (int32 / int8) until a batch
    needs them: a 1M-row, 4k-token dataset held as int64 numpy arrays would take ~60 GB per rank."""

    sample_id: str
    shard: str
    row: int  # row index in its tokenized shard (offline taps are indexed the same way)
    length: int
    _ids: object  # pyarrow ListArray of the shard
    _mask: object

    @property
    def input_ids(self) -> np.ndarray:
        return self._ids[self.row].values.to_numpy().astype(np.int64)

    @property
    def loss_mask(self) -> np.ndarray:
        return self._mask[self.row].values.to_numpy().astype(np.int64)


def read_training_sequences(paths: dict[str, str], min_supervised: int = 2) -> list[TrainingRow]:
    """Train-split rows of the tokenized shards ``{shard: path}`` with enough supervised tokens
    for a block (held-out rows stay out of training)."""
    sequences = []
    for shard, path in sorted(paths.items()):
        table = pq.read_table(path, columns=["id", "split", "input_ids", "loss_mask", "num_tokens", "num_supervised"])
        keep = pc.and_(pc.equal(table["split"], TRAIN), pc.greater_equal(table["num_supervised"], min_supervised))
        ids = table["id"].to_pylist()
        lengths = table["num_tokens"].to_pylist()
        input_ids = table["input_ids"].combine_chunks()
        loss_mask = table["loss_mask"].combine_chunks()
        for row in np.flatnonzero(np.asarray(keep)):
            row = int(row)
            sequences.append(TrainingRow(ids[row], shard, row, lengths[row], input_ids, loss_mask))
    if not sequences:
        raise TrainingDataError(f"no training rows in {sorted(paths.values())} (all held out or too short)")
    return sequences
