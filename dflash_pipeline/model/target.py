"""The one place that loads a target: the whole model (frozen, eval mode), or only its embedding
and LM head (which the drafter shares, frozen) straight from the checkpoint files; and the dtype
the target computes in on a device.

torch is imported inside the functions that need it: planning (``stages.preflight``) asks
``target_compute_dtype`` without paying for torch's import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def target_compute_dtype(device: str | torch.device) -> str:
    """The dtype (its torch name) the target computes in on ``device``: bfloat16 on a GPU (the
    dtype targets are trained and served in, at half fp32's memory and time), float32 on CPU
    (where bf16 matmuls are slow and fp32 keeps tests exact). Online training and ``extract``
    both load the target in it, so stored taps are what online training computes on that device."""
    device_type = getattr(device, "type", None) or str(device).split(":")[0]
    return "bfloat16" if device_type == "cuda" else "float32"


def load_target(model_dir: str, device: str | torch.device = "cpu", dtype=None, quantization: str | None = None):
    """The target in eval mode with frozen weights (it is never trained here); with
    ``quantization`` (``train.target_quantization``: fp8) its decoder's linear weights stored
    quantized (``model.quantized``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.model.quantized import quantize

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    # Quantized where it is loaded, before it moves: the device never holds the full-size weights.
    quantize(model, quantization).to(device).eval()
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
            weight_map = {k: "model.safetensors" for k in fh.keys()}  # noqa: SIM118 (a safetensors handle is not iterable)

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
