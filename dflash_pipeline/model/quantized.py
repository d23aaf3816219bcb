"""A quantized target (``train.target_quantization``): FP8 weight-only storage of the decoder's
linear layers, so a target twice the size fits beside the drafter's training step (a 27B target's
54 GB of bf16 weights become ~27 GB).

Plain torch, so it runs on any device: each ``nn.Linear`` of the decoder keeps its weight as
``float8_e4m3fn`` with one scale per output channel (the channel's largest magnitude maps to the
format's largest value) and dequantizes it to the compute dtype in its forward. The embeddings and
the LM head stay in the compute dtype: the drafter shares them, and they are a small part of a
large target's weights. The taps of a quantized target are not the full-precision target's, so
the quantization is part of the target's identity (``quantized_identity``).
"""

from __future__ import annotations

import torch
from torch import nn

# The values train.target_quantization takes besides null (the schema's enum says the same).
QUANTIZATIONS = ("fp8",)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an FP8 weight and a per-output-channel scale, computed in the input's
    dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.compute_dtype = weight.dtype
        # One scale per output row: a row's outliers do not flatten every other row's values.
        scale = weight.abs().amax(dim=1).float().clamp(min=1e-12) / FP8_MAX
        self.register_buffer("weight_fp8", (weight.float() / scale[:, None]).to(FP8))
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (self.weight_fp8.to(torch.float32) * self.scale[:, None]).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 weight, per-channel scale"


def quantize_fp8(model: nn.Module) -> nn.Module:
    """``model`` with each ``nn.Linear`` but its output embedding (the LM head) replaced by an
    ``Fp8Linear``, one at a time (the full-precision weight is freed as its copy is made, so the
    peak stays at the loaded model's size)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child is not head:
                setattr(parent, name, Fp8Linear(child))
    return model


def quantize(model: nn.Module, quantization: str | None) -> nn.Module:
    if quantization is None:
        return model
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"train.target_quantization is {quantization!r}, not null or one of {list(QUANTIZATIONS)}")
    return quantize_fp8(model)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the decoder's linear weights (``nn.Linear`` and ``Fp8Linear``, scales included),
    the LM head excepted."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    total = 0
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, Fp8Linear):
            total += module.weight_fp8.numel() * module.weight_fp8.element_size()
            total += module.scale.numel() * module.scale.element_size()
    return total


def quantized_identity(digest: str | None, quantization: str | None) -> str | None:
    """The target identity taps and drafters record (``model.target_identity``): the weights'
    digest, with the quantization the target computed in after it (``sampled-v1:<hex>+fp8``), so
    a drafter trained on an FP8 target's taps and served against the bf16 one is named."""
    if digest is None or quantization is None:
        return digest
    return f"{digest}+{quantization}"
