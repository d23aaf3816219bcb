"""The speculative-decoding loop on tiny fp32 targets (dense Qwen3 and a Gated-DeltaNet hybrid):
acceptance with an oracle and a random proposer, the drafter's context contract, losslessness,
hybrid state rollback and sampled verification."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

from dflash_pipeline.evaluation.loop import (
    DecodeSettings,
    ProposerError,
    plain_decode,
    speculative_decode,
)
from dflash_pipeline.evaluation.runner import TargetRunner, _snapshot
from dflash_pipeline.model.taps import TargetTaps

VOCAB = 64
PROMPT = [1, 2, 3, 4, 5, 6, 7]
TAPS = [0, 2]
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # Random weights give near-uniform logits and one repeated token; a wide init and a scaled
    # LM head make greedy decoding varied and well defined (fp32 throughout).
    initializer_range=0.3,
)
HEAD_SCALE = 2.0


def _finish(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model.eval()


def dense_target(vocab: int = VOCAB, seed: int = 0):
    torch.manual_seed(seed)
    return _finish(Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, **SHAPE)))


def hybrid_target(seed: int = 0):
    """Qwen3.5-style: Gated DeltaNet (linear attention) layers between full-attention layers."""
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **SHAPE,
    )
    return _finish(Qwen3_5ForCausalLM(config))


def sliding_window_target(seed: int = 0):
    """Dense, with sliding-window layers whose window (5) is shorter than a block of 8."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **SHAPE,
    )
    return _finish(Qwen3ForCausalLM(config))


@pytest.fixture(scope="module")
def dense():
    return dense_target()


@pytest.fixture(scope="module")
def hybrid():
    return hybrid_target()


class ContextCheckingProposer:
    """Base for the test proposers: records what the loop passes and checks the contract."""

    def __init__(self, block_size: int, prompt_len: int):
        self.block_size = block_size
        self.target_layer_ids = list(TAPS)
        self.prompt_len = prompt_len
        self.reset()

    def reset(self) -> None:
        self.context_rows: list[torch.Tensor] = []
        self.seen = 0  # positions passed so far
        self.anchors: list[tuple[int, int]] = []

    def propose(self, new_context, anchor_token, anchor_position):
        assert new_context.shape[0] == anchor_position - self.seen, "context must cover the gap"
        self.seen = anchor_position
        self.context_rows.append(new_context)
        self.anchors.append((anchor_token, anchor_position))
        return self.drafts(anchor_token, anchor_position)


class OracleProposer(ContextCheckingProposer):
    """Knows the target's greedy continuation up to ``known`` generated tokens; wrong after."""

    def __init__(self, block_size, prompt_len, continuation, known):
        super().__init__(block_size, prompt_len)
        self.continuation = continuation
        self.known = known

    def drafts(self, anchor_token, anchor_position):
        start = anchor_position - self.prompt_len + 1  # index of the first draft's position
        out = []
        for index in range(start, start + self.block_size - 1):
            right = self.continuation[index] if index < len(self.continuation) else 0
            out.append(right if index < self.known else (right + 1) % VOCAB)
        return out


class RandomProposer(ContextCheckingProposer):
    def __init__(self, block_size, prompt_len, seed=0, vocab=VOCAB):
        super().__init__(block_size, prompt_len)
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def drafts(self, anchor_token, anchor_position):
        return torch.randint(0, self.vocab, (self.block_size - 1,), generator=self.generator).tolist()


class CoinProposer(OracleProposer):
    """The right draft half of the time: blocks end at varied accepted lengths."""

    def __init__(self, block_size, prompt_len, continuation, seed=0):
        super().__init__(block_size, prompt_len, continuation, known=len(continuation))
        self.generator = torch.Generator().manual_seed(seed)

    def drafts(self, anchor_token, anchor_position):
        right = super().drafts(anchor_token, anchor_position)
        coins = torch.rand(len(right), generator=self.generator).tolist()
        return [t if c < 0.5 else (t + 7) % VOCAB for t, c in zip(right, coins)]


def greedy_continuation(model, length):
    return plain_decode(TargetRunner(model), PROMPT, DecodeSettings(length)).tokens


