"""The one place that loads a target: the whole model (frozen, eval mode), or only its embedding
and LM head (which the drafter shares, frozen) straight from the checkpoint files."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_target(model_dir: str, device: str | torch.device = "cpu", dtype=None):
    """The target in eval mode with frozen weights (it is never trained here)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    model.to(device).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def target_embeddings(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head weights (frozen, shared with the drafter)."""
    head = target.get_output_embeddings()
    return target.get_input_embeddings().weight, head.weight


def load_target_embeddings(target_dir: str, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head, read from its safetensors without loading the model."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(target_dir / "model.safetensors"), framework="pt") as fh:
            weight_map = {k: "model.safetensors" for k in fh.keys()}

    def find(suffix):
        names = sorted((k for k in weight_map if k.endswith(suffix)), key=len)
        return names[0] if names else None

    embed_name, head_name = find("embed_tokens.weight"), find("lm_head.weight")
    if embed_name is None:
        raise ValueError(f"{target_dir}: no embed_tokens weight in the checkpoint")

    def load(name):
        with safe_open(str(target_dir / weight_map[name]), framework="pt") as fh:
            return fh.get_tensor(name).to(device=device, dtype=dtype)

    embed = load(embed_name)
    head = load(head_name) if head_name else embed  # tied embeddings
    return embed, head
