"""One optimizer step of the drafter, given the batch and the target's taps. The training job
and the benchmark both run exactly this."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_pipeline.training.blocks import Blocks, LossResult, block_loss, blocks_forward, build_blocks, sample_anchors
from dflash_pipeline.training.selector import SelectorResult, selector_loss


@dataclass
class StepResult:
    loss: LossResult
    blocks: Blocks
    grad_norm: float
    lr: float
    selector: SelectorResult | None = None  # DFlash2 only
    selector_weight: float = 0.0
    total_loss: float | None = None  # base + selector_weight * selector term
    applied: bool = True  # False: ``judge`` refused the update (a diverged step)


def optimizer_step(
    drafter,
    optimizer: torch.optim.Optimizer,
    scheduler,
    taps: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    settings: dict,
    generator: torch.Generator,
    backend: str,
    forward_module=None,
    selector_weight: float | None = None,
    judge: Callable[[float, float], bool] | None = None,
) -> StepResult:
    """``forward_module`` (a DDP wrapper of the block forward) replaces the plain forward when
    gradients are averaged across processes. ``selector_weight``: DFlash2's alpha at this step
    (``training.selector.selector_weight``); None = train.selector_loss_weight. ``judge(loss,
    grad_norm)`` (the loss optimised, the norm before clipping) decides whether the update is
    applied: a diverged step's is not (``training.divergence``); the schedule advances either
    way, so the learning rate stays a function of the step."""
    config = drafter.config
    anchors, keep = sample_anchors(loss_mask, settings["num_anchors"], generator)
    blocks = build_blocks(
        input_ids,
        loss_mask,
        anchors,
        keep,
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        gamma=settings["loss_decay_gamma"],
    )
    selector = drafter.candidate_selector
    on_gpu = taps.is_cuda
    with torch.autocast(taps.device.type, dtype=torch.bfloat16, enabled=on_gpu):
        if forward_module is not None:
            hidden = forward_module(taps, embed_weight, blocks, backend)
        else:
            hidden = blocks_forward(drafter, taps, embed_weight, blocks, backend)
        result = block_loss(
            hidden, lm_head_weight, blocks, settings["loss_chunk_rows"],
            top_k=selector.top_k if selector is not None else 0,
        )  # fmt: skip
        total = result.loss
        chosen = None
        alpha = 0.0
        if selector is not None:
            alpha = settings["selector_loss_weight"] if selector_weight is None else selector_weight
            chosen = selector_loss(
                selector, hidden, lm_head_weight, blocks, result.rows, result.top_ids,
                gold_policy=settings["selector_gold_policy"],
                normalization=settings["selector_normalization"],
                stop_gradient=settings["selector_stop_gradient"],
            )  # fmt: skip
            # Always in the graph, also at alpha 0 (warm-up): every parameter gets a gradient,
            # as DDP's reducer expects, and the metrics are measured all along.
            total = total + alpha * chosen.loss
    total.backward()
    clip = settings["grad_clip"] if settings["grad_clip"] > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), clip)
    lr = scheduler.get_last_lr()[0]
    total_loss, grad_norm = float(total.detach()), float(grad_norm)
    applied = judge is None or judge(total_loss, grad_norm)
    if applied:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=result, blocks=blocks, grad_norm=grad_norm, lr=lr,
        selector=chosen, selector_weight=alpha, total_loss=total_loss, applied=applied,
    )  # fmt: skip


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` at the last step."""
    warmup = int(total_steps * warmup_ratio)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(drafter, settings: dict) -> torch.optim.Optimizer:
    """AdamW over fp32 master weights; the fused kernel on GPUs (one launch for all tensors)."""
    on_gpu = next(drafter.parameters()).is_cuda
    return torch.optim.AdamW(
        drafter.parameters(),
        lr=settings["learning_rate"],
        weight_decay=settings["weight_decay"],
        fused=True if on_gpu else None,
    )
