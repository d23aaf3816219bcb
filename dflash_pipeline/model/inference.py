"""The drafter at inference: propose one block from the target's taps of every committed token.

``DFlashProposer`` keeps each layer's context keys/values for all committed positions (appending
the new ones each call), runs the block [anchor, MASK x (B-1)] at positions anchor..anchor+B-1
through ``DFlashDrafter.forward`` (the same code as training, with N = 1) and takes the argmax at
slots 1..B-1 (DFlash), or walks DFlash2's candidate selector through each slot's top-K.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_pipeline.model.config import SLIDING, DrafterConfig
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.model.block_masks import block_visibility
from dflash_pipeline.model.target import target_embeddings


class DFlashProposer:
    def __init__(
        self,
        drafter: DFlashDrafter,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
    ):
        self.drafter = drafter.eval()
        self.config = drafter.config
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.block_size = self.config.block_size
        self.target_layer_ids = list(self.config.target_layer_ids)
        self.reset()

    def reset(self) -> None:
        self.context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.context_len = 0

    @torch.no_grad()
    def extend_context(self, new_context: torch.Tensor) -> None:
        """Append the taps [n, K*H] of positions context_len .. context_len+n-1."""
        n = new_context.shape[0]
        if n == 0:
            return
        param = next(self.drafter.parameters())
        taps = new_context.to(device=param.device, dtype=param.dtype)[None]
        positions = torch.arange(self.context_len, self.context_len + n, device=param.device)[None]
        new_kv = self.drafter.context_kv(self.drafter.fuse_context(taps), positions)
        if self.context_kv is None:
            self.context_kv = new_kv
        else:
            self.context_kv = [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                for (k, v), (nk, nv) in zip(self.context_kv, new_kv)
            ]
        self.context_len += n

    @torch.no_grad()
    def block_logits(self, anchor_token: int, anchor_position: int, block_size: int | None = None):
        """Logits [B-1, V] of slots 1..B-1 of the block anchored at ``anchor_position``."""
        return self.logits(self.block_hidden(anchor_token, anchor_position, block_size))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head_weight.t().to(hidden.dtype)).float()

    @torch.no_grad()
    def block_hidden(self, anchor_token: int, anchor_position: int, block_size: int | None = None):
        """Final draft hidden states [B-1, H] (after the draft norm) of slots 1..B-1."""
        if anchor_position != self.context_len:
            raise ValueError(
                f"the block must start right after the committed context: anchor position "
                f"{anchor_position}, context holds {self.context_len} positions"
            )
        B = block_size or self.block_size
        param = next(self.drafter.parameters())
        tokens = torch.full((1, B), self.config.mask_token_id, device=param.device)
        tokens[0, 0] = anchor_token
        positions = (anchor_position + torch.arange(B, device=param.device))[None]
        context_kv = self.context_kv or self._empty_kv(param)
        masks = {layer_type: None for layer_type in self.config.layer_types}
        if SLIDING in masks:
            anchor = torch.tensor([[anchor_position]], device=param.device)
            keep = torch.ones_like(anchor, dtype=torch.bool)
            masks[SLIDING] = block_visibility(anchor, keep, self.context_len, B, self.config.sliding_window)
        embeds = F.embedding(tokens, self.embed_weight).to(param.dtype)
        return self.drafter(embeds, positions, context_kv, masks, "sdpa")[0, 1:]

    def _empty_kv(self, param):
        c = self.config
        empty = param.new_zeros(1, c.num_key_value_heads, 0, c.head_dim)
        return [(empty, empty)] * c.num_hidden_layers

    def propose(self, new_context: torch.Tensor, anchor_token: int, anchor_position: int) -> list[int]:
        """Greedy drafts: the logits' argmax (DFlash), the selector's walk (DFlash2; its argmax
        of unary + edge scores, not of the logits)."""
        self.extend_context(new_context)
        hidden = self.block_hidden(anchor_token, anchor_position)
        logits = self.logits(hidden)
        selector = self.drafter.candidate_selector
        if selector is None:
            return logits.argmax(dim=-1).tolist()
        return selector.walk(hidden, logits, anchor_token)[0]

    @property
    def samples_drafts(self) -> bool:
        """DFlash2 samples its drafts above temperature 0 (the selector's walk); DFlash's stay
        greedy, which "sample the target, compare" verifies losslessly."""
        return self.drafter.candidate_selector is not None

    def propose_sampled(self, new_context, anchor_token, anchor_position, temperature, generator):
        """Drafts sampled by the selector walk, with each slot's candidates [B-1, K] and the
        distribution q [B-1, K] its draft was drawn from."""
        self.extend_context(new_context)
        hidden = self.block_hidden(anchor_token, anchor_position)
        return self.drafter.candidate_selector.walk(hidden, self.logits(hidden), anchor_token, temperature, generator)


def load_drafter(drafter_dir: str | Path, device=None, dtype=None) -> DFlashDrafter:
    """Read an exported z-lab-format drafter; every tensor must match, none may be missing."""
    from safetensors.torch import load_file

    drafter_dir = Path(drafter_dir)
    config = DrafterConfig.load(drafter_dir / "config.json")
    drafter = DFlashDrafter(config)
    state = load_file(drafter_dir / "model.safetensors")
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{drafter_dir / 'model.safetensors'}: missing tensors {missing}, unexpected {unexpected}")
    return drafter.to(device=device, dtype=dtype or torch.float32)


def load_proposer(drafter_dir: str | Path, target) -> DFlashProposer:
    embed, head = target_embeddings(target)
    drafter = load_drafter(drafter_dir, device=embed.device, dtype=embed.dtype)
    if drafter.config.vocab_size != embed.shape[0]:
        raise ValueError(
            f"{drafter_dir}: drafter vocab_size {drafter.config.vocab_size} != target's embedding rows {embed.shape[0]}"
        )
    return DFlashProposer(drafter, embed, head)
