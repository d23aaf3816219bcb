"""Checkpoints: per-rank shards through the storage layer (local and S3), the index written last,
map_location, RNG state, and background (async) writes."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dflash_pipeline.core import layout
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.training.checkpoint import (
    INDEX,
    LATEST,
    CheckpointError,
    SingleProcess,
    assign_tensors,
    capture_rng,
    load_checkpoint,
    load_model_weights,
    map_location_for,
    restore_rng,
    save_checkpoint,
    shard_name,
    stage_shard,
    tensors_off_device,
    write_index,
    write_shard,
)
from dflash_pipeline.training.rolling_checkpoints import RollingCheckpoints


def trained_state(step: int = 3) -> dict:
    """A real model + AdamW + scheduler state after a few steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    for _ in range(step):
        model(torch.randn(2, 8)).square().sum().backward()
        optimizer.step()
        scheduler.step()
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
    }


def assert_equal_states(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal_states(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_states(x, y)
    else:
        assert a == b


def test_save_and_load_round_trip_through_storage(store):
    state = trained_state()
    rng = capture_rng()
    index = save_checkpoint(store, "ckpt/", state, rng)
    assert set(index["files"]) == {shard_name(0, 1)} and index["step"] == 3 and index["world"] == 1
    loaded = load_checkpoint(store, "ckpt/")
    assert_equal_states(loaded.state, state)
    assert_equal_states(loaded.rng, rng)
    # The index is the last object written: a listing shows it beside the shard it names.
    assert [o.key for o in store.list("ckpt/")] == ["ckpt/" + INDEX, "ckpt/" + shard_name(0, 1)]


def test_ranks_write_byte_balanced_shards_and_each_reads_its_own_rng(store):
    """Three ranks' shards (what each rank of a DDP job writes), the index by rank 0 last."""
    state = trained_state()
    world = 3
    rngs = [dict(capture_rng(), python=random.Random(r).getstate()) for r in range(world)]
    entries = [write_shard(store, "c/", stage_shard(state, rngs[r], r, world, copy=False)) for r in range(world)]
    assert load_checkpoint(store, "c/") is None, "shards without their index are no checkpoint"
    write_index(store, "c/", 3, world, entries)
    for rank in range(world):
        loaded = load_checkpoint(store, "c/", rank=rank)
        assert_equal_states(loaded.state, state)
        assert loaded.rng["python"] == rngs[rank]["python"]
    # A later job with more ranks than the checkpoint's takes rank 0's generators.
    assert load_checkpoint(store, "c/", rank=7).rng["python"] == rngs[0]["python"]
    # Export reads the model's weights alone, from every rank's shard.
    weights = load_model_weights(store, "c/")
    assert set(weights) == set(state["model"])
    assert all(torch.equal(weights[k], state["model"][k]) for k in weights)
    assert load_model_weights(store, "nothing/") is None
    # ... straight into the export dtype (no fp32 copy of a bf16 export).
    bf16 = load_model_weights(store, "c/", torch.bfloat16)
    assert all(
        t.dtype == torch.bfloat16 and torch.equal(t, state["model"][k].to(torch.bfloat16)) for k, t in bf16.items()
    )


def test_assignment_balances_bytes_and_is_the_same_on_every_rank():
    sizes = {"a": 100, "b": 90, "c": 50, "d": 40, "e": 10, "f": 10}
    parts = assign_tensors(sizes, 2)
    assert parts == assign_tensors(dict(reversed(sizes.items())), 2)
    assert sorted(p for part in parts for p in part) == sorted(sizes)
    loads = [sum(sizes[p] for p in part) for part in parts]
    assert max(loads) - min(loads) <= 10
    assert assign_tensors({"a": 4}, 3) == [["a"], [], []]  # more ranks than tensors: empty shards


def test_a_checkpoint_without_its_index_is_not_used(tmp_path):
    store = open_storage(tmp_path)
    rolling = RollingCheckpoints(store, "roll/")
    rolling.save(trained_state(2), capture_rng())
    # A save of step 4 that died after its shard and before its index (e.g. SIGKILL).
    write_shard(store, rolling.step_prefix(4), stage_shard(trained_state(4), capture_rng(), 0, 1, copy=False))
    assert store.exists(rolling.step_prefix(4) + shard_name(0, 1))
    assert rolling.load_latest().state["step"] == 2
    # Even a pointer to it (it is never written before the index) does not make it a checkpoint.
    store.write_text("roll/" + LATEST, json.dumps({"prefix": rolling.step_prefix(4)}))
    assert rolling.load_latest() is None
    # A segment checkpoint folder without its index is missing, not a checkpoint.
    write_shard(store, "seg/", stage_shard(trained_state(4), capture_rng(), 0, 1, copy=False))
    assert load_checkpoint(store, "seg/") is None


def test_a_shard_that_does_not_match_its_index_is_refused(tmp_path):
    store = open_storage(tmp_path)
    save_checkpoint(store, "c/", trained_state(), capture_rng())
    store.write_bytes("c/" + shard_name(0, 1), b"truncated")
    with pytest.raises(CheckpointError, match="does not match its index"):
        load_checkpoint(store, "c/")


def test_next_segment_refuses_a_previous_checkpoint_without_index(demo_model, tmp_path):
    from dflash_pipeline.training.trainer import SegmentJob, TrainingError
    from tests.support.train_data import write_tokenized_shard
    from tests.test_training import settings

    store = open_storage(tmp_path)
    prefix = layout.checkpoint_prefix(0)
    write_shard(store, prefix, stage_shard(trained_state(), capture_rng(), 0, 1, copy=False))
    tokenized = {"00000": str(write_tokenized_shard(demo_model, tmp_path / "t.parquet", 4, seed=0))}
    job = SegmentJob(
        run_url=str(tmp_path),
        segment=1,
        settings=settings(segments=2),
        target_dir=str(demo_model),
        tokenized=tokenized,
        manifest_path=str(tmp_path / layout.segment_manifest_key(1)),
        device="cpu",
    )
    with pytest.raises(TrainingError, match="its save did not finish"):
        job.run()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_map_location_puts_every_tensor_on_the_given_device(tmp_path, device):
    store = open_storage(tmp_path)
    save_checkpoint(store, "c/", trained_state(), capture_rng())
    loaded = load_checkpoint(store, "c/", map_location=device)
    assert tensors_off_device(loaded.state, torch.device(device)) == []
    assert {t.device.type for t in loaded.state["model"].values()} == {device}
    assert loaded.state["optimizer"]["state"][0]["exp_avg"].device.type == device


def test_map_location_of_a_rank_is_its_own_device_whatever_the_saved_one():
    # Rank 3 of a job reads onto cuda:3 only; an explicit index never becomes cuda:0.
    assert map_location_for("cuda:3") == torch.device("cuda", 3)
    assert map_location_for(torch.device("cpu")) == torch.device("cpu")
    if torch.cuda.is_available():
        assert map_location_for("cuda") == torch.device("cuda", torch.cuda.current_device())
    meta = {"w": torch.empty(2, device="meta"), "nested": [torch.zeros(1)]}
    assert tensors_off_device(meta, torch.device("cpu")) == ["/w"]


def test_rng_state_is_restored():
    random.seed(5)
    torch.manual_seed(5)
    state = capture_rng("cpu")
    expected = (torch.rand(4), random.random())
    torch.rand(10)
    random.random()
    restore_rng(state, "cpu")
    again = (torch.rand(4), random.random())
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    assert state["cuda"] is None  # a CPU rank has no CUDA generator to save


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_state_of_the_rank_device_is_saved_and_restored(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    store = open_storage(tmp_path)
    save_checkpoint(store, "c/", trained_state(), capture_rng(device))
    expected = torch.rand(4, device=device)
    torch.rand(100, device=device)
    loaded = load_checkpoint(store, "c/", map_location=device)
    assert loaded.rng["cuda"]["device"] == device.index
    restore_rng(loaded.rng, device)
    assert torch.equal(torch.rand(4, device=device), expected)


def test_async_save_writes_the_state_of_its_step_while_training_changes_it(store):
    rolling = RollingCheckpoints(store, "roll/")
    state = trained_state(3)
    snapshot = {k: v.clone() for k, v in state["model"].items()}
    group = SingleProcess()
    pending = rolling.begin(state, capture_rng(), group)
    for tensor in state["model"].values():  # training goes on in place
        tensor.add_(1.0)
    assert not store.exists("roll/" + LATEST) or pending.done()
    rolling.commit(pending, group)
    loaded = rolling.load_latest()
    assert loaded.state["step"] == 3
    assert_equal_states(loaded.state["model"], snapshot)
    # The next commit moves the pointer and removes the older folder.
    rolling.commit(rolling.begin(trained_state(5), capture_rng(), group), group)
    assert rolling.load_latest().state["step"] == 5
    assert {o.key.split("/")[1] for o in store.list("roll/step-")} == {"step-00000005"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_save_of_gpu_state_goes_through_reused_pinned_buffers(store):
    # The copies to the pinned buffers are queued, not waited for: training's next in-place
    # update (same stream) must not reach the checkpoint, and the second save reuses the buffers.
    device = torch.device("cuda", torch.cuda.current_device())
    rolling = RollingCheckpoints(store, "roll/")
    group = SingleProcess()
    for step in (3, 5):
        state = trained_state(step)
        state["model"] = {k: v.to(device) for k, v in state["model"].items()}
        snapshot = {k: v.cpu() for k, v in state["model"].items()}
        pending = rolling.begin(state, capture_rng(device), group)
        for tensor in state["model"].values():
            tensor.mul_(3.0).add_(1.0)
        rolling.commit(pending, group)
        assert_equal_states(rolling.load_latest().state["model"], snapshot)
        buffers = {k: v.data_ptr() for k, v in rolling._pinned.items()}
        assert buffers and all(t.is_pinned() for t in rolling._pinned.values())
        if step == 3:
            first = buffers
    assert buffers == first


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reserved_pinned_buffers_are_the_ones_the_first_save_fills(store):
    # reserve() allocates the rank's buffers beside training (a background thread); the first
    # save then only queues its copies into them.
    device = torch.device("cuda", torch.cuda.current_device())
    rolling = RollingCheckpoints(store, "roll/")
    group = SingleProcess()
    state = trained_state(3)
    state["model"] = {k: v.to(device) for k, v in state["model"].items()}
    rolling.reserve(state, group)
    rolling._reserving.join()
    reserved = {k: v.data_ptr() for k, v in rolling._pinned.items()}
    assert set(reserved) == {f"/model/{k}" for k in state["model"]}  # the GPU tensors only
    snapshot = {k: v.cpu() for k, v in state["model"].items()}
    rolling.commit(rolling.begin(state, capture_rng(device), group), group)
    assert {k: v.data_ptr() for k, v in rolling._pinned.items()} == reserved
    assert_equal_states(rolling.load_latest().state["model"], snapshot)


def test_reserving_buffers_for_a_cpu_state_starts_nothing(tmp_path):
    rolling = RollingCheckpoints(open_storage(tmp_path), "roll/")  # storage plays no part here
    rolling.reserve(trained_state(3), SingleProcess())
    assert rolling._reserving is None and rolling._pinned == {}


def test_a_failed_background_write_fails_the_commit(tmp_path):
    store = open_storage(tmp_path)
    (tmp_path / "roll").write_text("a file where the folder should be")
    rolling = RollingCheckpoints(store, "roll/")
    group = SingleProcess()
    pending = rolling.begin(trained_state(), capture_rng(), group)
    with pytest.raises(OSError):
        rolling.commit(pending, group)
    assert not store.exists("roll/" + LATEST)
