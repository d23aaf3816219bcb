"""The speculative-decoding loop with the semantics SGLang and vLLM use (docs/evaluation.md), and
plain decoding to compare it with.

One step: the proposer drafts B-1 tokens after the anchor (the target's last token) from the
target's taps of every committed position; the target verifies [anchor, drafts] in one forward and
picks its own token y_i at every slot (argmax, or a sample at temperature > 0); the accepted length
A is the longest prefix with draft_{i+1} == y_i; the anchor, the A accepted drafts and y_A are
committed (A + 1 new tokens), the target's cache keeps the verified positions anchor..anchor+A, and
y_A is the next anchor. Because every committed token is the target's own choice given the
committed prefix, the output is the target's own decoding: token for token in greedy mode, in
distribution when sampling ("sample the target, compare" is speculative sampling with a
deterministic proposal).

A proposer that samples its drafts above temperature 0 (DFlash2's selector walk,
``samples_drafts``) also returns the distribution q each draft was drawn from; then the verify
step is speculative sampling proper: draft d at slot i is accepted iff
u * q(d) < p_i(d), u uniform; the first rejected slot commits a sample of
normalize(max(p_i - q, 0)) (p_i if that is all zero), and a fully accepted block a sample of the
last slot's p. The committed tokens are then distributed as the target's own samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflash_pipeline.evaluation.runner import TargetRunner


class Proposer(Protocol):
    """What the loop needs from a drafter (``dflash_pipeline.model.inference.load_proposer``)."""

    block_size: int  # B: anchor slot + B-1 draft slots; the loop may set it before reset()
    target_layer_ids: list[int]  # 0-based target layers whose outputs are the drafter's context

    def reset(self) -> None: ...

    def propose(self, new_context: torch.Tensor, anchor_token: int, anchor_position: int) -> list[int]:
        """Draft tokens for positions anchor_position+1 .. anchor_position+B-1.

        ``new_context`` holds the taps [n, K*H] of positions anchor_position-n .. anchor_position-1,
        the ones committed since the previous call: over a generation every committed position
        before the anchor is passed exactly once, in order.
        """
        ...


class ProposerError(RuntimeError):
    """The proposer broke the contract above (wrong number of drafts)."""


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: int
    temperature: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SpeculativeTrace:
    """One prompt through the speculative loop."""

    tokens: list[int]  # generated tokens, cut after the first stop token or at max_new_tokens
    accepted_lengths: list[int]  # A of every verify step (drafts accepted, 0..B-1)
    block_size: int
    finish_reason: str  # "stop" | "length"
    seconds: float
    drafts: list[list[int]] = field(default_factory=list)  # the proposal of every verify step


@dataclass
class PlainTrace:
    """One prompt through plain one-token-at-a-time decoding."""

    tokens: list[int]
    finish_reason: str
    seconds: float
    # Target's top-1 minus top-2 logit at each generated position: how close each greedy choice was.
    margins: list[float] = field(default_factory=list)


class TokenPicker:
    """The target's token at each row of logits: argmax, or a sample from softmax(logits / T)."""

    def __init__(self, settings: DecodeSettings, device: torch.device):
        self.temperature = settings.temperature
        self.generator = None
        if not settings.greedy:
            self.generator = torch.Generator(device=device).manual_seed(settings.seed)

    def __call__(self, logits: torch.Tensor) -> list[int]:
        if self.generator is None:
            return logits.argmax(dim=-1).tolist()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0].tolist()

    def speculative(
        self, logits: torch.Tensor, drafts: list[int], candidates: torch.Tensor, q: torch.Tensor
    ) -> tuple[int, int]:
        """Speculative sampling of sampled drafts: (accepted drafts, the token after them)."""
        p = torch.softmax(logits / self.temperature, dim=-1)  # [B, V]
        candidates, q = candidates.to(p.device), q.to(device=p.device, dtype=p.dtype)
        for i, draft in enumerate(drafts):
            q_draft = q[i][candidates[i] == draft].sum()
            u = torch.rand((), generator=self.generator, device=p.device)
            if u * q_draft < p[i, draft]:
                continue
            residual = p[i].clone()
            residual.scatter_add_(0, candidates[i], -q[i])
            residual.clamp_min_(0)
            total = residual.sum()
            residual = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(residual, 1, generator=self.generator))
        return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=self.generator))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finish(tokens: list[int], settings: DecodeSettings) -> tuple[list[int], str]:
    """Cut after the first stop token, else at the token limit."""
    for index, token in enumerate(tokens[: settings.max_new_tokens]):
        if token in settings.stop_token_ids:
            return tokens[: index + 1], "stop"
    return tokens[: settings.max_new_tokens], "length"


