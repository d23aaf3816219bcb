"""Who may attend to whom when all blocks of a sequence run in one forward (docs/training.md, "The drafter").

Keys are ``[S context features | N*B block tokens]``; query slot k of block n (anchor a_n) sees
- context key j iff j < a_n (strictly: the anchor's own target state does not exist yet at
  inference), and for sliding-window layers also j >= a_n + k - (W - 1);
- block key (n', k') iff n' == n, and for sliding-window layers also k' <= k (causal);
- nothing at all if block n is a padding block (keep = False).
Blocks never see each other. The same rules give the inference mask with N = 1.
"""

from __future__ import annotations

import torch


def block_visibility(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_len: int,
    block_size: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dense boolean mask [batch, N*B, S + N*B] (True = may attend)."""
    batch, num_blocks = anchors.shape
    device = anchors.device
    slot = torch.arange(block_size, device=device)
    anchor = anchors[:, :, None, None]  # [b, N, 1, 1]
    ctx = torch.arange(context_len, device=device)[None, None, None, :]
    context_visible = ctx < anchor
    if sliding_window is not None:
        context_visible = context_visible & (ctx >= anchor + slot[None, None, :, None] - (sliding_window - 1))
    context_visible = context_visible.expand(batch, num_blocks, block_size, context_len)

    same_block = torch.eye(num_blocks, dtype=torch.bool, device=device)  # [N, N']
    block_visible = same_block[:, None, :, None].expand(num_blocks, block_size, num_blocks, block_size)
    if sliding_window is not None:
        causal = slot[None, :] <= slot[:, None]  # [k, k']
        block_visible = block_visible & causal[None, :, None, :]
    block_visible = block_visible.reshape(1, num_blocks, block_size, num_blocks * block_size)
    block_visible = block_visible.expand(batch, -1, -1, -1)

    mask = torch.cat([context_visible, block_visible], dim=-1)
    mask = mask & keep[:, :, None, None]
    return mask.reshape(batch, num_blocks * block_size, context_len + num_blocks * block_size)


def flex_block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_len: int,
    block_size: int,
    sliding_window: int | None = None,
):
    """The same rules as a flex-attention BlockMask: never materialised densely, and whole
    128x128 tiles that nobody sees are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_blocks = anchors.shape

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        slot = q_idx % block_size
        anchor = anchors[b, block]
        context_ok = kv_idx < anchor
        key_block_pos = kv_idx - context_len
        block_ok = (key_block_pos // block_size) == block
        if sliding_window is not None:
            context_ok = context_ok & (kv_idx >= anchor + slot - (sliding_window - 1))
            block_ok = block_ok & ((key_block_pos % block_size) <= slot)
        return keep[b, block] & torch.where(kv_idx < context_len, context_ok, block_ok)

    return create_block_mask(
        mask_mod,
        batch,
        None,
        num_blocks * block_size,
        context_len + num_blocks * block_size,
        device=anchors.device,
        _compile=anchors.is_cuda,
    )
