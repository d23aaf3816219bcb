"""DFlash2's selector objective (docs/training.md, "DFlash2"); the DFlash loss stays the base term.

For every supervised slot (the same rows and per-slot weights w as the base loss):
- candidates C = the top-K ids of the drafter's own logits at that slot (the serving candidate
  set, taken from the fused loss's chunks: the full logits are never kept);
- teacher-forced predecessor = the ground-truth token before the slot (slot 1: the anchor): a
  slot can only be accepted if all earlier ones were, and then the walk's predecessor IS the
  ground truth, so this is the inference walk in the only case that matters;
- scores s = U + edge, U = the unary logits of the candidates (recomputed from the hidden state,
  so the selector term also trains the backbone unless ``stop_gradient``), edge as at inference;
- CE over the K scores, label = the gold token's index in C.

Gold not in C (``GOLD_POLICIES``): ``strict`` (default) drops the slot from the selector term --
the selector can never pick a token outside C at serving time, and SpecForge reports strict gave
the best serving acceptance length of the variants it tried; ``replace_weakest`` puts the gold
token in place of the K-th candidate in the loss set only (vLLM speculators).
Normalisation (``NORMALIZATIONS``): ``base`` (default) divides sum(w * CE_sel) over covered slots
by the base term's sum(w) over all supervised slots (SpecForge), so the selector's pull grows with
the top-K recall instead of jumping to full strength on the few slots covered early in training;
``covered`` divides by sum(w) over the slots in the term (NeMo AutoModel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_pipeline.training.blocks import block_metrics

GOLD_POLICIES = ("strict", "replace_weakest")
NORMALIZATIONS = ("base", "covered")


@dataclass
class SelectorResult:
    loss: torch.Tensor  # the selector term, before its weight alpha
    in_top_k: torch.Tensor  # [b, N*B] bool: the gold token is among the slot's K candidates
    hits: torch.Tensor  # [b, N*B] bool: the teacher-forced selector picks the gold token


def selector_weight(step: int, total_steps: int, weight: float, warmup_ratio: float, ramp_ratio: float) -> float:
    """alpha at ``step``: 0 for the first warmup_ratio of all steps, then a linear ramp over
    ramp_ratio of them, then ``weight``."""
    warmup, ramp = warmup_ratio * total_steps, ramp_ratio * total_steps
    if step < warmup:
        return 0.0
    if ramp > 0 and step < warmup + ramp:
        return weight * (step - warmup + 1) / ramp
    return weight


def selector_loss(
    selector,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    blocks,
    rows: torch.Tensor,
    candidates: torch.Tensor,
    *,
    gold_policy: str = "strict",
    normalization: str = "base",
    stop_gradient: bool = False,
) -> SelectorResult:
    """``rows``/``candidates``: the supervised rows and their top-K ids from ``block_loss``."""
    if gold_policy not in GOLD_POLICIES:
        raise ValueError(f"selector gold policy must be one of {GOLD_POLICIES}, got {gold_policy!r}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"selector normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    h = hidden.reshape(-1, hidden.shape[-1])[rows]
    if stop_gradient:
        h = h.detach()
    labels = blocks.labels.flatten()[rows]
    weights = blocks.weights.flatten()[rows].float()
    covered = (candidates == labels[:, None]).any(dim=-1)
    if gold_policy == "replace_weakest":
        # block_loss's top-K is sorted: the last column is the weakest candidate.
        weakest = torch.where(covered, candidates[:, -1], labels)
        candidates = torch.cat([candidates[:, :-1], weakest[:, None]], dim=-1)
        in_loss = torch.ones_like(covered)
    else:
        in_loss = covered
    unary = (lm_head_weight[candidates].to(h.dtype) @ h[:, :, None])[..., 0]
    scores = (unary + selector.edge_scores(h, blocks.predecessors.flatten()[rows], candidates)).float()
    gold = (candidates == labels[:, None]).float().argmax(dim=-1)
    ce = torch.logsumexp(scores, dim=-1) - scores.gather(1, gold[:, None])[:, 0]
    numerator = (ce * weights * in_loss).sum()
    if normalization == "base":
        denominator = blocks.weights.sum()
    else:
        denominator = (weights * in_loss).sum()
    picked = candidates.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]

    def scatter(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(blocks.labels.numel(), dtype=torch.bool, device=hidden.device)
        out[rows] = values
        return out.reshape(blocks.labels.shape)

    return SelectorResult(
        loss=numerator / denominator.clamp_min(1e-12),
        in_top_k=scatter(covered),
        # Measured on the strict set: a replaced-in gold token is not one serving could pick.
        hits=scatter(covered & (picked == labels)),
    )


def selector_metrics(result: SelectorResult, blocks) -> dict:
    """Top-K recall (the selector's ceiling) and teacher-forced selector accuracy over the
    supervised slots, and the simulated acceptance length of the selector's greedy walk (its
    teacher-forced hits ARE the walk's while every earlier slot was right)."""
    supervised = blocks.supervised
    total = int(supervised.sum())
    walk = block_metrics(result.hits, blocks)
    return {
        "selector_loss": round(float(result.loss.detach()), 6),
        "selector_recall": float((result.in_top_k & supervised).sum()) / total if total else float("nan"),
        "selector_accuracy": walk["accuracy"],
        "selector_accept_len": walk["accept_len"],
    }
