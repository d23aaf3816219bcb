"""The drafter's configuration and its z-lab ``config.json`` form (what SGLang and vLLM read).

The fields that silently break serving when wrong (docs/evaluation.md, "What the export writes
for the engines") are written explicitly: ``block_size`` both at top level and in
``dflash_config``, the 0-based tapped layer ids, the mask token id, the layer types and the
draft's own rope fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_pipeline.core.config import target_layer_order_problem

FULL = "full_attention"
SLIDING = "sliding_attention"
DFLASH = "dflash"
DFLASH2 = "dflash2"
ALGORITHMS = (DFLASH, DFLASH2)
ARCHITECTURES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}
# The DFlash2 hyperparameters the checkpoint carries (docs/training.md, "DFlash2"), in dflash_config.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DrafterConfigError(ValueError):
    pass


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default taps: one middle layer for a 1-layer drafter, else evenly spaced from layer 1
    to layer N-3 (Python's round, half to even), as the DFlash reference and both engines do."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# Every drafter config field that vLLM's `dflash` and SGLang's `DFLASH` read (vLLM 0.20.1 source
# and later fixes; SGLang 0.5.x; docs/evaluation.md), who reads it, and what the export
# writes. ``"uniform"``: written only when all layers are of one kind (see ``to_zlab``).
ENGINE_FIELDS = {
    "dflash_config.mask_token_id": ("vllm sglang zlab", "the mask token the drafter was trained with"),
    "dflash_config.target_layer_ids": ("vllm sglang zlab", "0-based layers whose output is tapped"),
    "dflash_config.block_size": ("sglang zlab", "training block size"),
    "dflash_config.use_aux_hidden_state": ("vllm", "true: the taps are the context"),
    "dflash_config.use_swa": ("vllm", "any sliding-window layer"),
    "dflash_config.swa_window_size": ("vllm sglang", "the sliding window (HF semantics), null without"),
    "dflash_config.causal": ("vllm", "uniform: all sliding -> true, all full -> false"),
    "is_causal": ("sglang zlab vllm", "uniform, as dflash_config.causal"),
    "layer_types": ("vllm sglang zlab", "per layer full_attention / sliding_attention"),
    "sliding_window": ("vllm sglang zlab", "the window, null without sliding layers"),
    "use_sliding_window": ("zlab", "any sliding-window layer"),
    "eagle_aux_hidden_state_layer_ids": ("vllm", "capture indices: target_layer_ids + 1"),
    "block_size": ("sglang zlab", "training block size (older readers)"),
    "num_target_layers": ("zlab", "the target's layer count"),
    "rope_theta": ("vllm sglang zlab", "the drafter's RoPE base"),
    "rope_parameters": ("vllm sglang", "rope_type default, rope_theta"),
    "rope_scaling": ("zlab", "null: no scaling"),
    "head_dim": ("vllm sglang zlab", "attention head width"),
    "num_hidden_layers": ("vllm sglang zlab", "drafter layers"),
    "num_attention_heads": ("vllm sglang zlab", ""),
    "num_key_value_heads": ("vllm sglang zlab", ""),
    "hidden_size": ("vllm sglang zlab", "= the target's"),
    "intermediate_size": ("vllm sglang zlab", ""),
    "rms_norm_eps": ("vllm sglang zlab", ""),
    "max_position_embeddings": ("vllm sglang zlab", ""),
    "vocab_size": ("vllm sglang zlab", "= the target's"),
    "attention_bias": ("vllm sglang zlab", ""),
    "tie_word_embeddings": ("vllm", "false: no LM head of its own"),
}
# Written only when every layer is of one kind: an explicit value applies to all layers.
UNIFORM_ONLY_FIELDS = ("dflash_config.causal", "is_causal")
# What a DFlash2 export adds, read by the authors' DFlash2DraftModel (torch reads dflash_config
# first, then the top level; their MLX loader reads the conv/selector keys from dflash_config
# only, where a missing key silently becomes 0; docs/training.md, "DFlash2"). No serving engine of the
# versions this project runs (vLLM 0.20.1) dispatches DFlash2DraftModel.
DFLASH2_FIELDS = {
    "architectures": ("zlab", '["DFlash2DraftModel"]: the only dispatch key'),
    **{f"dflash_config.{key}": ("zlab", "DFlash2 module shape") for key in DFLASH2_KEYS},
}


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    num_target_layers: int
    target_layer_ids: list[int]
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    dtype: str = "bfloat16"
    # DFlash2 (docs/training.md, "DFlash2"): a grouped dynamic causal convolution around every sublayer
    # and a low-rank candidate selector; the four sizes are None for plain DFlash.
    algorithm: str = DFLASH
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.validate()

    def validate(self) -> None:
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if any(t not in (FULL, SLIDING) for t in self.layer_types):
            problems.append(f"layer_types must be {FULL!r} or {SLIDING!r}: {self.layer_types}")
        if SLIDING in self.layer_types and not self.sliding_window:
            problems.append("sliding_attention layers need sliding_window")
        if self.block_size < 2:
            problems.append(f"block_size must be at least 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} must lie inside the target vocab ({self.vocab_size})")
        bad_ids = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if not self.target_layer_ids or bad_ids:
            problems.append(
                f"target_layer_ids {self.target_layer_ids} must be non-empty 0-based ids of the "
                f"target's {self.num_target_layers} layers"
            )
        elif order := target_layer_order_problem(self.target_layer_ids):
            problems.append(f"target_layer_ids {order}")
        if self.hidden_act != "silu":
            problems.append(f"only hidden_act 'silu' is implemented, got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        problems += self._dflash2_problems()
        if problems:
            raise DrafterConfigError("invalid drafter config: " + "; ".join(problems))

    def _dflash2_problems(self) -> list[str]:
        if self.algorithm not in ALGORITHMS:
            return [f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"]
        values = {key: getattr(self, key) for key in DFLASH2_KEYS}
        if self.algorithm == DFLASH:
            given = [key for key, value in values.items() if value is not None]
            return [f"{', '.join(given)} only apply to algorithm dflash2"] if given else []
        missing = [key for key, value in values.items() if value is None]
        if missing:
            return [f"algorithm dflash2 needs {', '.join(missing)}"]
        # The constraints of the authors' modules: the convolution fits in a block, its groups divide
        # the width, the selector's top-K fits in the vocabulary.
        problems = []
        if not 1 <= self.conv_kernel_size <= self.block_size:
            problems.append(f"conv_kernel_size {self.conv_kernel_size} must lie in 1..block_size ({self.block_size})")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.selector_rank < 1:
            problems.append(f"selector_rank must be at least 1, got {self.selector_rank}")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            problems.append(f"selector_top_k {self.selector_top_k} must lie in 1..vocab_size ({self.vocab_size})")
        return problems

    @property
    def is_dflash2(self) -> bool:
        return self.algorithm == DFLASH2

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    # --- the z-lab format ----------------------------------------------------------------------
    def to_zlab(self) -> dict:
        """The z-lab ``config.json``, with every field an engine reads written explicitly and as
        the drafter was trained (``ENGINE_FIELDS`` lists them), so no engine falls back to a
        default of its own (the engines' defaults differ)."""
        fields = asdict(self)
        sliding = SLIDING in self.layer_types
        dflash = {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "use_aux_hidden_state": True,
            "use_swa": sliding,
            "swa_window_size": self.sliding_window if sliding else None,
        }
        for key in ("block_size", "mask_token_id", "target_layer_ids", "algorithm", *DFLASH2_KEYS):
            fields.pop(key)
        if self.is_dflash2:
            dflash.update({key: getattr(self, key) for key in DFLASH2_KEYS})
        causal = self.uniform_causality()
        if causal is not None:
            dflash["causal"] = causal
        return {
            "architectures": [ARCHITECTURES[self.algorithm]],
            "model_type": "qwen3",
            **fields,
            # Written explicitly so no loader falls back to a guess (a loader missing
            # them would assume its own RoPE defaults and draft at the wrong positions).
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            "max_window_layers": self.num_hidden_layers,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            # An explicit is_causal applies to EVERY layer in SGLang, z-lab and vLLM; training
            # runs full layers bidirectionally and sliding layers causally, so a drafter that mixes
            # them leaves it out and gets exactly that per-layer default everywhere.
            **({"is_causal": causal} if causal is not None else {}),
            # The target capture points, as capture indices (the residual stream after that many
            # layers): tap id i = output of layer i = HF hidden_states[i + 1]. vLLM reads this key
            # before dflash_config.target_layer_ids; vLLM 0.20.1 would otherwise capture
            # target_layer_ids as they are, one layer early (vllm PR #40727).
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids],
            "dflash_config": dflash,
        }

    def uniform_causality(self) -> bool | None:
        """Whether every layer attends causally within the block (all sliding), bidirectionally
        (all full), or None when the drafter mixes both kinds."""
        kinds = set(self.layer_types or [FULL] * self.num_hidden_layers)
        if kinds == {FULL}:
            return False
        if kinds == {SLIDING}:
            return True
        return None

    @classmethod
    def from_zlab(cls, data: dict, source: str = "config") -> DrafterConfig:
        dflash = data.get("dflash_config") or {}
        by_architecture = {arch: algo for algo, arch in ARCHITECTURES.items()}
        architectures = data.get("architectures") or []
        if len(architectures) != 1 or architectures[0] not in by_architecture:
            raise DrafterConfigError(
                f"{source}: architectures must be one of "
                f"{[[a] for a in by_architecture]}, got {data.get('architectures')}"
            )
        algorithm = by_architecture[architectures[0]]
        # As the authors' loader: dflash_config first, then the top level.
        dflash2 = {key: dflash.get(key, data.get(key)) for key in DFLASH2_KEYS} if algorithm == DFLASH2 else {}
        rope = data.get("rope_parameters") or {}
        scaling = data.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling:
            raise DrafterConfigError(f"{source}: rope scaling {scaling} is not implemented")
        try:
            return cls(
                hidden_size=data["hidden_size"],
                intermediate_size=data["intermediate_size"],
                num_hidden_layers=data["num_hidden_layers"],
                num_attention_heads=data["num_attention_heads"],
                num_key_value_heads=data["num_key_value_heads"],
                head_dim=data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
                vocab_size=data["vocab_size"],
                block_size=dflash.get("block_size", data.get("block_size", 16)),
                mask_token_id=dflash["mask_token_id"],
                num_target_layers=data["num_target_layers"],
                target_layer_ids=dflash.get("target_layer_ids")
                or default_target_layer_ids(data["num_target_layers"], data["num_hidden_layers"]),
                layer_types=data.get("layer_types") or [],
                sliding_window=data.get("sliding_window"),
                rms_norm_eps=data.get("rms_norm_eps", 1e-6),
                rope_theta=data.get("rope_theta") or rope.get("rope_theta", 1e6),
                max_position_embeddings=data.get("max_position_embeddings", 40960),
                attention_bias=data.get("attention_bias", False),
                hidden_act=data.get("hidden_act", "silu"),
                dtype=data.get("dtype") or data.get("torch_dtype") or "bfloat16",
                algorithm=algorithm,
                **dflash2,
            )
        except KeyError as err:
            raise DrafterConfigError(f"{source}: missing key {err.args[0]!r}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_zlab(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> DrafterConfig:
        return cls.from_zlab(json.loads(Path(path).read_text()), source=str(path))


def target_text_config(config):
    """The language-model part of a target config (Qwen3.5/3.6 wrap it in ``text_config``)."""
    return getattr(config, "text_config", None) or config


def drafter_config_for_target(
    target_config,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
    rope_theta: float | None = None,
    dtype: str = "bfloat16",
    algorithm: str = DFLASH,
    dflash2: dict | None = None,
) -> DrafterConfig:
    """A drafter shaped after its target: same hidden size, heads and vocab (the target's
    embedding and LM head are reused), its own layer count and block size. ``dflash2`` holds
    the four DFlash2 sizes (``DFLASH2_KEYS``) when ``algorithm`` is dflash2."""
    text = target_text_config(target_config)
    num_target_layers = text.num_hidden_layers
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope_theta or rope.get("rope_theta") or getattr(text, "rope_theta", None) or 1e6
    return DrafterConfig(
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or text.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        vocab_size=text.vocab_size,
        block_size=block_size,
        mask_token_id=mask_token_id,
        num_target_layers=num_target_layers,
        target_layer_ids=list(target_layer_ids)
        if target_layer_ids
        else default_target_layer_ids(num_target_layers, num_layers),
        layer_types=list(layer_types) if layer_types else [FULL] * num_layers,
        sliding_window=sliding_window,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=getattr(text, "max_position_embeddings", 40960),
        dtype=dtype,
        algorithm=algorithm,
        **({key: (dflash2 or {})[key] for key in DFLASH2_KEYS} if algorithm == DFLASH2 else {}),
    )


def resolve_mask_token_id(settings: dict, target_dir: str) -> int:
    if settings.get("mask_token_id") is not None:
        return int(settings["mask_token_id"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    vocab = tokenizer.get_vocab()
    for name in ("<|MASK|>", "<|mask|>"):
        if name in vocab:
            return vocab[name]
    raise ValueError(
        f"{target_dir}: the tokenizer has no <|MASK|> or <|mask|> token; set train.mask_token_id "
        "to an unused row of the target's embedding table"
    )


def build_drafter_config(settings: dict, target_dir: str) -> DrafterConfig:
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_dir)
    return drafter_config_for_target(
        target_config,
        num_layers=settings["num_layers"],
        block_size=settings["block_size"],
        mask_token_id=resolve_mask_token_id(settings, target_dir),
        target_layer_ids=settings.get("target_layer_ids"),
        layer_types=settings.get("layer_types"),
        sliding_window=settings.get("sliding_window"),
        intermediate_size=settings.get("intermediate_size"),
        dtype=settings.get("export_dtype", "bfloat16"),
        algorithm=settings.get("algorithm", DFLASH),
        dflash2={key: settings.get(key) for key in DFLASH2_KEYS},
    )
