"""Training checkpoints through the storage layer (local or S3).

A checkpoint is a folder of objects: the drafter weights (safetensors), the trainer state
(optimizer, scheduler, step, data position, RNG; ``torch.save``), and ``checkpoint.json`` with
each object's size and sha256, written LAST. A reader trusts only a folder whose index exists and
whose objects match it, so a crash in the middle of a save never yields a half checkpoint.
In-segment checkpoints go to step-named folders below the segment's progress prefix with a
``latest.json`` pointer (again written last); older step folders are removed after the pointer
moved, so there is always one complete checkpoint to resume from.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_pipeline.core.storage import Storage, StorageError, sha256_file

INDEX = "checkpoint.json"
LATEST = "latest.json"
WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer.pt"


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(
    storage: Storage, prefix: str, weights: dict[str, torch.Tensor], trainer_state: dict
) -> dict:
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        files = {WEIGHTS: Path(tmp) / WEIGHTS, TRAINER_STATE: Path(tmp) / TRAINER_STATE}
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, files[WEIGHTS])
        torch.save(trainer_state, files[TRAINER_STATE])
        index = {"step": trainer_state.get("step"), "files": {}}
        for name, path in files.items():
            index["files"][name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            storage.upload_file(prefix + name, path)
    storage.write_text(prefix + INDEX, json.dumps(index, indent=1))
    return index


def read_index(storage: Storage, prefix: str) -> dict | None:
    if not storage.exists(prefix + INDEX):
        return None
    return json.loads(storage.read_text(prefix + INDEX))


def load_checkpoint(storage: Storage, prefix: str) -> tuple[dict, dict] | None:
    """(weights, trainer_state) of the checkpoint at ``prefix``, or None if there is none."""
    index = read_index(storage, prefix)
    if index is None:
        return None
    with tempfile.TemporaryDirectory(prefix="dflash-ckpt-") as tmp:
        paths = {}
        for name, expected in index["files"].items():
            path = Path(tmp) / name
            try:
                storage.download_file(prefix + name, path)
            except StorageError as err:
                raise CheckpointError(f"checkpoint {storage.join(prefix)}: {err}") from err
            actual = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            if actual != expected:
                raise CheckpointError(
                    f"checkpoint {storage.join(prefix + name)} does not match its index "
                    f"({actual} != {expected}); delete the folder to start that segment again"
                )
            paths[name] = path
        weights = load_file(paths[WEIGHTS])
        trainer_state = torch.load(paths[TRAINER_STATE], weights_only=True)
    return weights, trainer_state


class RollingCheckpoints:
    """Step-named in-segment checkpoints under ``prefix`` with a ``latest.json`` pointer."""

    def __init__(self, storage: Storage, prefix: str):
        self.storage = storage
        self.prefix = prefix

    def save(self, weights: dict, trainer_state: dict) -> None:
        step_prefix = f"{self.prefix}step-{trainer_state['step']:08d}/"
        save_checkpoint(self.storage, step_prefix, weights, trainer_state)
        self.storage.write_text(self.prefix + LATEST, json.dumps({"prefix": step_prefix}))
        for obj in self.storage.list(self.prefix + "step-"):
            if not obj.key.startswith(step_prefix):
                self.storage.delete(obj.key)

    def load_latest(self) -> tuple[dict, dict] | None:
        if not self.storage.exists(self.prefix + LATEST):
            return None
        pointer = json.loads(self.storage.read_text(self.prefix + LATEST))
        return load_checkpoint(self.storage, pointer["prefix"])

    def clear(self) -> None:
        self.storage.delete_prefix(self.prefix)
