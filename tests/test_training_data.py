"""Training data read memory-mapped: the same rows and the same batch order as the in-memory
reader it replaced, one local copy per shard shared by concurrent readers, clear errors."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.data.tokenized import TOKENIZED_SCHEMA
from dflash_pipeline.training.data import (
    CONVERT_BATCH_ROWS,
    BatchOrder,
    TrainingDataError,
    collate,
    local_arrow_copy,
    read_training_sequences,
)
from tests.support.legacy_training_data import read_training_sequences as read_in_memory
from tests.support.train_data import write_tokenized_shard


def write_random_shard(path, rows: int, seed: int, vocab: int = 400):
    """Rows of random ids and lengths, some held out and some with too few supervised tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 60, rows).astype(np.int32)
    prompts = rng.integers(1, 4, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, vocab, int(offsets[-1])).astype(np.int32)
    mask = np.ones(int(offsets[-1]), np.int8)
    for i in range(rows):
        mask[offsets[i] : offsets[i] + prompts[i]] = 0
        if i % 17 == 0:  # one supervised token: too few for a block
            mask[offsets[i] : offsets[i + 1] - 1] = 0
    supervised = np.add.reduceat(mask.astype(np.int32), offsets[:-1])
    table = pa.Table.from_arrays(
        [
            pa.array([f"r{seed}-{i}" for i in range(rows)]),
            pa.array(["heldout" if i % 11 == 0 else "train" for i in range(rows)]),
            pa.array(np.full(rows, -1, np.int32)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            pa.array(lengths),
            pa.array(supervised.astype(np.int32)),
            pa.array(np.zeros(rows, bool)),
        ],
        schema=TOKENIZED_SCHEMA,
    )
    pq.write_table(table, path)
    return str(path)


@pytest.fixture
def shards(demo_model, tmp_path):
    # More rows than one conversion batch: the mapped table has several chunks per column.
    return {
        "00002": write_random_shard(tmp_path / "tokenize-00002.parquet", 2 * CONVERT_BATCH_ROWS + 300, seed=2),
        "00000": str(
            write_tokenized_shard(demo_model, tmp_path / "tokenize-00000.parquet", 40, seed=0, heldout_every=5)
        ),
        "00001": write_random_shard(tmp_path / "tokenize-00001.parquet", 500, seed=1),
    }


def test_rows_and_batch_order_equal_the_in_memory_reader(shards, tmp_path):
    old = read_in_memory(shards)
    new = read_training_sequences(shards, cache_dir=tmp_path / "cache")
    assert len(new) == len(old)
    assert list(new.lengths) == [r.length for r in old]
    for a, b in zip(old, new[:]):
        assert (a.sample_id, a.shard, a.row, a.length) == (b.sample_id, b.shard, b.row, b.length)
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        assert b.input_ids.dtype == a.input_ids.dtype == np.int64
    # The batch order: same seed, same rows, for every rank of a 2-rank job, over three epochs.
    for seed in (0, 7):
        plan_old = BatchOrder([r.length for r in old], 8, seed)
        plan_new = BatchOrder(new.lengths, 8, seed)
        for step in range(3 * plan_old.batches_per_epoch):
            for rank in range(2):
                i_old = plan_old.rank_batch_at(step, rank, 2)
                i_new = plan_new.rank_batch_at(step, rank, 2)
                assert [old[i].sample_id for i in i_old] == [new[i].sample_id for i in i_new]
                ids_old, mask_old = collate([old[i] for i in i_old], "cpu")
                ids_new, mask_new = collate([new[i] for i in i_new], "cpu")
                assert ids_old.equal(ids_new) and mask_old.equal(mask_new)


def test_the_set_is_mapped_not_held_in_memory(shards, tmp_path):
    cache = tmp_path / "cache"
    for path in shards.values():
        local_arrow_copy(path, cache)
    before = pa.total_allocated_bytes()
    training = read_training_sequences(shards, cache_dir=cache)
    token_bytes = 5 * int(training.lengths.sum())  # int32 ids + int8 mask
    # Arrow allocated nothing for the columns: their buffers are the mapped file's pages.
    assert pa.total_allocated_bytes() - before < token_bytes / 20
    assert np.array_equal(training[len(training) - 1].input_ids, read_in_memory(shards)[-1].input_ids)


def test_each_shard_is_copied_once_and_again_when_rewritten(shards, tmp_path):
    cache = tmp_path / "cache"
    read_training_sequences(shards, cache_dir=cache)
    copies = sorted(cache.glob("*.arrow"))
    assert len(copies) == 3
    stamps = [p.stat().st_mtime_ns for p in copies]
    read_training_sequences(shards, cache_dir=cache)
    assert [p.stat().st_mtime_ns for p in sorted(cache.glob("*.arrow"))] == stamps
    write_random_shard(shards["00001"], 300, seed=9)  # re-tokenized in place
    again = read_training_sequences(shards, cache_dir=cache)
    assert len(list(cache.glob("*.arrow"))) == 3  # the stale copy is gone
    assert [r.sample_id for r in again[:]] == [r.sample_id for r in read_in_memory(shards)]


def _read_in_child(args):
    shards, cache, rank = args
    return [r.sample_id for r in read_training_sequences(shards, cache_dir=cache, rank=rank, world=2)[:]]


def test_concurrent_ranks_share_one_copy_and_read_the_same_set(shards, tmp_path):
    cache = tmp_path / "cache"
    with multiprocessing.get_context("fork").Pool(2) as pool:
        a, b = pool.map(_read_in_child, [(shards, cache, 0), (shards, cache, 1)])
    assert a == b == [r.sample_id for r in read_in_memory(shards)]
    assert len(list(cache.glob("*.arrow"))) == 3
    assert not [p for p in os.listdir(cache) if p.endswith(".tmp")]


def test_bad_shards_are_named(tmp_path):
    with pytest.raises(TrainingDataError, match=r"tokenize-00009\.parquet does not exist"):
        read_training_sequences({"00009": str(tmp_path / "tokenize-00009.parquet")}, cache_dir=tmp_path / "c")
    wrong = tmp_path / "tokenize-00003.parquet"
    pq.write_table(pa.table({"id": ["a"], "split": ["train"]}), wrong)
    # Columns of no stage's shard: named as such, before any row is read (data/shard_kinds.py).
    with pytest.raises(
        TrainingDataError, match=r"tokenize-00003\.parquet: not a shard of any stage \(columns id, split\)"
    ):
        read_training_sequences({"00003": str(wrong)}, cache_dir=tmp_path / "c")
    garbage = tmp_path / "tokenize-00004.parquet"
    garbage.write_bytes(b"not parquet")
    with pytest.raises(TrainingDataError, match=r"tokenize-00004\.parquet: not a readable tokenized shard"):
        read_training_sequences({"00004": str(garbage)}, cache_dir=tmp_path / "c")
    heldout = write_random_shard(tmp_path / "tokenize-00005.parquet", 1, seed=0)  # its one row is held out
    with pytest.raises(TrainingDataError, match="no training rows"):
        read_training_sequences({"00005": heldout}, cache_dir=tmp_path / "c")
