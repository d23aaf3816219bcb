"""Build a tiny target with an MTP head, for measuring MTP in `tune` with real engines.

No small public target carries an MTP head, so `tune`'s MTP setting (SGLang ``NEXTN``, vLLM
``method: mtp``) never ran in a test. This writes one: the MiMo layout (``MiMoForCausalLM``), a
Qwen2 body plus ``num_nextn_predict_layers`` MTP layers under ``model.mtp_layers.<i>.``, which both
engines map to their own MTP draft model (SGLang ``MiMoMTP``, vLLM ``MiMoMTPModel``) from the
target's own folder, with nothing but the target's config and weights.

``model_type`` is ``qwen2``, not MiMo's ``mimo``: transformers has no ``mimo`` config (MiMo's
checkpoints ship one as remote code), and both engines pick the MiMo classes by ``architectures``
alone. So the engines load it without ``--trust-remote-code``, and transformers loads its body
as a ``Qwen2ForCausalLM`` (the MTP weights left unused).

The weights are seeded random, with a planted bigram so that drafts are accepted: the body's
attention and MLP add little to the residual stream (small random projections), so the target's
next token is a fixed function of the current one (``lm_head`` scores token ``pi(t)`` by its
alignment with the embedding of ``t``, ``pi`` a seeded permutation of the ordinary tokens). The
MTP layer's input projection passes the embedding of the token it is given and little of the
target's hidden state, and its block adds little too, so it predicts ``pi`` of that token: what
the target itself will say next. A correctly loaded MTP head is thus accepted almost always, and
one whose weights an engine failed to map is not. Special tokens are never predicted: every
request runs to its token limit.

Run by hand: ``python -m dflash_pipeline.demo.mtp_target --out DIR [--tokenizer-from DEMO_TARGET]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SEED = 0
ARCHITECTURE = "MiMoForCausalLM"
MTP_LAYERS = 1
# The demo target's attention shape (head_dim 32), so the engine settings that serve the demo
# target serve this one; a short body: only the MTP path is under test.
SHAPE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
}
DTYPE = torch.bfloat16
# Scale of the random projections (the residual stream's entries are about 1).
PROJECTION_STD = 0.02
# Norm of a planted lm_head row: the predicted token's logit is about this times sqrt(hidden),
# any other token's a few, so sampling at the usual temperatures keeps the bigram.
HEAD_SCALE = 2.0
# What one decoder layer's weights are named (Qwen2: biased q/k/v projections), with the shape of
# each as a function of the config.
LAYER_WEIGHTS = {
    "self_attn.q_proj.weight": lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.q_proj.bias": lambda c: (c["num_attention_heads"] * c["head_dim"],),
    "self_attn.k_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.k_proj.bias": lambda c: (c["num_key_value_heads"] * c["head_dim"],),
    "self_attn.v_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.v_proj.bias": lambda c: (c["num_key_value_heads"] * c["head_dim"],),
    "self_attn.o_proj.weight": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
    "mlp.gate_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.up_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.down_proj.weight": lambda c: (c["hidden_size"], c["intermediate_size"]),
    "input_layernorm.weight": lambda c: (c["hidden_size"],),
    "post_attention_layernorm.weight": lambda c: (c["hidden_size"],),
}
# The MTP layer's own weights beside its decoder layer's (MiMo's names).
MTP_WEIGHTS = {
    "token_layernorm.weight": lambda c: (c["hidden_size"],),
    "hidden_layernorm.weight": lambda c: (c["hidden_size"],),
    "input_proj.weight": lambda c: (c["hidden_size"], 2 * c["hidden_size"]),
    "final_layernorm.weight": lambda c: (c["hidden_size"],),
}


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint and its shape: the body, the head, the MTP layers."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{layer}.{name}": shape(config) for name, shape in LAYER_WEIGHTS.items()})
    for layer in range(config["num_nextn_predict_layers"]):
        prefix = f"model.mtp_layers.{layer}."
        shapes.update({prefix + name: shape(config) for name, shape in {**LAYER_WEIGHTS, **MTP_WEIGHTS}.items()})
    return shapes


def target_config(tokenizer) -> dict:
    """config.json: a Qwen2 config that names the MiMo architecture and declares its MTP layers."""
    from transformers import Qwen2Config

    special = {
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = Qwen2Config(vocab_size=len(tokenizer), **SHAPE, **special).to_diff_dict()
    config.update(architectures=[ARCHITECTURE], num_nextn_predict_layers=MTP_LAYERS, dtype=str(DTYPE).split(".")[-1])
    return config


def successors(vocab: int, special_ids: set[int], generator: torch.Generator) -> dict[int, int]:
    """The planted bigram: each ordinary token's next token, a permutation of the ordinary tokens."""
    ordinary = [t for t in range(vocab) if t not in special_ids]
    order = torch.randperm(len(ordinary), generator=generator).tolist()
    return {token: ordinary[i] for token, i in zip(ordinary, order)}


def planted_weights(config: dict, special_ids: set[int], seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded random weights with the planted bigram (module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * PROJECTION_STD
    embed = torch.randn((config["vocab_size"], hidden), generator=generator)
    weights["model.embed_tokens.weight"] = embed
    head = torch.zeros((config["vocab_size"], hidden))
    unit = embed / embed.norm(dim=-1, keepdim=True)
    for token, following in successors(config["vocab_size"], special_ids, generator).items():
        head[following] = HEAD_SCALE * unit[token]
    weights["lm_head.weight"] = head
    for layer in range(config["num_nextn_predict_layers"]):
        # [hidden-state half | token half]: the token's embedding through, the state barely.
        proj = weights[f"model.mtp_layers.{layer}.input_proj.weight"]
        proj[:, hidden:] = torch.eye(hidden)
    return {name: tensor.to(DTYPE).contiguous() for name, tensor in weights.items()}


def load_tokenizer(tokenizer_from: str | Path | None):
    """The demo target's tokenizer: read from a built demo target, else built by its own code;
    its length limit this target's."""
    if tokenizer_from is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    else:
        from dflash_pipeline.demo.build_model import build_tokenizer

        tokenizer = build_tokenizer()
    tokenizer.model_max_length = SHAPE["max_position_embeddings"]
    return tokenizer


def build_mtp_target(out_dir: str | Path, tokenizer_from: str | Path | None = None, *, seed: int = SEED) -> Path:
    """Write the target (config, generation config, weights, tokenizer) to ``out_dir``."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_from)
    config = target_config(tokenizer)
    weights = planted_weights(config, set(tokenizer.all_special_ids), seed)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    (out_dir / "model.safetensors").chmod(0o666 & ~umask)  # the writer makes it owner-only
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # The demo target's sampling defaults (Qwen3's).
    GenerationConfig(**special, do_sample=True, temperature=0.6, top_p=0.95, top_k=20).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write the target to")
    parser.add_argument("--tokenizer-from", type=Path, help="a built demo target to take the tokenizer from")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    out = build_mtp_target(args.out, args.tokenizer_from, seed=args.seed)
    log.info("MTP target (%s, %d MTP layer) written to %s", ARCHITECTURE, MTP_LAYERS, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
