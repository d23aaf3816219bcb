"""The drafter in the checkpoint format of vllm-project/speculators 0.9 (the "speculators format"):
a ``config.json`` with ``speculators_model_type`` and ``speculators_config``, and a
``model.safetensors`` that is self-contained: the drafter's own tensors under the same names as
the z-lab export, plus the verifier's (the target's) ``embed_tokens.weight`` and
``lm_head.weight``, which the speculators package's DFlash converter fills from the verifier.

Who reads it (speculators 0.9.0 and vLLM 0.32, read from their wheels):

- speculators: ``SpeculatorModel.from_pretrained`` picks ``DFlashDraftModel`` (or
  ``DFlash2DraftModel``) by ``speculators_model_type`` and builds the draft layers from
  ``transformer_layer_config`` (a Qwen3 config), the ``fc`` input from
  ``aux_hidden_state_layer_ids``. Its own converter writes the embedding and LM head into the
  model and then leaves them out of the saved file (full-vocabulary drafts), so its loader reads
  them from ``speculators_config.verifier.name_or_path`` again; this export keeps them in the file
  (the verifier's tensors as stored, not cast), so the folder loads without missing weights.
- vLLM (``vllm/transformers_utils/configs/speculators/algos.py``, ``update_dflash``): the draft
  config is ``transformer_layer_config`` plus ``eagle_aux_hidden_state_layer_ids =
  aux_hidden_state_layer_ids``, ``dflash_config.target_layer_ids = aux ids - 1``,
  ``dflash_config.mask_token_id`` and ``dflash_config.causal = not sliding_window_non_causal``,
  which overrides the causality of EVERY draft layer. ``dflash2`` adds the four DFlash2 sizes.
  ``embed_tokens`` / ``lm_head`` found in the file are compared with the target's and shared when
  equal (bit for bit), so a copy in the verifier's own dtype serves exactly as the z-lab export.
  ``speculative_tokens`` (B - 1) is what ``vllm serve <this folder>`` drafts per step, the
  verifier's ``name_or_path`` the target it serves.

What the format cannot express: a drafter that mixes sliding-window layers (causal within the
block, as trained here) with full-attention layers (bidirectional). The format has one causality
flag, ``sliding_window_non_causal``; speculators applies it to sliding layers only, but vLLM turns
it into ``dflash_config.causal`` for all layers, so either the full layers or the sliding ones
would be served with the wrong mask. Such a drafter is exported in the z-lab format only
(``refusal``).

Sliding windows: vLLM and this pipeline count the window from each query's own position (HF
semantics); speculators' own training mask counts it from the block's anchor. Served by vLLM the
export is exact; training it further in speculators moves the window's edge: slot k of a block
sees context positions from anchor + k - W + 1 here and from anchor - W there (k + 1 more).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_pipeline.core import layout
from dflash_pipeline.model.config import DFLASH, DFLASH2, DFLASH2_KEYS, FULL, SLIDING, DrafterConfig

if TYPE_CHECKING:  # torch is imported where tensors are read: the rules import this module
    import torch

SPECULATORS_VERSION = "0.9.0"
# The folder beside the z-lab export's files (inside the drafter folder), and its files in a run.
FOLDER = "speculators"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
RUN_CONFIG = f"{layout.DRAFTER_DIR}/{FOLDER}/{CONFIG_NAME}"
RUN_WEIGHTS = f"{layout.DRAFTER_DIR}/{FOLDER}/{WEIGHTS_NAME}"
# speculators_model_type and the speculators model class, per drafter algorithm.
MODEL_TYPES = {DFLASH: "dflash", DFLASH2: "dflash2"}
CLASSES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}
# The verifier's tensors the file carries (speculators' names).
EMBED = "embed_tokens.weight"
LM_HEAD = "lm_head.weight"
VERIFIER_TENSORS = (EMBED, LM_HEAD)
# z-lab config keys that describe the DFlash wrapper, not the draft's Qwen3 layers: they become
# the speculators config's own fields (block_size, aux_hidden_state_layer_ids, mask_token_id).
WRAPPER_KEYS = ("architectures", "block_size", "dflash_config", "num_target_layers", "eagle_aux_hidden_state_layer_ids")


def refusal(layer_types: list[str] | None) -> str | None:
    """One line saying why the speculators format cannot express a drafter with these layer
    types (None or [] = all full attention), or None when it can."""
    kinds = set(layer_types or [FULL])
    if kinds == {FULL, SLIDING}:
        return (
            "speculators format not written (z-lab format only): the drafter mixes sliding-window "
            "layers (causal within the block) with full-attention layers (bidirectional), and the "
            "format's one flag, sliding_window_non_causal, becomes vLLM's dflash_config.causal for "
            "every layer"
        )
    return None


def run_outputs(layer_types: list[str] | None) -> dict[str, str]:
    """The export rule's outputs for the speculators format, as run-relative keys: none for a
    drafter the format cannot express."""
    if refusal(layer_types) is not None:
        return {}
    return {"speculators_config": RUN_CONFIG, "speculators_weights": RUN_WEIGHTS}


def transformer_layer_config(config: DrafterConfig) -> dict:
    """The draft layers' Qwen3 config: the z-lab config without the DFlash wrapper's keys (the
    rope fields, layer types, window and the uniform ``is_causal`` stay, as in z-lab's)."""
    zlab = config.to_zlab()
    return {key: value for key, value in zlab.items() if key not in WRAPPER_KEYS}


def speculators_config(config: DrafterConfig, verifier: str, verifier_architectures: list[str]) -> dict:
    """The ``config.json`` of the speculators-format folder. ``verifier``: the target's name or
    path, as speculators' loader and ``vllm serve`` read it."""
    reason = refusal(config.layer_types)
    if reason is not None:
        raise ValueError(reason)
    causal = config.uniform_causality()
    document = {
        "architectures": [CLASSES[config.algorithm]],
        "speculators_model_type": MODEL_TYPES[config.algorithm],
        "speculators_version": SPECULATORS_VERSION,
        # Capture indices: tap id i (output of layer i) is hidden_states[i + 1], as vLLM's
        # eagle_aux_hidden_state_layer_ids (vLLM subtracts the 1 again for target_layer_ids).
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "block_size": config.block_size,
        "draft_vocab_size": config.vocab_size,
        "mask_token_id": config.mask_token_id,
        # Slot 0 holds the anchor (the bonus token); slots 1..B-1 are the drafts.
        "sample_from_anchor": False,
        # Sliding layers are causal within the block here; for an all-full drafter the flag
        # only decides vLLM's dflash_config.causal, which must then be false.
        "sliding_window_non_causal": not causal,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": config.dtype,
        "transformer_layer_config": transformer_layer_config(config),
        "speculators_config": {
            "algorithm": MODEL_TYPES[config.algorithm],
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
    if config.is_dflash2:
        document.update({key: getattr(config, key) for key in DFLASH2_KEYS})
    return document


def verifier_name(target: str | Path) -> str:
    """What the config names as the verifier: a local target folder as an absolute path (it is
    read from wherever the folder is loaded), anything else as given."""
    path = Path(target)
    return str(path.resolve()) if path.exists() else str(target)


def verifier_architectures(target: str | Path) -> list[str]:
    try:
        data = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return list(data.get("architectures") or [])


def verifier_tensors(target: str | Path, config: DrafterConfig) -> dict[str, torch.Tensor]:
    """The target's embedding and LM head as its checkpoint stores them (dtype kept; a tied LM
    head is a copy of the embedding), checked against the drafter's vocab and hidden size."""
    import torch

    from dflash_pipeline.model.target import load_target_embeddings

    embed, head = load_target_embeddings(str(target), "cpu", None)
    if head is embed:
        head = embed.clone()  # one file cannot hold one storage under two names
    expected = (config.vocab_size, config.hidden_size)
    for name, tensor in ((EMBED, embed), (LM_HEAD, head)):
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{target}: the verifier's {name} is {tuple(tensor.shape)}, the drafter needs "
                f"{expected} (vocab_size, hidden_size)"
            )
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{target}: non-finite values in the verifier's {name}")
    return {EMBED: embed.contiguous(), LM_HEAD: head.contiguous()}


def speculators_tensors(body: dict[str, torch.Tensor], verifier: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors: the drafter's, under their z-lab names (speculators' DFlash model
    names them the same), and the verifier's embedding and LM head."""
    clash = sorted(set(body) & set(verifier))
    if clash:
        raise ValueError(f"the drafter's tensors already hold {clash}")
    return {**body, **verifier}
