"""Export the last segment's drafter in the z-lab format that SGLang and vLLM load:
``config.json`` + ``model.safetensors`` with unprefixed tensor names and no embedding or LM head
(both engines take those from the target; dflash-spec.md §4.1)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_pipeline.model.config import DrafterConfig
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.core.storage import open_storage, write_atomically
from dflash_pipeline.training.checkpoint import load_checkpoint

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def expected_tensor_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an engine loads, with its shape (the loader test checks against this)."""
    drafter = DFlashDrafter(config)
    return {name: tuple(t.shape) for name, t in drafter.state_dict().items()}


def export_drafter(run_url: str, manifest_path: str, config_out: str, weights_out: str, dtype: str) -> dict:
    manifest = json.loads(Path(manifest_path).read_text())
    storage = open_storage(run_url)
    loaded = load_checkpoint(storage, manifest["checkpoint_prefix"])
    if loaded is None:
        raise FileNotFoundError(f"no checkpoint at {storage.join(manifest['checkpoint_prefix'])}")
    weights, _ = loaded
    config = DrafterConfig.from_zlab(manifest["drafter_config"], source=manifest_path)
    config.dtype = dtype
    expected = expected_tensor_shapes(config)
    if set(weights) != set(expected):
        raise ValueError(
            f"checkpoint tensors differ from the drafter's: missing {sorted(set(expected) - set(weights))}, "
            f"unexpected {sorted(set(weights) - set(expected))}"
        )
    tensors = {name: t.to(DTYPES[dtype]).contiguous() for name, t in weights.items()}
    with write_atomically(weights_out) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    with write_atomically(config_out) as tmp:
        tmp.write_text(json.dumps(config.to_zlab(), indent=2) + "\n")
    return {"tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values())}
