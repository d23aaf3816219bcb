"""Training examples for the drafter: random anchors, their blocks, labels and loss weights
(docs/training.md, "The drafter"), and the one forward that runs every block of a batch at once.

Slot k of the block anchored at a holds ``[x_a, MASK, ..., MASK][k]``, sits at position a + k and
predicts the token AT a + k (same-position labels; slot 0 is never a target). Its weight is
``keep * [a+k < S] * [k >= 1] * loss_mask[a+k] * exp(-(k-1)/gamma)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_pipeline.model.config import FULL, SLIDING
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.model.block_masks import block_visibility, flex_block_mask


@dataclass
class Blocks:
    anchors: torch.Tensor  # [b, N] int64 (0 where not kept)
    keep: torch.Tensor  # [b, N] bool: a real block (False: padding, zero weight)
    tokens: torch.Tensor  # [b, N*B] int64: anchor token then mask tokens
    positions: torch.Tensor  # [b, N*B] int64: a_n + k
    labels: torch.Tensor  # [b, N*B] int64: input_ids[a_n + k] (0 beyond the sequence)
    predecessors: torch.Tensor  # [b, N*B] int64: input_ids[a_n + k - 1] (slot 1: the anchor)
    supervised: torch.Tensor  # [b, N*B] bool: the binary (undecayed) loss mask
    weights: torch.Tensor  # [b, N*B] float32: supervised * decay
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Where a block may start: the anchor's token and the next one are both supervised, so the
    block predicts at least one supervised token [b, S] bool."""
    supervised = loss_mask.bool()
    nxt = torch.zeros_like(supervised)
    nxt[:, :-1] = supervised[:, 1:]
    return supervised & nxt


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` distinct valid anchors per sequence, uniformly without replacement,
    sorted; rows with fewer valid positions are padded with kept=False blocks."""
    candidates = anchor_candidates(loss_mask)
    batch = loss_mask.shape[0]
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    keep = torch.zeros(batch, num_anchors, dtype=torch.bool)
    for row in range(batch):
        valid = candidates[row].nonzero().flatten().cpu()
        count = min(num_anchors, valid.numel())
        if count == 0:
            continue
        chosen = valid[torch.randperm(valid.numel(), generator=generator)[:count]]
        anchors[row, :count] = chosen.sort().values
        keep[row, :count] = True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """exp(-(k-1)/gamma) for slots k = 0..B-1, with slot 0 (the anchor) at weight 0."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    batch, seq_len = input_ids.shape
    device = input_ids.device
    slot = torch.arange(block_size, device=device)
    positions = anchors[:, :, None] + slot  # [b, N, B]
    inside = positions < seq_len
    gather_at = positions.clamp(max=seq_len - 1).reshape(batch, -1)
    labels = torch.gather(input_ids, 1, gather_at).reshape(positions.shape)
    label_supervised = torch.gather(loss_mask.bool(), 1, gather_at).reshape(positions.shape)
    supervised = keep[:, :, None] & inside & (slot >= 1) & label_supervised
    weights = supervised.float() * decay_weights(block_size, gamma).to(device)
    tokens = torch.full_like(positions, mask_token_id)
    tokens[:, :, 0] = torch.gather(input_ids, 1, anchors)
    labels = torch.where(inside, labels, torch.zeros_like(labels))
    # The ground truth before each slot: DFlash2's selector is trained teacher-forced.
    previous = torch.gather(input_ids, 1, (positions - 1).clamp(0, seq_len - 1).reshape(batch, -1))
    flat = lambda t: t.reshape(batch, -1)  # noqa: E731
    return Blocks(
        anchors=anchors,
        keep=keep,
        tokens=flat(tokens),
        positions=flat(positions),
        labels=flat(labels),
        predecessors=previous,
        supervised=flat(supervised),
        weights=flat(weights),
        block_size=block_size,
    )


def attention_masks(drafter: DFlashDrafter, blocks: Blocks, context_len: int, backend: str) -> dict:
    """One mask per layer type present in the drafter."""
    config = drafter.config
    masks = {}
    for layer_type in set(config.layer_types):
        window = config.sliding_window if layer_type == SLIDING else None
        if backend == "flex":
            masks[layer_type] = flex_block_mask(blocks.anchors, blocks.keep, context_len, blocks.block_size, window)
        else:
            mask = block_visibility(blocks.anchors, blocks.keep, context_len, blocks.block_size, window)
            # Padding blocks see nothing; SDPA turns an all-masked row into NaN, which would leak
            # into gradients. Let those rows see everything instead: they carry zero weight and no
            # real query ever sees a padding block's keys.
            empty = ~mask.any(dim=-1, keepdim=True)
            masks[layer_type] = mask | empty
    masks.setdefault(FULL, None)
    return masks


def blocks_forward(
    drafter: DFlashDrafter,
    taps: torch.Tensor,
    embed_weight: torch.Tensor,
    blocks: Blocks,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Hidden states [b, N*B, H] of every block of the batch in one forward."""
    batch, context_len, _ = taps.shape
    context = drafter.fuse_context(taps)
    context_positions = torch.arange(context_len, device=taps.device).expand(batch, -1)
    context_kv = drafter.context_kv(context, context_positions)
    block_embeds = F.embedding(blocks.tokens, embed_weight).to(context.dtype)
    masks = attention_masks(drafter, blocks, context_len, backend)
    return drafter(block_embeds, blocks.positions, context_kv, masks, backend, blocks.block_size)


@dataclass
class LossResult:
    loss: torch.Tensor
    hits: torch.Tensor  # [b, N*B] bool: argmax == label (only meaningful where supervised)
    tokens: int  # supervised slots
    # Rows (flat indices into [b*N*B]) of the supervised slots, and the top-K ids of their
    # logits (top_k > 0 only: DFlash2's selector candidates).
    rows: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


def block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    blocks: Blocks,
    chunk_rows: int = 2048,
    top_k: int = 0,
) -> LossResult:
    """Weighted cross-entropy sum(w * CE) / sum(w) over the supervised slots.

    The LM head is frozen, so the loss's gradient with respect to each supervised row's hidden
    state can be computed in the forward pass, chunk by chunk: w * (softmax - onehot) @ W. Only
    that [rows, H] gradient is kept, so full-vocabulary logits exist for one chunk at a time and
    are never recomputed in the backward pass. ``top_k`` > 0 also keeps each supervised row's
    top-K token ids from the same chunks (DFlash2's selector candidates)."""
    rows = blocks.supervised.flatten().nonzero().flatten()
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    weights = blocks.weights.flatten()
    denominator = weights.sum().clamp_min(1e-12)
    total, row_hits, top_ids = _FusedWeightedCE.apply(
        flat_hidden[rows], lm_head_weight, blocks.labels.flatten()[rows], weights[rows], chunk_rows, top_k
    )
    hits = torch.zeros(blocks.labels.numel(), dtype=torch.bool, device=hidden.device)
    hits[rows] = row_hits
    return LossResult(
        loss=total / denominator,
        hits=hits.reshape(blocks.labels.shape),
        tokens=rows.numel(),
        rows=rows,
        top_ids=top_ids if top_k else None,
    )


class _FusedWeightedCE(torch.autograd.Function):
    """sum(w * CE(h @ W.T, label)) with its gradient for h computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, lm_head_weight, labels, weights, chunk_rows, top_k=0):
        compute_dtype = lm_head_weight.dtype
        grad_hidden = torch.empty(hidden.shape, dtype=compute_dtype, device=hidden.device)
        hits = torch.empty(labels.shape, dtype=torch.bool, device=hidden.device)
        top_ids = torch.empty((labels.shape[0], top_k), dtype=torch.long, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                end = start + chunk_rows
                h = hidden[start:end].to(compute_dtype)
                label = labels[start:end]
                w = weights[start:end].float()
                logits = (h @ lm_head_weight.t()).float()
                hits[start:end] = logits.argmax(dim=-1) == label
                if top_k:
                    top_ids[start:end] = logits.topk(top_k, dim=-1).indices
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, label[:, None])[:, 0]
                total += ((lse - picked) * w).sum()
                probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
                probs[torch.arange(len(label), device=probs.device), label] -= 1.0
                probs.mul_(w[:, None])
                grad_hidden[start:end] = probs.to(compute_dtype) @ lm_head_weight
        ctx.save_for_backward(grad_hidden)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(hits, top_ids)
        return total, hits, top_ids

    @staticmethod
    def backward(ctx, grad_total, grad_hits, grad_top_ids):
        (grad_hidden,) = ctx.saved_tensors
        return (grad_hidden * grad_total).to(ctx.hidden_dtype), None, None, None, None, None


def block_metrics(hits: torch.Tensor, blocks: Blocks) -> dict:
    """Accuracy over the binary mask, per block position, and the simulated acceptance length:
    1 + the number of leading slots (1..B-1) the drafter got right, averaged over real blocks."""
    B = blocks.block_size
    supervised = blocks.supervised.reshape(*blocks.anchors.shape, B)[..., 1:]
    hits = (hits.reshape(*blocks.anchors.shape, B)[..., 1:]) & supervised
    per_position_total = supervised.sum(dim=(0, 1)).clamp_min(1)
    per_position = (hits.sum(dim=(0, 1)).float() / per_position_total).tolist()
    run = hits.long().cumprod(dim=-1).sum(dim=-1)  # accepted drafts per block
    kept = blocks.keep
    accept = (1.0 + run[kept].float()).mean().item() if kept.any() else math.nan
    total = int(supervised.sum())
    return {
        "accuracy": float(hits.sum()) / total if total else math.nan,
        "accuracy_per_position": [round(x, 5) for x in per_position],
        "accept_len": accept,
        "supervised_tokens": total,
        "blocks": int(kept.sum()),
    }
