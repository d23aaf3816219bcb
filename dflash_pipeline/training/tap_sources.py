"""Where a training step's target taps come from, behind one interface the trainer takes.

Three sources: the target loaded in this process (``train.mode: online``), a taps server on the
job's node (online with ``train.taps_from: engine``, ``engines.engine_taps.EngineTapSource``),
or taps stored by `extract` (``train.mode: offline``, ``data.hidden.HiddenShards``). Each gives
the taps of a batch, right-padded [b, S, K*H] on the step's device, and may fetch later batches
ahead (``prefetch_depth`` of them; 0: it computes or reads a batch when asked). Whatever the
source, the trainer also needs the target's embedding and LM head, and the digest of the
weights the taps come from (``model.target_identity``), which the manifest and the export name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dflash_pipeline.model import target_identity
from dflash_pipeline.model.quantized import quantized_identity


class TapSource(Protocol):
    prefetch_depth: int  # batches fetched ahead of the one trained on (0: none)

    def taps(self, sequences, input_ids: torch.Tensor, device, dtype) -> torch.Tensor:
        """Taps [b, S, K*H] of the batch ``sequences``, collated as ``input_ids`` [b, S]."""

    def prefetch(self, sequences) -> None:
        """Start on a later batch's taps (``taps`` of the same sequence objects takes them)."""


class TargetTapSource:
    """The target in this process computes each batch's taps when the step asks."""

    prefetch_depth = 0

    def __init__(self, target_taps):
        self.target_taps = target_taps

    def taps(self, sequences, input_ids: torch.Tensor, device, dtype) -> torch.Tensor:
        return self.target_taps(input_ids)

    def prefetch(self, sequences) -> None:
        """Computed when used."""


class TapSourceError(RuntimeError):
    """The stored taps cannot train this drafter (over the budget, another target's)."""


@dataclass
class TrainingTarget:
    """What training takes from the target: its taps, embedding and LM head, its weights' digest."""

    source: TapSource
    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    weights: dict


def open_training_target(
    settings: dict,
    target_dir: str,
    drafter_config,
    device,
    dtype,
    *,
    engine_source: TapSource | None = None,
    hidden: dict[str, str] | None = None,
    storage=None,
    world: int = 1,
) -> TrainingTarget:
    """The segment's tap source: ``engine_source`` where the job runs one (taps from an engine),
    else the target loaded here (online), else the stored taps of ``hidden`` (shard -> manifest
    path, offline), refused before any rank downloads them when over ``train.offline_max_bytes``
    or of other target weights."""
    from dflash_pipeline.model.target import load_target, load_target_embeddings, target_embeddings

    quantization = settings.get("target_quantization")
    # The taps this segment trains on are the quantized target's where it is one (engine or not).
    weights = quantized_identity(target_identity.weights_digest(target_dir), quantization)
    if settings["mode"] == "online" and engine_source is None:
        from dflash_pipeline.model.taps import TargetTaps

        target = load_target(target_dir, device, dtype, quantization)
        embed, lm_head = target_embeddings(target)
        return TrainingTarget(
            TargetTapSource(TargetTaps(target, drafter_config.target_layer_ids)), embed, lm_head, weights
        )
    if settings["mode"] == "online":
        source = engine_source
    else:
        from dflash_pipeline.data.hidden import HiddenShards
        from dflash_pipeline.training.offline import OfflineBudgetError, check_stored

        manifests = {k: json.loads(Path(p).read_text()) for k, p in (hidden or {}).items()}
        try:
            check_stored(settings, manifests, world)
            weights = target_identity.stored_target_weights(manifests, weights)
        except (OfflineBudgetError, target_identity.TargetMismatch) as err:
            raise TapSourceError(str(err)) from None
        source = HiddenShards(storage, hidden or {}, drafter_config)
    embed, lm_head = load_target_embeddings(target_dir, device, dtype)
    return TrainingTarget(source, embed, lm_head, weights)