def _done(tokens: list[int], new: list[int], settings: DecodeSettings) -> bool:
    return len(tokens) >= settings.max_new_tokens or any(t in settings.stop_token_ids for t in new)


@torch.no_grad()
def speculative_decode(
    target: TargetRunner,
    proposer: Proposer,
    prompt_ids: list[int],
    settings: DecodeSettings,
) -> SpeculativeTrace:
    block_size = proposer.block_size
    pick = TokenPicker(settings, target.device)
    sampled_drafts = not settings.greedy and getattr(proposer, "samples_drafts", False)
    _synchronize(target.device)
    started = time.perf_counter()
    proposer.reset()
    target.start()
    logits, context = target.forward(prompt_ids, last_logits_only=True)
    anchor = pick(logits[-1:])[0]
    anchor_position = len(prompt_ids)
    tokens = [anchor]
    accepted_lengths: list[int] = []
    proposals: list[list[int]] = []
    while not _done(tokens, [anchor], settings):
        if sampled_drafts:
            drafts, candidates, q = proposer.propose_sampled(
                context, anchor, anchor_position, settings.temperature, pick.generator
            )
            drafts = list(drafts)
        else:
            drafts = list(proposer.propose(context, anchor, anchor_position))
        if len(drafts) != block_size - 1:
            raise ProposerError(
                f"the proposer returned {len(drafts)} drafts for block size {block_size} (expected {block_size - 1})"
            )
        proposals.append(drafts)
        block = [anchor, *drafts]
        logits, block_taps = target.verify(block)
        if sampled_drafts:
            accepted, anchor = pick.speculative(logits, drafts, candidates, q)
        else:
            posterior = pick(logits)  # posterior[i]: the target's token at anchor_position + i + 1
            accepted = 0
            while accepted < block_size - 1 and drafts[accepted] == posterior[accepted]:
                accepted += 1
            anchor = posterior[accepted]
        accepted_lengths.append(accepted)
        context = target.keep(accepted + 1, block_taps)
        new_tokens = [*drafts[:accepted], anchor]
        tokens.extend(new_tokens)
        anchor_position += accepted + 1
        if _done(tokens, new_tokens, settings):
            break
    _synchronize(target.device)
    seconds = time.perf_counter() - started
    tokens, reason = _finish(tokens, settings)
    return SpeculativeTrace(tokens, accepted_lengths, block_size, reason, seconds, proposals)


@torch.no_grad()
def plain_decode(target: TargetRunner, prompt_ids: list[int], settings: DecodeSettings) -> PlainTrace:
    """The target alone, one token per forward: the reference for losslessness and speed."""
    pick = TokenPicker(settings, target.device)
    _synchronize(target.device)
    started = time.perf_counter()
    target.start()
    logits, _ = target.forward(prompt_ids, taps=False, last_logits_only=True)
    tokens: list[int] = []
    margins: list[float] = []
    while True:
        last = logits[-1:]
        token = pick(last)[0]
        if settings.greedy:
            top2 = last[0].topk(2).values
            margins.append(float(top2[0] - top2[1]))
        tokens.append(token)
        if _done(tokens, [token], settings):
            break
        logits, _ = target.forward([token], taps=False)
    _synchronize(target.device)
    seconds = time.perf_counter() - started
    tokens, reason = _finish(tokens, settings)
    return PlainTrace(tokens, reason, seconds, margins[: len(tokens)])
