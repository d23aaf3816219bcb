"""In-segment checkpoints: step-named folders below the segment's progress prefix with a
``latest.json`` pointer, written after the checkpoint's index; older step folders are removed
after the pointer moved, so there is always one complete checkpoint to resume from. Saves are
synchronous (``save``) or in the background (``begin``/``commit``, the trainer commits at a step
boundary once every rank's upload is done); the format is ``dflash_pipeline.training.checkpoint``.
"""

from __future__ import annotations

import json
import threading

import torch

from dflash_pipeline.core.storage import Storage
from dflash_pipeline.training.checkpoint import (
    LATEST,
    Checkpoint,
    Collective,
    PendingSave,
    SingleProcess,
    gather_entries,
    load_checkpoint,
    pinned_buffer,
    rank_share,
    save_checkpoint,
    split_tensors,
    stage_shard,
    staged_event,
    write_index,
)


class RollingCheckpoints:
    """Step-named in-segment checkpoints under ``prefix`` with a ``latest.json`` pointer."""

    def __init__(self, storage: Storage, prefix: str):
        self.storage = storage
        self.prefix = prefix
        # Reused by every background save of this rank: at most one is in flight (the trainer
        # commits one before it begins the next), so the buffers are free again by then.
        self._pinned: dict[str, torch.Tensor] = {}
        self._reserving: threading.Thread | None = None

    def step_prefix(self, step: int) -> str:
        return f"{self.prefix}step-{step:08d}/"

    def save(self, state: dict, rng: dict, group: Collective | None = None) -> None:
        group = group or SingleProcess()
        step_prefix = self.step_prefix(int(state["step"]))
        save_checkpoint(self.storage, step_prefix, state, rng, group)
        if group.rank == 0:
            self.point_to(step_prefix)

    def reserve(self, state: dict, group: Collective) -> None:
        """Allocate this rank's page-locked buffers for ``state``'s GPU tensors in a background
        thread, so that the job's first background save does not allocate them on the training
        thread (measured on an H200: 1.9 s for a 2.6 GB share, ~1.4 GB/s of pinning). Call it
        once the state has every tensor it will have (after the first optimizer step); ``begin``
        waits for it. Nothing to do for CPU tensors."""
        _, tensors = split_tensors(state)
        gpu = [p for p in rank_share(tensors, group.rank, group.world) if tensors[p].is_cuda]
        if not gpu:
            return
        # Only shapes and dtypes are read: meta tensors stand in for the live ones.
        like = {p: torch.empty_like(tensors[p], device="meta") for p in gpu}
        device = tensors[gpu[0]].device

        def allocate() -> None:
            # On the rank's own device: a new thread starts on device 0, where another rank's
            # pinning must not create a CUDA context.
            with torch.cuda.device(device):
                for p, t in like.items():
                    pinned_buffer(self._pinned, p, t)

        self._reserving = threading.Thread(target=allocate, name="checkpoint-pinned-buffers", daemon=True)
        self._reserving.start()

    def begin(self, state: dict, rng: dict, group: Collective) -> PendingSave:
        """Start writing this rank's shard in the background (the tensors are copied first);
        ``commit`` it once every rank's ``done()``."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
        step_prefix = self.step_prefix(int(state["step"]))
        payload = stage_shard(state, rng, group.rank, group.world, copy=True, pinned=self._pinned)
        pending = PendingSave(self.storage, step_prefix, payload, staged_event(payload))
        pending.step = int(state["step"])
        return pending

    def commit(self, pending: PendingSave, group: Collective) -> None:
        """Every rank calls this for the same save: rank 0 writes its index, then the pointer."""
        entries = gather_entries(group, pending.result())
        if group.rank == 0:
            write_index(self.storage, pending.prefix, pending.step, group.world, entries)
            self.point_to(pending.prefix)

    def point_to(self, step_prefix: str) -> None:
        self.storage.write_text(self.prefix + LATEST, json.dumps({"prefix": step_prefix}))
        for obj in self.storage.list(self.prefix + "step-"):
            if not obj.key.startswith(step_prefix):
                self.storage.delete(obj.key)

    def load_latest(self, map_location="cpu", rank: int = 0, group: Collective | None = None) -> Checkpoint | None:
        if not self.storage.exists(self.prefix + LATEST):
            return None
        pointer = json.loads(self.storage.read_text(self.prefix + LATEST))
        return load_checkpoint(self.storage, pointer["prefix"], map_location, rank, group)

    def clear(self) -> None:
        self.storage.delete_prefix(self.prefix)
