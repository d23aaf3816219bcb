"""The two modules DFlash2 adds to the DFlash drafter (docs/training.md, "DFlash2").

``GroupedCausalConv`` wraps a sublayer of every decoder layer: ``prepare`` convolves the
sublayer's normalised input, ``finish`` its output, each with a base kernel shared by all slots
plus a per-slot, per-group correction projected from that slot's normalised input. The
convolution runs along the slots of ONE block: slot t reads slots t-K+1..t of its own block,
with zeros before the block's first slot (tap 0 = the current slot). Training packs N blocks
into one query stream, so the stream is cut into blocks of ``block_length`` first; inference
passes one block (``block_length`` = its length), which is the N = 1 case of the same code.

``CandidateSelector`` picks one token path through each slot's top-K unary candidates:
score_t[k] = U_t[k] + sum_j P[prev, j] g_t[j] S[C_t[k], j] with g_t = hidden_projection(h_t),
walked left to right from the anchor (argmax at temperature 0, a sample of softmax(score / T)
over the K candidates above). Training scores the same way with teacher-forced predecessors.

Parameter names and layouts are the authors' checkpoint format (``base_kernel`` [2, K, H];
``kernel_projection`` rows ordered [side][tap][group], groups = contiguous chunks of g channels;
bare ``predecessor_codebook`` / ``successor_codebook`` tensors [V, r]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_causal_conv(
    values: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, block_length: int
) -> torch.Tensor:
    """out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // g]) * values[t - o, c] within each block.

    values [b, Q, H]; dynamic [b, Q, K, G]; base [K, H]; Q a multiple of ``block_length``."""
    batch, length, hidden = values.shape
    if length % block_length:
        raise ValueError(f"{length} query slots are not whole blocks of {block_length}")
    kernel_size, groups = base.shape[0], hidden // group_size
    blocks = values.view(batch, length // block_length, block_length, groups, group_size)
    dynamic = dynamic.reshape(batch, length // block_length, block_length, kernel_size, groups, 1)
    base = base.to(values.dtype).view(kernel_size, groups, group_size)
    out = torch.zeros_like(blocks)
    for offset in range(min(kernel_size, block_length)):
        # Shift along the slot axis inside each block; the first ``offset`` slots read zeros,
        # so no block ever sees the previous block's tail.
        shifted = blocks if offset == 0 else F.pad(blocks[:, :, :-offset], (0, 0, 0, 0, offset, 0))
        # The same two accumulations, in the same order, as the authors' inference code.
        out = out + base[offset] * shifted
        out = torch.addcmul(out, dynamic[:, :, :, offset], shifted)
    return out.view(batch, length, hidden)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    # Built without drawing random numbers (the owner initialises it): the drafter's other
    # weights then come out of the seeded generator exactly as they do for DFlash.
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=False)


class GroupedCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = _linear(hidden_size, 2 * kernel_size * self.groups)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        """Tap 0 = 1, other taps and the projection 0: the convolution is exactly a no-op, so a
        fresh DFlash2 computes what DFlash computes with the same weights."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input, and the post-side corrections (both sides come from x)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        pre = grouped_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block_length)
        return pre, dynamic[..., 1, :, :]

    def finish(self, z: torch.Tensor, dynamic: torch.Tensor, block_length: int) -> torch.Tensor:
        return grouped_causal_conv(z, dynamic, self.base_kernel[1], self.group_size, block_length)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Plain parameters, not nn.Embedding: the published checkpoints store bare tensors.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = _linear(hidden_size, rank)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Successor codebook 0: every edge score is 0, the selector starts as the unary argmax
        (SpecForge's and NeMo's choice; the predecessor side moves once the successor side has)."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.normal_(self.hidden_projection.weight, std=std)
        self.successor_codebook.zero_()

    def edge_scores(self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Edge scores [..., K] of the ``candidates`` [..., K] after ``predecessors`` [...],
        for draft hidden states ``hidden`` [..., H]."""
        gate = self.hidden_projection(hidden) * self.predecessor_codebook[predecessors].to(hidden.dtype)
        successors = self.successor_codebook[candidates].to(hidden.dtype)
        return (successors @ gate[..., None])[..., 0]

    @torch.no_grad()
    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """The proposal for slots 1..L-1 of one block: hidden [L-1, H] (after the draft norm),
        unary logits [L-1, V]. Returns the drafts, the candidate ids [L-1, K] and, above
        temperature 0, the rows q [L-1, K] each draft was sampled from."""
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1, sorted=False)
        gate = self.hidden_projection(hidden).float()
        successors = self.successor_codebook[candidates].float()  # [L-1, K, r]
        predecessor = anchor
        drafts, rows = [], []
        for slot in range(hidden.shape[0]):
            edge = successors[slot] @ (self.predecessor_codebook[predecessor].float() * gate[slot])
            scores = unary[slot] + edge
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = int(torch.multinomial(q, 1, generator=generator))
                rows.append(q)
            else:
                index = int(scores.argmax())
            predecessor = int(candidates[slot, index])
            drafts.append(predecessor)
        return drafts, candidates, torch.stack(rows) if rows else None
