"""The target side of speculative decoding: forwards with a cache that can take back rejected tokens.

A verify step appends a whole block to the target's cache; after the comparison only the accepted
prefix may stay. Attention layers drop the rejected keys/values (``crop``). Hybrid targets
(Qwen3-Next/3.5/3.6: Gated DeltaNet layers beside attention) cannot do that: a linear-attention
layer keeps one recurrent state that has already absorbed the rejected tokens, and
``Cache.crop`` restores only the convolution window, not the recurrent state. For those
targets the runner snapshots every linear-attention state before the verify forward and, when
tokens are rejected, restores the snapshot, drops the whole block from the attention layers and
runs the accepted tokens again, so the state is the one plain decoding would have.

Only public cache APIs are used (``DynamicCache(config=...)``, per-layer ``crop`` with a negative
count, ``activate_past_recording`` on sliding-window layers, the ``conv_states`` /
``recurrent_states`` of linear-attention layers); they exist alike in transformers 5.17 and 5.24.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from dflash_pipeline.model.taps import concatenated_taps, decoder_layers, layer_outputs

try:  # the linear-attention cache layers (hybrid targets) arrived in transformers 5
    from transformers.cache_utils import LinearAttentionCacheLayerMixin
except ImportError:  # pragma: no cover - older transformers have no hybrid cache layers
    LinearAttentionCacheLayerMixin = ()


class TargetCacheError(RuntimeError):
    """The target's cache has a layer kind this runner cannot roll back."""


@dataclass
class LinearStateSnapshot:
    """Copies of one linear-attention layer's states, taken before a verify forward."""

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    has_previous: dict[int, bool]


def _is_linear(layer) -> bool:
    return bool(LinearAttentionCacheLayerMixin) and isinstance(layer, LinearAttentionCacheLayerMixin)


def _is_attention(layer) -> bool:
    return isinstance(layer, DynamicLayer)


def _snapshot(layer) -> LinearStateSnapshot:
    return LinearStateSnapshot(
        conv={i: s.clone() for i, s in layer.conv_states.items() if s is not None},
        recurrent={i: s.clone() for i, s in layer.recurrent_states.items() if s is not None},
        has_previous=dict(layer.has_previous_state),
    )


def _restore(layer, snap: LinearStateSnapshot) -> None:
    # Copied in place where shapes allow: the layer keeps static tensor addresses (CUDA graphs).
    for states, saved in ((layer.conv_states, snap.conv), (layer.recurrent_states, snap.recurrent)):
        for i, tensor in saved.items():
            if states.get(i) is not None and states[i].shape == tensor.shape:
                states[i].copy_(tensor)
            else:
                states[i] = tensor.clone()
    layer.has_previous_state.clear()
    layer.has_previous_state.update(snap.has_previous)


def _crop_attention(layer, tokens_to_remove: int) -> None:
    """Drop the last ``tokens_to_remove`` positions of an attention layer (0 still trims a
    sliding-window layer back to its window)."""
    if _is_linear(layer):
        # A layer holding both kinds: crop its key/value part only; the linear part was restored.
        base = DynamicSlidingWindowLayer if isinstance(layer, DynamicSlidingWindowLayer) else DynamicLayer
        base.crop(layer, -tokens_to_remove)
    else:
        layer.crop(-tokens_to_remove)


