"""The training sequences and their deterministic order.

Batches are a pure function of (seed, step): epoch e is a seeded permutation of all training rows,
bucketed by length (rows sorted by length inside windows of a few batches, so a batch pads
little) and then shuffled batch-wise. Resuming at step t therefore needs nothing but t, and every
rank of a DDP job takes its own slice of the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dflash_pipeline.data.sharding import TRAIN

BUCKET_WINDOW_BATCHES = 16


class TrainingDataError(ValueError):
    pass


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
        table = pq.read_table(
            path, columns=["id", "split", "input_ids", "loss_mask", "num_tokens", "num_supervised"]
        )
        keep = pc.and_(
            pc.equal(table["split"], TRAIN), pc.greater_equal(table["num_supervised"], min_supervised)
        )
        ids = table["id"].to_pylist()
        lengths = table["num_tokens"].to_pylist()
        input_ids = table["input_ids"].combine_chunks()
        loss_mask = table["loss_mask"].combine_chunks()
        for row in np.flatnonzero(np.asarray(keep)):
            row = int(row)
            sequences.append(TrainingRow(ids[row], shard, row, lengths[row], input_ids, loss_mask))
    if not sequences:
        raise TrainingDataError(
            f"no training rows in {sorted(paths.values())} (all held out or too short)"
        )
    return sequences


class BatchPlan:
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
