"""The target's taps: the outputs of selected decoder layers, concatenated per token.

Tap id i is the OUTPUT of 0-based decoder layer i: the residual stream before the final norm,
never the final-normed state (a drafter fed the normed state trains without error and drafts
badly). transformers' ``hidden_states[i + 1]`` is that tensor for every layer but the last: since
transformers 5 the last entry, ``hidden_states[num_hidden_layers]``, holds the final-normed state.
So taps are always read with forward hooks on the decoder layers, never from
``output_hidden_states``. vLLM's ``extract_hidden_states`` names the same tensor aux layer id
``i + 1`` (its id ``num_hidden_layers`` is the last layer's output before the norm) and returns
the layers in ascending id order whatever order was asked; ``vllm_aux_layer_ids`` and
``vllm_slot_order`` below are the one place those conventions live.

``TargetTaps`` stops the forward after the deepest tapped layer, so neither the layers above it
nor the full-vocabulary LM head run, and no other layer's hidden states are kept. Works for dense
Qwen3 and hybrid Qwen3.5/3.6 (Gated DeltaNet) targets alike: only the decoder-layer list is needed.

Batches are right-padded without an attention mask: attention is causal and the recurrent layers
run left to right, so padding after a sequence never changes that sequence's taps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


def vllm_aux_layer_ids(tap_ids: Sequence[int]) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` that make vLLM capture project taps ``tap_ids``:
    id ``k + 1`` for tap ``k`` (vLLM counts the embedding as 0), sorted and without repeats, the
    order vLLM stores them in."""
    return sorted({int(k) + 1 for k in tap_ids})


def vllm_slot_order(tap_ids: Sequence[int]) -> list[int]:
    """For each tap of ``tap_ids`` in order, its slot in vLLM's captured layers (ascending ids,
    ``vllm_aux_layer_ids``): ``captured[:, vllm_slot_order(ids)]`` is the taps in the asked order."""
    slots = {layer_id: slot for slot, layer_id in enumerate(vllm_aux_layer_ids(tap_ids))}
    return [slots[int(k) + 1] for k in tap_ids]


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


@contextmanager
def layer_outputs(
    layers: nn.ModuleList, layer_ids: Sequence[int], stop_after_last: bool = False
) -> Iterator[dict[int, torch.Tensor]]:
    """Record the outputs of ``layers[i]`` for ``i`` in ``layer_ids`` during the forwards run
    inside the block, into the dict it yields; with ``stop_after_last`` the forward is cut short
    after the deepest of them (the block swallows the stop)."""
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids) if layer_ids else -1

    def hook_for(layer_id: int):
        def hook(module, args, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if stop_after_last and layer_id == last:
                raise _StopForward

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(layer_ids))]
    try:
        yield captured
    except _StopForward:
        pass
    finally:
        for handle in handles:
            handle.remove()


def concatenated_taps(captured: dict[int, torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """The recorded layer outputs concatenated on the hidden dim in ``layer_ids`` order."""
    missing = [i for i in layer_ids if i not in captured]
    if missing:
        raise RuntimeError(f"target layers {missing} produced no output")
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


class TargetTaps:
    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.layers = decoder_layers(model)
        bad = [i for i in self.layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"tap ids {bad} outside the target's {len(self.layers)} layers")
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Taps [b, S, K*H] for right-padded ``input_ids`` [b, S]."""
        with layer_outputs(self.layers, self.layer_ids, stop_after_last=True) as captured:
            self.decoder(input_ids=input_ids, use_cache=False)
        return concatenated_taps(captured, self.layer_ids)
