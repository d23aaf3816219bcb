"""The DFlash drafter (docs/training.md, "The drafter"): Qwen3-style layers over a block of [anchor, MASK...]
whose keys and values also include the target's fused context features ("KV injection").

One module serves training (all blocks of a sequence in one forward, with a block-sparse mask)
and inference (one block against cached context keys/values); both go through
``DFlashDrafter.forward`` so they cannot drift apart. Parameter names match the z-lab checkpoint
format exactly (``fc``, ``hidden_norm``, ``layers.{i}.self_attn.q_proj`` ...), so export is a
plain state dict. The target's embedding and LM head are not part of the module: callers pass the
target's (frozen) tensors in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.model.config import SLIDING, DrafterConfig
from dflash_pipeline.model.dflash2 import CandidateSelector, GroupedCausalConv

ATTENTION_BACKENDS = ("sdpa", "flex")


def compiled_on_gpu(fn):
    """``fn`` compiled (elementwise chains fused into one kernel) when called on CUDA tensors;
    plain eager on the CPU, where tests need no compiler and runs stay bit-reproducible."""
    compiled = None

    def wrapper(*args):
        nonlocal compiled
        if args[0].is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True)
            return compiled(*args)
        return fn(*args)

    return wrapper


@compiled_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, return the input's dtype: with fp32 master weights under bf16 autocast
    # the residual stream stays bf16, as in a bf16 model, instead of being promoted to fp32.
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x.to(dtype)


@compiled_on_gpu
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@compiled_on_gpu
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary embedding; x [b, heads, T, hd], cos/sin [b, T, hd]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class RotaryEmbedding(nn.Module):
    """The drafter's own RoPE over the full head dim (never the target's partial / M-RoPE)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class DrafterAttention(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        hd = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        is_sliding = config.layer_types[layer_idx] == SLIDING
        self.sliding_window = config.sliding_window if is_sliding else None

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        # (b, T, heads * hd) -> (b, T, heads, hd) -> (b, heads, T, hd)
        return x.view(*x.shape[:-1], heads, self.head_dim).transpose(1, 2)

    def context_kv(self, context: torch.Tensor, cos, sin):
        """Keys/values of the fused context features [b, S, H] at their positions."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(context), self.num_kv_heads)), cos, sin)  # (b, kvh, S, hd)
        v = self._heads(self.v_proj(context), self.num_kv_heads)  # (b, kvh, S, hd)
        return k, v

    def forward(self, hidden, context_k, context_v, cos, sin, mask, backend: str):
        # hidden (b, T, H): the block tokens; context_k/v (b, kvh, S, hd): the target's features.
        q = apply_rope(self.q_norm(self._heads(self.q_proj(hidden), self.num_heads)), cos, sin)  # (b, nh, T, hd)
        k_block, v_block = self.context_kv(hidden, cos, sin)  # (b, kvh, T, hd) each
        k = torch.cat([context_k, k_block], dim=2)  # (b, kvh, S + T, hd): context first, then the block
        v = torch.cat([context_v, v_block], dim=2)  # (b, kvh, S + T, hd)
        scale = self.head_dim**-0.5
        if backend == "flex":
            out = _flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
        else:
            # mask (b, T, S + T) -> (b, 1, T, S + T), shared by the heads
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask[:, None], scale=scale, enable_gqa=True
            )  # (b, nh, T, hd)
        out = out.transpose(1, 2).reshape(*hidden.shape[:-1], self.num_heads * self.head_dim)  # (b, T, nh * hd)
        return self.o_proj(out)  # (b, T, H)


def _flex_attention(*args, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if args[0].is_cuda:
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        return _COMPILED_FLEX(*args, **kwargs)
    return flex_attention(*args, **kwargs)


_COMPILED_FLEX = None


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DrafterAttention(config, layer_idx)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_dflash2:
            # Only the block stream is convolved; the context features never are.
            conv = lambda: GroupedCausalConv(  # noqa: E731
                config.hidden_size, config.conv_kernel_size, config.conv_group_size
            )
            self.attention_conv, self.mlp_conv = conv(), conv()
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, hidden, context_k, context_v, cos, sin, mask, backend, block_length):
        x = self.input_layernorm(hidden)
        if self.attention_conv is None:
            hidden = hidden + self.self_attn(x, context_k, context_v, cos, sin, mask, backend)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        # The block's queries and its own keys/values come from the convolved input.
        y, post = self.attention_conv.prepare(x, block_length)
        z = self.self_attn(y, context_k, context_v, cos, sin, mask, backend)
        hidden = hidden + self.attention_conv.finish(z, post, block_length)
        y, post = self.mlp_conv.prepare(self.post_attention_layernorm(hidden), block_length)
        return hidden + self.mlp_conv.finish(self.mlp(y), post, block_length)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.candidate_selector = (
            CandidateSelector(config.vocab_size, h, config.selector_rank, config.selector_top_k)
            if config.is_dflash2
            else None
        )
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """normal(0, std) linears, unit norms; DFlash2's convolutions as the identity and its
        selector last, so a seeded DFlash2 draws the same DFlash weights as a seeded DFlash
        (and computes the same logits: both modules start as no-ops)."""
        dflash2 = (GroupedCausalConv, CandidateSelector)
        skip = {id(p) for m in self.modules() if isinstance(m, dflash2) for p in m.parameters()}
        for module in self.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in skip:
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, GroupedCausalConv):
                module.reset_identity()
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(std)

    def fuse_context(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps [b, S, K*H] -> context features c [b, S, H]."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor):
        """Per-layer context keys/values for fused features at ``positions`` [b, S]."""
        cos, sin = self.rotary(positions, context.dtype)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | None],
        backend: str = "sdpa",
        block_length: int | None = None,
    ) -> torch.Tensor:
        """Block hidden states [b, Q, H] (before the LM head). ``masks`` maps a layer type to its
        mask (dense bool [b, Q, S+Q] for sdpa, a BlockMask for flex, None = everything visible).
        ``block_length``: the query stream is Q / block_length consecutive blocks (DFlash2's
        convolution stays inside each); None = one block of Q slots."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        block_length = block_length or block_embeds.shape[1]
        cos, sin = self.rotary(block_positions, block_embeds.dtype)
        hidden = block_embeds
        for layer, (k, v), layer_type in zip(self.layers, context_kv, self.config.layer_types):
            hidden = layer(hidden, k, v, cos, sin, masks[layer_type], backend, block_length)
        return self.norm(hidden)