def test_oracle_proposer_gets_every_full_block_accepted(dense):
    block, max_new = 4, 30
    continuation = greedy_continuation(dense, max_new + block)
    proposer = OracleProposer(block, len(PROMPT), continuation, known=max_new)
    trace = speculative_decode(TargetRunner(dense, TAPS), proposer, PROMPT, DecodeSettings(max_new))
    # Every block inside the known continuation is accepted whole: tau = B on those steps.
    assert trace.accepted_lengths[:-1] == [block - 1] * (len(trace.accepted_lengths) - 1)
    assert len(trace.accepted_lengths) == math.ceil((max_new - 1) / block)
    assert trace.tokens == continuation[:max_new]
    assert trace.finish_reason == "length"


def test_random_proposer_gives_tau_near_one_and_the_same_output(dense):
    max_new = 40
    proposer = RandomProposer(4, len(PROMPT))
    runner = TargetRunner(dense, TAPS)
    trace = speculative_decode(runner, proposer, PROMPT, DecodeSettings(max_new))
    tau = sum(a + 1 for a in trace.accepted_lengths) / len(trace.accepted_lengths)
    assert 1.0 <= tau < 1.2
    assert trace.tokens == greedy_continuation(dense, max_new)


def test_proposer_sees_each_committed_position_once_with_the_targets_taps(dense):
    """Context rows, in order, equal the taps of one full forward over prompt + output."""
    max_new = 25
    continuation = greedy_continuation(dense, max_new + 8)
    proposer = CoinProposer(5, len(PROMPT), continuation)
    trace = speculative_decode(TargetRunner(dense, TAPS), proposer, PROMPT, DecodeSettings(max_new))
    context = torch.cat(proposer.context_rows)
    last_anchor_position = proposer.anchors[-1][1]
    assert context.shape[0] == last_anchor_position  # positions 0 .. anchor-1, each once
    full = torch.tensor([PROMPT + trace.tokens])
    with torch.no_grad():
        hidden = dense(input_ids=full, output_hidden_states=True).hidden_states
    # Tap id i is the OUTPUT of decoder layer i: hidden_states[i + 1] (index 0 is the embedding).
    expected = torch.cat([hidden[i + 1][0] for i in TAPS], dim=-1)[:last_anchor_position]
    torch.testing.assert_close(context, expected, atol=1e-4, rtol=1e-4)
    # The same taps training reads: evaluation and training agree on the layer offset.
    training_taps = TargetTaps(dense, TAPS)(full)[0, :last_anchor_position]
    torch.testing.assert_close(context, training_taps, atol=1e-4, rtol=1e-4)
    # Each anchor is the token at its position in the final sequence.
    sequence = PROMPT + trace.tokens
    assert all(sequence[pos] == token for token, pos in proposer.anchors)


@pytest.mark.parametrize(
    "target_kind, block",
    [("dense", 2), ("dense", 8), ("hybrid", 3), ("hybrid", 8), ("sliding_window", 8)],
)
def test_greedy_loop_output_equals_plain_greedy_decoding(block, target_kind, dense, hybrid):
    model = {"dense": dense, "hybrid": hybrid}.get(target_kind) or sliding_window_target()
    max_new = 30
    continuation = greedy_continuation(model, max_new + block)
    runner = TargetRunner(model, TAPS)
    for proposer in (
        CoinProposer(block, len(PROMPT), continuation, seed=block),
        RandomProposer(block, len(PROMPT), seed=block),
    ):
        trace = speculative_decode(runner, proposer, PROMPT, DecodeSettings(max_new))
        assert trace.tokens == continuation[:max_new], type(proposer).__name__
    assert runner.is_hybrid == (target_kind == "hybrid")


def test_generation_stops_at_a_stop_token_like_plain_decoding(dense):
    continuation = greedy_continuation(dense, 40)
    stop_token = continuation[17]
    first = continuation.index(stop_token)
    settings = DecodeSettings(40, stop_token_ids=frozenset({stop_token}))
    proposer = CoinProposer(4, len(PROMPT), continuation)
    trace = speculative_decode(TargetRunner(dense, TAPS), proposer, PROMPT, settings)
    plain = plain_decode(TargetRunner(dense), PROMPT, settings)
    assert trace.tokens == plain.tokens == continuation[: first + 1]
    assert trace.finish_reason == plain.finish_reason == "stop"