class TargetRunner:
    """One sequence through the target: prefill, verify blocks, keep the accepted prefix.

    ``tap_layer_ids`` are 0-based decoder layers whose outputs (before the final norm,
    ``model.taps``) feed the drafter, concatenated in order into rows of [K*H].
    """

    def __init__(self, model, tap_layer_ids: list[int] | tuple[int, ...] = ()):
        self.model = model.eval()
        self.tap_layer_ids = list(tap_layer_ids)
        text_config = model.config.get_text_config(decoder=True)
        self.num_layers = text_config.num_hidden_layers
        bad = [i for i in self.tap_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"tap layer ids {bad} are outside the target's {self.num_layers} decoder layers "
                "(ids are 0-based: id i taps the output of layer i, HF hidden_states[i + 1])"
            )
        # transformers 5.24 renamed the forward's cache argument; 5.17 only knows the old name.
        params = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in params else "past_key_values"
        # Prefill needs only the last position's logits: [P, V] fp32 would be GBs on long prompts.
        self.can_keep_last_logits = "logits_to_keep" in params
        self.device = next(model.parameters()).device
        self.layers = decoder_layers(model)
        self.cache = None
        self.length = 0
        self._pending: tuple[list[int], list[LinearStateSnapshot] | None] | None = None

    # --- a new sequence ---------------------------------------------------------------------
    def start(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0
        self._pending = None
        self._classify_layers()

    def _classify_layers(self) -> None:
        """Sort the cache's layers into linear-attention and attention ones. Run again before
        each verify: a cache built without layer types creates its layers during prefill."""
        self.linear_layers, self.attention_layers, self.sliding_layers = [], [], []
        for index, layer in enumerate(self.cache.layers):
            if _is_linear(layer):
                self.linear_layers.append(layer)
                if _is_attention(layer):
                    if isinstance(layer, DynamicSlidingWindowLayer):
                        raise TargetCacheError(
                            f"cache layer {index} ({type(layer).__name__}) mixes linear attention "
                            "with a sliding window; rolling it back is not supported"
                        )
                    self.attention_layers.append(layer)
            elif _is_attention(layer):
                if isinstance(layer, DynamicSlidingWindowLayer):
                    # Keep the evicted keys until the next crop, so rejected tokens can go.
                    layer.activate_past_recording()
                    self.sliding_layers.append(layer)
                self.attention_layers.append(layer)
            else:
                raise TargetCacheError(
                    f"cache layer {index} is a {type(layer).__name__}; the evaluation loop can roll "
                    "back only attention (DynamicLayer) and linear-attention cache layers"
                )

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    # --- forwards -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, tokens: list[int], taps: bool = True, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens`` to the sequence; returns logits [n, V] (fp32; [1, V] with
        ``last_logits_only``) and the taps [n, K*H] of every appended position."""
        if self.cache is None:
            raise RuntimeError("TargetRunner.start() must be called before the first forward")
        want_taps = taps and bool(self.tap_layer_ids)
        ids = torch.tensor([tokens], device=self.device)
        extra = {"logits_to_keep": 1} if last_logits_only and self.can_keep_last_logits else {}
        for layer in self.sliding_layers:
            # A recording sliding-window layer holds more than its window until cropped; the
            # attention mask assumes the window, so trim before every forward (crop(0)).
            if layer.is_initialized:
                layer.crop(0)
        # Hooks, not output_hidden_states: its last entry is the final-normed state (model.taps).
        with layer_outputs(self.layers, self.tap_layer_ids if want_taps else ()) as captured:
            out = self.model(input_ids=ids, use_cache=True, **{self.cache_argument: self.cache}, **extra)
        self.length += len(tokens)
        tap_rows = concatenated_taps(captured, self.tap_layer_ids)[0] if want_taps else None
        logits = out.logits[0, -1:] if last_logits_only else out.logits[0]
        return logits.float(), tap_rows

    def verify(self, block: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a block in one forward, remembering what is needed to take part of it back."""
        self._classify_layers()
        snapshots = [_snapshot(layer) for layer in self.linear_layers] if self.is_hybrid else None
        logits, taps = self.forward(block)
        self._pending = (list(block), snapshots)
        return logits, taps

    def keep(self, accepted: int, block_taps: torch.Tensor | None) -> torch.Tensor | None:
        """Keep the first ``accepted`` tokens of the last verified block and drop the rest.

        Returns the taps of the kept positions: the verify forward's rows, or for a hybrid target
        whose state had to be rebuilt, the rows of the forward that rebuilt it.
        """
        if self._pending is None:
            raise RuntimeError("keep() without a verify() before it")
        block, snapshots = self._pending
        self._pending = None
        if not 1 <= accepted <= len(block):
            raise ValueError(f"can keep 1..{len(block)} tokens of the block, not {accepted}")
        rejected = len(block) - accepted
        if rejected and snapshots is not None:
            # Recurrent states cannot be cropped: go back to before the block and redo its prefix.
            for layer, snap in zip(self.linear_layers, snapshots):
                _restore(layer, snap)
            for layer in self.attention_layers:
                _crop_attention(layer, len(block))
            self.length -= len(block)
            _, taps = self.forward(block[:accepted], last_logits_only=True)
            return taps
        for layer in self.attention_layers:
            _crop_attention(layer, rejected)
        self.length -= rejected
        return None if block_taps is None else block_taps[:accepted]


def target_stop_token_ids(tokenizer, generation_config) -> set[int]:
    """Tokens that end a reply: the tokenizer's eos, the generation config's eos ids (the loaded
    model's ``generation_config``, or None), and Qwen's end-of-turn marker when the vocabulary
    has it."""
    stop = set()
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        stop.update(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        stop.add(end_of_turn)
    return stop


def loop_target(model, tokenizer, layer_ids) -> tuple[TargetRunner, frozenset[int]]:
    """What the loop decodes with on ``model``: its runner tapping ``layer_ids`` (the drafter's)
    and the tokens that end a reply."""
    stop = frozenset(target_stop_token_ids(tokenizer, getattr(model, "generation_config", None)))
    return TargetRunner(model, layer_ids), stop
