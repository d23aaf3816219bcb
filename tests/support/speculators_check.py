"""Run by the vLLM CPU environment's Python (``make vllm-env``, which also holds the speculators
package): what the speculators package and vLLM make of an exported speculators-format folder.

    python tests/support/speculators_check.py --speculators DIR... [--zlab DIR...] --out result.json

The JSON it writes, per folder:

- ``loading``: the speculators package's own model class for the folder (picked by its registry
  from ``speculators_model_type``) and Transformers' loading report for it (missing, unexpected
  and mismatched weights, error messages), plus the tensors whose loaded values differ from the
  file's;
- ``official``: the same folder through ``SpeculatorModel.from_pretrained`` as a user calls it
  (it reads the verifier's embedding and LM head again from ``verifier.name_or_path``): the
  tensors that then differ from the file's, and whether any is not finite;
- ``vllm``: for every folder (z-lab ones too), the draft config as
  vLLM 0.32 reads it (``vllm.transformers_utils.config.get_config``, which converts a speculators
  config with vLLM's own ``SpeculatorsConfig``) reduced to the fields its DFlash model and
  proposer use, each layer's (sliding window, causal) as vLLM's DFlash model resolves it, and
  the ``--speculative-config`` vLLM derives from a speculators config.

Standalone on purpose: the vLLM environment does not have this project installed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# What vLLM's DFlash model and proposer read from the draft config (vllm 0.32.0
# qwen3_dflash.py, llm_base_proposer.py, gpu_model_runner.py).
TOP_LEVEL = (
    "architectures",
    "eagle_aux_hidden_state_layer_ids",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "attention_bias",
    "hidden_act",
    "layer_types",
    "sliding_window",
    "target_hidden_size",
)
DFLASH_KEYS = (
    "mask_token_id",
    "target_layer_ids",
    "use_aux_hidden_state",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)


def loading_report(folder: str) -> tuple[dict, dict]:
    import torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(folder)
    cls = SpeculatorModel.registered_model_class_from_config(config)
    stored = load_file(str(Path(folder) / "model.safetensors"))
    # With output_loading_info the class's from_pretrained returns Transformers' report and
    # skips the verifier re-read: the file's own tensors, as its loading rules take them.
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    state = model.state_dict()

    def differing(state: dict) -> list[str]:
        # The file's tensors cast to the model's dtype (the config's: the verifier's embedding
        # and LM head may be stored wider than the drafter's tensors).
        return sorted(
            name
            for name, tensor in stored.items()
            if name not in state or not torch.equal(state[name], tensor.to(state[name].dtype))
        )

    loading = {
        "class": cls.__name__,
        "config_class": type(config).__name__,
        "missing": sorted(info.get("missing_keys") or []),
        "unexpected": sorted(info.get("unexpected_keys") or []),
        "mismatched": sorted(str(m) for m in info.get("mismatched_keys") or []),
        "errors": [str(e) for e in info.get("error_msgs") or []],
        "differing": differing(state),
        "file_tensors": sorted(stored),
        "model_tensors": sorted(state),
    }
    official = SpeculatorModel.from_pretrained(folder)
    state = official.state_dict()
    return loading, {
        "class": type(official).__name__,
        "differing": differing(state),
        "nonfinite": sorted(name for name in stored if name in state and not torch.isfinite(state[name]).all()),
    }


def vllm_view(folder: str) -> dict:
    from vllm.model_executor.models import qwen3_dflash
    from vllm.transformers_utils.config import get_config

    config = get_config(folder, trust_remote_code=False)
    dflash = getattr(config, "dflash_config", None) or {}

    layer_types = getattr(config, "layer_types", None) or []
    mixed = {"sliding_attention", "full_attention"} <= set(layer_types)

    def layer(i: int) -> list:
        if not mixed:
            return list(qwen3_dflash._resolve_layer_attention(config, i))
        # vLLM resolves mixed layers only inside a running V2-runner engine; its window rule by
        # hand, its causality function as it is.
        sliding = layer_types[i] == "sliding_attention"
        window = dflash.get("swa_window_size", config.sliding_window) if sliding else None
        return [window, qwen3_dflash._dflash_layer_causal(config, i)]

    view = {
        "config_class": type(config).__name__,
        **{key: getattr(config, key, None) for key in TOP_LEVEL},
        "dflash_config": {key: dflash.get(key) for key in DFLASH_KEYS},
        # (sliding window or None, causal within the block) per draft layer.
        "layers": [layer(i) for i in range(config.num_hidden_layers)],
    }
    raw = json.loads((Path(folder) / "config.json").read_text())
    if "speculators_config" in raw:
        from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

        view["speculative_config"] = SpeculatorsConfig.extract_vllm_speculative_config(raw)
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--speculators", nargs="+", required=True, help="speculators-format folders")
    parser.add_argument("--zlab", nargs="*", default=[], help="z-lab folders (vLLM's view only)")
    parser.add_argument("--no-load", action="store_true", help="vLLM's view only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result: dict = {}
    for folder in args.speculators:
        entry = result[folder] = {"vllm": vllm_view(folder)}
        if not args.no_load:
            entry["loading"], entry["official"] = loading_report(folder)
    for folder in args.zlab:
        result[folder] = {"vllm": vllm_view(folder)}
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