class NaiveCropRunner(TargetRunner):
    """Rollback as a plain cache crop does it (z-lab's HF loop, transformers ``Cache.crop``):
    attention keys/values and the convolution window are cut back correctly, but the recurrent
    state stays as the rejected drafts left it."""

    def keep(self, accepted, block_taps):
        after_block = [
            {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None} for layer in self.linear_layers
        ]
        taps = super().keep(accepted, block_taps)
        for layer, states in zip(self.linear_layers, after_block):
            for i, state in states.items():
                layer.recurrent_states[i].copy_(state)
        return taps


def test_a_naive_cache_crop_breaks_losslessness_on_the_hybrid_target(hybrid):
    """The recurrent state after rejected drafts is wrong: the hybrid test above is meaningful."""
    max_new = 30
    continuation = greedy_continuation(hybrid, max_new + 4)
    proposer = CoinProposer(4, len(PROMPT), continuation)
    trace = speculative_decode(NaiveCropRunner(hybrid, TAPS), proposer, PROMPT, DecodeSettings(max_new))
    assert any(a < 3 for a in trace.accepted_lengths)  # some drafts were rejected
    assert trace.tokens != continuation[:max_new]


def test_hybrid_rollback_restores_the_state_plain_decoding_has(hybrid):
    """After keeping 2 of a 5-token block, every linear-attention state equals the state of a
    cache that only ever saw those 2 tokens."""
    block = [9, 10, 11, 12, 13]
    runner = TargetRunner(hybrid, TAPS)
    runner.start()
    runner.forward(PROMPT)
    logits, taps = runner.verify(block)
    runner.keep(2, taps)
    reference = TargetRunner(hybrid, TAPS)
    reference.start()
    reference.forward(PROMPT)
    reference.forward(block[:2])
    assert runner.length == reference.length == len(PROMPT) + 2
    for got, want in zip(runner.linear_layers, reference.linear_layers):
        got_state, want_state = _snapshot(got), _snapshot(want)
        torch.testing.assert_close(got_state.recurrent, want_state.recurrent, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_state.conv, want_state.conv, atol=1e-5, rtol=1e-5)
    assert runner.cache.get_seq_length() == reference.cache.get_seq_length()


def test_sampled_verification_reproduces_the_targets_distribution():
    """At temperature 1 the committed tokens follow the target's own distribution: the empirical
    joint of the 2nd and 3rd generated tokens over many seeds matches the exact one computed
    from the target's conditionals (chi-square, 15 degrees of freedom)."""
    vocab, runs, block = 4, 400, 3
    torch.manual_seed(1)
    # A narrower init than SHAPE's: every (t2, t3) cell stays likely enough for chi-square.
    config = Qwen3Config(vocab_size=vocab, **{**SHAPE, "num_hidden_layers": 2, "initializer_range": 0.1})
    model = Qwen3ForCausalLM(config).eval()
    prompt = [0, 1, 2, 3]
    runner = TargetRunner(model, [0, 1])
    counts = torch.zeros(vocab, vocab)
    accepted_any = 0
    for seed in range(runs):
        proposer = RandomProposer(block, len(prompt), seed=10_000 + seed, vocab=vocab)
        settings = DecodeSettings(3, temperature=1.0, seed=seed)
        trace = speculative_decode(runner, proposer, prompt, settings)
        counts[trace.tokens[1], trace.tokens[2]] += 1
        accepted_any += trace.accepted_lengths[0] > 0
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
        seq2 = torch.tensor([prompt + [t1] for t1 in range(vocab)])
        p2 = model(seq2).logits[:, -1].softmax(-1)  # [t1, t2]
        seq3 = torch.tensor([prompt + [t1, t2] for t1 in range(vocab) for t2 in range(vocab)])
        p3 = model(seq3).logits[:, -1].softmax(-1).view(vocab, vocab, vocab)  # [t1, t2, t3]
    exact = torch.einsum("a,ab,abc->bc", p1, p2, p3)
    # What a verify reading the posterior one slot off would give: t3 ignores t2.
    slot_off = torch.einsum("a,ab,ac->bc", p1, p2, p2)

    def chi2(distribution):
        expected = distribution * runs
        return float(((counts - expected) ** 2 / expected).sum())

    assert accepted_any > runs // 10  # the accepted-draft path was exercised
    assert chi2(exact) < 37.7  # 99.9% quantile of chi-square with 15 dof
    assert chi2(slot_off) > 37.7  # the test can tell a wrong rule apart


