"""The target's taps: the outputs of selected decoder layers, concatenated per token.

Tap id i is the OUTPUT of 0-based decoder layer i, i.e. transformers' ``hidden_states[i + 1]``
(index 0 is the embedding output); the residual stream, never the final-normed state
(a drafter fed the normed state trains without error and drafts badly). Forward hooks catch the tapped layers' outputs and the forward
stops after the deepest tapped layer, so neither the layers above it nor the full-vocabulary LM
head run, and no other layer's hidden states are kept. Works for dense Qwen3 and hybrid
Qwen3.5/3.6 (Gated DeltaNet) targets alike: only the decoder-layer list is needed.

Batches are right-padded without an attention mask: attention is causal and the recurrent layers
run left to right, so padding after a sequence never changes that sequence's taps.
"""

from __future__ import annotations

import torch
from torch import nn


class _StopForward(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's list of decoder layers (also inside multimodal wrappers)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    config = getattr(model.config, "text_config", None) or model.config
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            if len(module) == config.num_hidden_layers:
                return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


class TargetTaps:
    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.layers = decoder_layers(model)
        bad = [i for i in self.layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"tap ids {bad} outside the target's {len(self.layers)} layers")
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._captured: dict[int, torch.Tensor] = {}
        self._last = max(self.layer_ids)

    def _hook(self, layer_id: int):
        def hook(module, args, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == self._last:
                raise _StopForward

        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Taps [b, S, K*H] for right-padded ``input_ids`` [b, S]."""
        handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in set(self.layer_ids)]
        self._captured = {}
        try:
            self.decoder(input_ids=input_ids, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:
            raise RuntimeError(f"target layers {missing} produced no output")
        taps = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        self._captured = {}
        return taps