def test_a_proposer_returning_the_wrong_number_of_drafts_is_named(dense):
    class Short(RandomProposer):
        def drafts(self, anchor_token, anchor_position):
            return super().drafts(anchor_token, anchor_position)[:-1]

    with pytest.raises(ProposerError, match="returned 2 drafts for block size 4"):
        speculative_decode(TargetRunner(dense, TAPS), Short(4, len(PROMPT)), PROMPT, DecodeSettings(10))


def test_tap_ids_outside_the_target_are_refused(dense):
    with pytest.raises(ValueError, match=r"tap layer ids \[4\] are outside the target's 4"):
        TargetRunner(dense, [0, 4])


def test_sampled_drafts_are_verified_by_speculative_sampling():
    """Drafts sampled from q over K candidates (DFlash2's selector above temperature 0): the
    first committed token follows the target's p_0 and, after an accepted first draft, the next
    one p_1 (chi-square); a proposer misreporting q is caught by the same test."""
    from dflash_pipeline.evaluation.loop import TokenPicker

    vocab, k, runs = 6, 3, 4000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g)
    p = torch.softmax(logits, dim=-1)
    # As the selector's: candidates are the top-K of the drafter's logits, here a noisy copy of
    # the target's, and q is sharper than p over them.
    draft_logits = logits[:3] + 0.5 * torch.randn(3, vocab, generator=g)
    candidates = draft_logits.topk(k, dim=-1).indices
    q = torch.softmax(2.0 * draft_logits.gather(1, candidates), dim=-1)

    def chi2(counts, probs):
        expected = probs * counts.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    def sample(reported):
        pick = TokenPicker(DecodeSettings(4, temperature=1.0, seed=1), torch.device("cpu"))
        first, second = torch.zeros(vocab), torch.zeros(vocab)
        accepted_any = 0
        for _ in range(runs):
            index = torch.multinomial(q, 1, generator=pick.generator)[:, 0]
            drafts = candidates.gather(1, index[:, None])[:, 0].tolist()
            accepted, token = pick.speculative(logits, drafts, candidates, reported)
            committed = [*drafts[:accepted], token]
            first[committed[0]] += 1
            if accepted >= 1:
                accepted_any += 1
                second[committed[1]] += 1
        return first, second, accepted_any

    first, second, accepted_any = sample(q)
    assert accepted_any > runs // 5  # drafts were accepted, not only resampled
    assert chi2(first, p[0]) < 20.5 and chi2(second, p[1]) < 20.5  # 99.9% quantile, 5 dof
    lied_first, _, _ = sample(torch.full_like(q, 1.0 / k))
    assert chi2(lied_first, p[0]) > 20.5


def tiny_dflash2_proposer(model, seed=0):
    """A DFlash2 drafter for the dense test target, its convolutions and selector perturbed off
    their no-op start so the walk is not the logits' argmax."""
    from dflash_pipeline.model.config import drafter_config_for_target
    from dflash_pipeline.model.drafter import DFlashDrafter
    from dflash_pipeline.model.inference import DFlashProposer

    config = drafter_config_for_target(
        model.config, num_layers=2, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=TAPS,
        dtype="float32", algorithm="dflash2",
        dflash2=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6),
    )  # fmt: skip
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.normal_(0, 0.5)
    return DFlashProposer(drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight)


def test_dflash2_drafter_decodes_losslessly_greedy_and_samples_above_zero(dense):
    proposer = tiny_dflash2_proposer(dense)
    assert proposer.samples_drafts
    runner = TargetRunner(dense, proposer.target_layer_ids)
    greedy = speculative_decode(runner, proposer, PROMPT, DecodeSettings(24))
    assert greedy.tokens == greedy_continuation(dense, 24)
    sampled = speculative_decode(runner, proposer, PROMPT, DecodeSettings(24, temperature=0.8, seed=3))
    assert len(sampled.tokens) == 24 and all(0 <= t < VOCAB for t in sampled.tokens)
    assert all(len(d) == 3 for d in sampled.drafts)
    again = speculative_decode(runner, proposer, PROMPT, DecodeSettings(24, temperature=0.8, seed=3))
    assert again.tokens == sampled.tokens  # one seed, one generator for drafts and verify
