"""The drafter's training semantics against references built from the rules themselves
(docs/training.md, "The drafter"): mask, train-vs-inference logits, loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_pipeline.model.config import FULL, SLIDING, DrafterConfig, default_target_layer_ids
from dflash_pipeline.model.drafter import DFlashDrafter
from dflash_pipeline.model.inference import DFlashProposer
from dflash_pipeline.model.block_masks import block_visibility, flex_block_mask
from dflash_pipeline.training.blocks import (
    block_loss,
    block_metrics,
    blocks_forward,
    build_blocks,
    sample_anchors,
)

VOCAB, HIDDEN, TAPS, BLOCK = 50, 32, 3, 4


def tiny_config(layer_types=(FULL, SLIDING), window=3, block=BLOCK) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        block_size=block,
        mask_token_id=VOCAB - 1,
        num_target_layers=8,
        target_layer_ids=[1, 3, 5][:TAPS],
        layer_types=list(layer_types),
        sliding_window=window if SLIDING in layer_types else None,
        rope_theta=10000.0,
        dtype="float32",
    )


def reference_visible(anchors, keep, S, B, W, b, q, kv):
    """One element of the mask, straight from the visibility rules."""
    n, k = divmod(q, B)
    a = int(anchors[b, n])
    if not keep[b, n]:
        return False
    if kv < S:
        return kv < a and (W is None or kv >= a + k - (W - 1))
    n2, k2 = divmod(kv - S, B)
    return n2 == n and (W is None or k2 <= k)


def supervised_slots(blocks, loss_mask, block_size, gamma):
    """(row, slot index in the packed blocks, target position, loss weight) of every supervised
    slot k >= 1 of every kept block, element by element (the references' loop)."""
    seq_len = loss_mask.shape[1]
    for row in range(loss_mask.shape[0]):
        for n in range(blocks.num_blocks):
            if not blocks.keep[row, n]:
                continue
            a = int(blocks.anchors[row, n])
            for k in range(1, block_size):
                if a + k < seq_len and loss_mask[row, a + k]:
                    yield row, n * block_size + k, a + k, math.exp(-(k - 1) / gamma)


def worst_gap_to_inference(drafter, embed, head, taps, input_ids, blocks, trained, infer) -> float:
    """Largest gap between the training forward's per-block output ``trained`` (slots 1..B-1 of
    each kept block) and ``infer(proposer, anchor_token, anchor)`` of a fresh inference proposer
    that saw the context before the anchor."""
    B, worst = drafter.config.block_size, 0.0
    for row in range(taps.shape[0]):
        for n in range(blocks.num_blocks):
            if not blocks.keep[row, n]:
                continue
            a = int(blocks.anchors[row, n])
            proposer = DFlashProposer(drafter, embed, head)
            proposer.extend_context(taps[row, :a])
            expected = infer(proposer, int(input_ids[row, a]), a)
            worst = max(worst, (trained[row, n * B + 1 : (n + 1) * B] - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("window", [None, 1, 3, 6])
def test_mask_equals_element_by_element_reference(window):
    anchors = torch.tensor([[0, 3, 7], [2, 5, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    S, B = 10, 4
    mask = block_visibility(anchors, keep, S, B, window)
    assert mask.shape == (2, 3 * B, S + 3 * B)
    for b in range(2):
        for q in range(3 * B):
            for kv in range(S + 3 * B):
                expected = reference_visible(anchors, keep, S, B, window, b, q, kv)
                assert bool(mask[b, q, kv]) == expected, (b, q, kv)


@pytest.mark.parametrize("window", [None, 3])
def test_flex_mask_equals_dense_mask(window):
    anchors = torch.tensor([[1, 4, 9]])
    keep = torch.tensor([[True, True, False]])
    S, B = 12, 4
    dense = block_visibility(anchors, keep, S, B, window)
    block_mask = flex_block_mask(anchors, keep, S, B, window)
    q = torch.arange(3 * B)[:, None]
    kv = torch.arange(S + 3 * B)[None, :]
    from_mod = block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    assert torch.equal(from_mod, dense[0])


def test_default_target_layer_ids_match_published_configs():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 1) == [18]


@pytest.mark.parametrize("ids", [[5, 1], [1, 1], [3, 1, 5]])
def test_target_layer_ids_out_of_ascending_order_are_refused(ids):
    """SGLang and vLLM feed the drafter the tapped layers in ascending order whatever the config
    lists (SGLang 0.5.17 on an H100: its tau did not move when an export's order was reversed):
    a drafter trained on another order would be served wrong, so the config is refused."""
    from dflash_pipeline.model.config import DrafterConfigError

    config = tiny_config()
    with pytest.raises(DrafterConfigError, match=r"must be strictly ascending: the engines feed"):
        DrafterConfig(**{**config.__dict__, "target_layer_ids": ids})


def make_batch(seed=0, batch=2, S=14):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (batch, S), generator=g)
    loss_mask = torch.zeros(batch, S, dtype=torch.long)
    loss_mask[0, 4:] = 1
    loss_mask[1, 2:9] = 1
    loss_mask[1, 11:] = 1
    taps = torch.randn(batch, S, TAPS * HIDDEN, generator=g)
    return input_ids, loss_mask, taps


def build(config, input_ids, loss_mask, num_anchors=6, seed=1, gamma=2.0):
    anchors, keep = sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(seed))
    return build_blocks(
        input_ids,
        loss_mask,
        anchors,
        keep,
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        gamma=gamma,
    )


def test_anchors_are_valid_distinct_sorted_and_padded():
    input_ids, loss_mask, _ = make_batch()
    anchors, keep = sample_anchors(loss_mask, 12, torch.Generator().manual_seed(0))
    for row in range(2):
        chosen = anchors[row][keep[row]].tolist()
        assert chosen == sorted(set(chosen))
        for a in chosen:
            assert loss_mask[row, a] == 1 and loss_mask[row, a + 1] == 1
    # Row 0 has 9 valid anchors (positions 4..12), row 1 has 6 + 2: fewer than 12 -> padding.
    assert keep.sum(dim=1).tolist() == [9, 8]


@pytest.mark.parametrize("layer_types", [(FULL, FULL), (FULL, SLIDING), (SLIDING, SLIDING)])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_training_logits_equal_inference_block_forward(layer_types, backend):
    torch.manual_seed(0)
    config = tiny_config(layer_types)
    drafter = DFlashDrafter(config).eval()
    embed = torch.randn(VOCAB, HIDDEN)
    head = torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    blocks = build(config, input_ids, loss_mask)
    with torch.no_grad():
        hidden = blocks_forward(drafter, taps, embed, blocks, backend=backend)
    logits = hidden @ head.t()
    worst = worst_gap_to_inference(
        drafter,
        embed,
        head,
        taps,
        input_ids,
        blocks,
        logits,
        lambda proposer, token, anchor: proposer.block_logits(token, anchor),
    )
    assert worst < 1e-5, worst


def test_loss_equals_hand_computed_weighted_mean():
    torch.manual_seed(0)
    config = tiny_config((FULL,))
    drafter = DFlashDrafter(config)
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    gamma = 2.0
    blocks = build(config, input_ids, loss_mask, gamma=gamma)
    hidden = blocks_forward(drafter, taps, embed, blocks)
    result = block_loss(hidden, head, blocks, chunk_rows=5)
    num, den = 0.0, 0.0
    for row, slot, target, w in supervised_slots(blocks, loss_mask, config.block_size, gamma):
        logit = (hidden[row, slot] @ head.t()).double()
        ce = -torch.log_softmax(logit, -1)[input_ids[row, target]].item()
        num += w * ce
        den += w
    assert result.loss.item() == pytest.approx(num / den, rel=1e-5)
    result.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.parameters())


def test_padding_blocks_produce_no_nan_and_metrics_count_real_blocks():
    config = tiny_config((FULL, SLIDING))
    drafter = DFlashDrafter(config)
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    blocks = build(config, input_ids, loss_mask, num_anchors=20)
    assert not blocks.keep.all()
    hidden = blocks_forward(drafter, taps, embed, blocks)
    assert torch.isfinite(hidden).all()
    result = block_loss(hidden, head, blocks)
    metrics = block_metrics(result.hits, blocks)
    assert metrics["blocks"] == int(blocks.keep.sum())
    assert 1.0 <= metrics["accept_len"] <= config.block_size
    assert len(metrics["accuracy_per_position"]) == config.block_size - 1


def test_simulated_acceptance_counts_leading_hits():
    input_ids = torch.arange(10)[None] % (VOCAB - 1)
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    anchors, keep = torch.tensor([[0, 4]]), torch.tensor([[True, True]])
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, block_size=4, mask_token_id=VOCAB - 1, gamma=7)
    hits = torch.zeros(1, 8, dtype=torch.bool)
    hits[0, [1, 2]] = True  # block 0: slots 1, 2 right, 3 wrong -> 2 accepted
    hits[0, [6, 7]] = True  # block 1: slot 1 wrong -> 0 accepted
    metrics = block_metrics(hits, blocks)
    assert metrics["accept_len"] == pytest.approx((3 + 1) / 2)
    assert metrics["accuracy"] == pytest.approx(4 / 6)


def test_fused_loss_gradient_equals_autograd_through_full_logits():
    config = tiny_config((FULL, SLIDING))
    torch.manual_seed(3)
    drafter = DFlashDrafter(config)
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    blocks = build(config, input_ids, loss_mask, gamma=3.0)
    hidden = blocks_forward(drafter, taps, embed, blocks).detach().requires_grad_(True)
    fused = block_loss(hidden, head, blocks, chunk_rows=7)
    (grad_fused,) = torch.autograd.grad(fused.loss, hidden)
    logits = (hidden @ head.t()).reshape(-1, VOCAB)
    ce = F.cross_entropy(logits, blocks.labels.flatten(), reduction="none")
    w = blocks.weights.flatten()
    naive = (ce * w).sum() / w.sum()
    (grad_naive,) = torch.autograd.grad(naive, hidden)
    assert fused.loss.item() == pytest.approx(naive.item(), rel=1e-6)
    torch.testing.assert_close(grad_fused, grad_naive, rtol=1e-5, atol=1e-7)
    hits = (logits.argmax(-1) == blocks.labels.flatten()).reshape(blocks.labels.shape)
    assert torch.equal(fused.hits & blocks.supervised, hits & blocks.supervised)


@pytest.mark.parametrize(
    "layer_types, window, causal",
    [([FULL, FULL], None, False), ([SLIDING, SLIDING], 4, True), ([SLIDING, FULL], 4, None)],
)
def test_the_export_writes_every_field_an_engine_reads(layer_types, window, causal):
    """Every field of ENGINE_FIELDS is in the exported config.json, as the drafter was trained;
    is_causal / dflash_config.causal only where one value holds for every layer."""
    from dflash_pipeline.model.config import ENGINE_FIELDS, UNIFORM_ONLY_FIELDS

    config = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        block_size=8,
        mask_token_id=99,
        num_target_layers=8,
        target_layer_ids=[1, 5],
        layer_types=layer_types,
        sliding_window=window,
    )
    exported = config.to_zlab()

    def lookup(path):
        node = exported
        for part in path.split("."):
            assert part in node, f"{path} is not written"
            node = node[part]
        return node

    for path in ENGINE_FIELDS:
        if path in UNIFORM_ONLY_FIELDS and causal is None:
            node = exported if "." not in path else exported["dflash_config"]
            assert path.split(".")[-1] not in node, f"{path} written for a mixed drafter"
            continue
        lookup(path)
    assert lookup("dflash_config.target_layer_ids") == [1, 5]
    assert lookup("eagle_aux_hidden_state_layer_ids") == [2, 6]  # capture after layers 1 and 5
    assert lookup("dflash_config.use_swa") == (window is not None)
    assert lookup("dflash_config.swa_window_size") == lookup("sliding_window") == window
    assert lookup("layer_types") == layer_types
    if causal is not None:
        assert lookup("is_causal") is causal and lookup("dflash_config.causal") is causal
    assert DrafterConfig.from_zlab(exported) == config  # the export reads back as trained


# --- DFlash2 (docs/training.md, "DFlash2") -------------------------------------------------------

import dataclasses  # noqa: E402

from dflash_pipeline.model.config import DFLASH2_FIELDS, DrafterConfigError  # noqa: E402
from dflash_pipeline.model.dflash2 import grouped_causal_conv  # noqa: E402
from dflash_pipeline.training.selector import selector_loss, selector_metrics, selector_weight  # noqa: E402

GROUP, RANK, TOP_K = 8, 6, 5


def tiny_dflash2(layer_types=(FULL, SLIDING), kernel=2, block=BLOCK) -> DrafterConfig:
    return dataclasses.replace(
        tiny_config(layer_types, block=block), algorithm="dflash2", conv_kernel_size=kernel,
        conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP_K,
    )  # fmt: skip


def perturbed(config, seed=0, scale=0.3) -> DFlashDrafter:
    """A DFlash2 drafter whose convolutions and selector are far from their no-op start."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.normal_(0, scale)
    return drafter.eval()


def test_a_fresh_dflash2_draws_the_dflash_weights_and_computes_the_same_logits():
    base, extended = tiny_config((FULL, SLIDING)), tiny_dflash2((FULL, SLIDING))
    torch.manual_seed(0)
    dflash = DFlashDrafter(base)
    torch.manual_seed(0)
    dflash2 = DFlashDrafter(extended)
    shared = dflash.state_dict()
    state = dflash2.state_dict()
    assert all(torch.equal(shared[k], state[k]) for k in shared)
    assert len(state) == len(shared) + 4 * base.num_hidden_layers + 3
    embed = torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    blocks = build(base, input_ids, loss_mask)
    with torch.no_grad():
        assert torch.equal(blocks_forward(dflash, taps, embed, blocks), blocks_forward(dflash2, taps, embed, blocks))
    # The selector starts as the logits' argmax (edge scores 0).
    head = torch.randn(VOCAB, HIDDEN)
    proposer = DFlashProposer(dflash2, embed, head)
    plain = DFlashProposer(dflash, embed, head)
    assert proposer.propose(taps[0, :5], 7, 5) == plain.propose(taps[0, :5], 7, 5)


def reference_conv(values, dynamic, base, group, block_length):
    """out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // g]) * values[t - o, c], element by
    element, reading zeros before each block's first slot."""
    b, Q, H = values.shape
    out = torch.zeros_like(values)
    for row in range(b):
        for t in range(Q):
            for c in range(H):
                for o in range(base.shape[0]):
                    if (t % block_length) - o < 0:
                        continue
                    coefficient = base[o, c] + dynamic[row, t, o, c // group]
                    out[row, t, c] += coefficient * values[row, t - o, c]
    return out


@pytest.mark.parametrize("kernel, block_length, blocks", [(2, 4, 3), (3, 4, 2), (3, 2, 2), (1, 4, 1)])
def test_grouped_causal_conv_equals_element_by_element_reference(kernel, block_length, blocks):
    g = torch.Generator().manual_seed(kernel * 10 + block_length)
    H = 16
    values = torch.randn(2, blocks * block_length, H, generator=g, dtype=torch.float64)
    dynamic = torch.randn(2, blocks * block_length, kernel, H // 4, generator=g, dtype=torch.float64)
    base = torch.randn(kernel, H, generator=g, dtype=torch.float64)
    got = grouped_causal_conv(values, dynamic, base, 4, block_length)
    torch.testing.assert_close(got, reference_conv(values, dynamic, base, 4, block_length))


def test_the_convolution_never_reads_the_previous_block():
    """Changing a block's slots changes nothing in the other blocks of the packed stream."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1, 12, 16, generator=g)
    dynamic, base = torch.randn(1, 12, 3, 4, generator=g), torch.randn(3, 16, generator=g)
    before = grouped_causal_conv(values, dynamic, base, 4, 4)
    changed = values.clone()
    changed[:, 4:8] += 1.0  # the middle block
    after = grouped_causal_conv(changed, dynamic, base, 4, 4)
    assert torch.equal(before[:, :4], after[:, :4]) and torch.equal(before[:, 8:], after[:, 8:])
    assert not torch.equal(before[:, 4:8], after[:, 4:8])


@pytest.mark.parametrize("layer_types", [(FULL, FULL), (FULL, SLIDING)])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("kernel", [2, 3])
def test_dflash2_training_forward_equals_inference_block_forward(layer_types, backend, kernel):
    """Packed blocks with the block-local convolution give, for every block, the hidden states
    of an inference call on that block alone (also for blocks running off the sequence end)."""
    config = tiny_dflash2(layer_types, kernel=kernel)
    drafter = perturbed(config)
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    blocks = build(config, input_ids, loss_mask)
    with torch.no_grad():
        hidden = blocks_forward(drafter, taps, embed, blocks, backend=backend)
    worst = worst_gap_to_inference(
        drafter,
        embed,
        head,
        taps,
        input_ids,
        blocks,
        hidden,
        lambda proposer, token, anchor: proposer.block_hidden(token, anchor),
    )
    assert worst < 1e-5, worst


def test_a_short_tail_block_gives_the_causal_convolution_the_same_prefix():
    """With an all-sliding (block-causal) drafter a block of L < B slots equals the first L
    slots of the full block: the convolution looks only backwards."""
    config = tiny_dflash2((SLIDING, SLIDING), kernel=3)
    drafter = perturbed(config, seed=2)
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    _, _, taps = make_batch()
    proposer = DFlashProposer(drafter, embed, head)
    proposer.extend_context(taps[0, :6])
    full = proposer.block_hidden(5, 6)
    short = proposer.block_hidden(5, 6, block_size=2)
    torch.testing.assert_close(short, full[:1], rtol=0, atol=1e-6)


def brute_force_walk(selector, hidden, logits, anchor):
    """The first-order walk spelled out: all K candidate scores with explicit sums."""
    K = selector.top_k
    P, S = selector.predecessor_codebook.double(), selector.successor_codebook.double()
    gate = hidden.double() @ selector.hidden_projection.weight.double().t()
    prev, path = anchor, []
    for t in range(hidden.shape[0]):
        ids = logits[t].topk(K).indices.tolist()
        scores = [
            float(logits[t, c]) + sum(float(P[prev, j] * gate[t, j] * S[c, j]) for j in range(P.shape[1])) for c in ids
        ]
        prev = ids[max(range(K), key=scores.__getitem__)]
        path.append(prev)
    return path


def test_selector_walk_equals_brute_force_and_samples_from_its_rows():
    config = tiny_dflash2()
    drafter = perturbed(config, scale=1.0)
    selector = drafter.candidate_selector
    g = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(6, HIDDEN, generator=g), torch.randn(6, VOCAB, generator=g)
    drafts, candidates, rows = selector.walk(hidden, logits, anchor=4)
    assert drafts == brute_force_walk(selector, hidden, logits, 4)
    assert rows is None and candidates.shape == (6, TOP_K)
    unary_argmax = logits.argmax(-1).tolist()
    assert drafts != unary_argmax  # the edges matter here, or the test proves nothing
    drafts, candidates, rows = selector.walk(hidden, logits, 4, temperature=0.7, generator=g)
    torch.testing.assert_close(rows.sum(-1), torch.ones(6))
    assert all(d in candidates[t].tolist() for t, d in enumerate(drafts))
    # Each row is softmax(score / T) along the sampled path: recompute it with the sampled
    # predecessors.
    gate = hidden @ selector.hidden_projection.weight.t()
    prev = 4
    for t, d in enumerate(drafts):
        unary = logits[t, candidates[t]]
        edge = selector.successor_codebook[candidates[t]] @ (selector.predecessor_codebook[prev] * gate[t])
        torch.testing.assert_close(rows[t], torch.softmax((unary + edge) / 0.7, -1))
        prev = d


@pytest.mark.parametrize("policy", ["strict", "replace_weakest"])
@pytest.mark.parametrize("normalization", ["base", "covered"])
def test_selector_loss_equals_hand_computed(policy, normalization):
    config = tiny_dflash2((FULL,))
    drafter = perturbed(config, scale=0.5)
    selector = drafter.candidate_selector
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    blocks = build(config, input_ids, loss_mask, gamma=2.0)
    hidden = blocks_forward(drafter, taps, embed, blocks)
    base = block_loss(hidden, head, blocks, chunk_rows=5, top_k=TOP_K)
    result = selector_loss(
        selector, hidden, head, blocks, base.rows, base.top_ids, gold_policy=policy, normalization=normalization
    )
    B = config.block_size
    num = den_all = den_in = 0.0
    covered = hits = total = 0
    P, Sc = selector.predecessor_codebook.double(), selector.successor_codebook.double()
    for row, slot, target, w in supervised_slots(blocks, loss_mask, B, 2.0):
        h = hidden[row, slot].double()
        logits = h @ head.double().t()
        ids = logits.topk(TOP_K).indices.tolist()
        gold, prev = int(input_ids[row, target]), int(input_ids[row, target - 1])
        total += 1
        den_all += w
        gate = h @ selector.hidden_projection.weight.double().t()
        score = lambda c, logits=logits, prev=prev, gate=gate: logits[c] + (P[prev] * gate * Sc[c]).sum()  # noqa: E731
        best = max(ids, key=lambda c: float(score(c)))
        if gold in ids:
            covered += 1
            hits += best == gold
        elif policy == "strict":
            continue
        else:
            ids = ids[:-1] + [gold]
        scores = torch.stack([score(c) for c in ids])
        num += w * float(torch.logsumexp(scores, 0) - scores[ids.index(gold)])
        den_in += w
    expected = num / (den_all if normalization == "base" else den_in)
    assert result.loss.item() == pytest.approx(expected, rel=1e-5)
    metrics = selector_metrics(result, blocks)
    assert metrics["selector_recall"] == pytest.approx(covered / total)
    assert metrics["selector_accuracy"] == pytest.approx(hits / total)
    assert 1.0 <= metrics["selector_accept_len"] <= B


def test_selector_term_trains_the_backbone_unless_stopped():
    # Seeded: an unseeded draw (the process's RNG as other tests left it) once gave a selector
    # parameter an exactly-zero gradient in CI, failing the test for reasons of the draw alone.
    torch.manual_seed(0)
    config = tiny_dflash2((FULL,))
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN)
    input_ids, loss_mask, taps = make_batch()
    for stop in (False, True):
        drafter = perturbed(config, scale=0.5).train()
        blocks = build(config, input_ids, loss_mask)
        hidden = blocks_forward(drafter, taps, embed, blocks)
        base = block_loss(hidden, head, blocks, top_k=TOP_K)
        result = selector_loss(
            drafter.candidate_selector, hidden, head, blocks, base.rows, base.top_ids, stop_gradient=stop
        )
        result.loss.backward()
        selector_grads = [p.grad for p in drafter.candidate_selector.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in selector_grads)
        backbone = drafter.layers[0].mlp.down_proj.weight.grad
        assert (backbone is None) == stop


def test_selector_weight_warms_up_then_ramps():
    values = [selector_weight(s, 100, 2.0, 0.1, 0.2) for s in range(100)]
    assert values[:10] == [0.0] * 10
    assert values[10] == pytest.approx(0.1) and values[29] == pytest.approx(2.0)
    assert values[30:] == [2.0] * 70
    assert selector_weight(0, 100, 1.0, 0.0, 0.0) == 1.0


def test_dflash2_config_is_checked_and_exported_where_the_authors_read_it():
    config = tiny_dflash2()
    exported = config.to_zlab()
    for path in DFLASH2_FIELDS:
        node = exported
        for part in path.split("."):
            node = node[part]
    assert exported["architectures"] == ["DFlash2DraftModel"]
    assert exported["dflash_config"]["conv_group_size"] == GROUP
    assert "conv_group_size" not in exported and "algorithm" not in exported
    assert DrafterConfig.from_zlab(exported) == config
    assert "conv_kernel_size" not in tiny_config().to_zlab()["dflash_config"]
    for change, message in [
        (dict(conv_group_size=5), "must divide hidden_size"),
        (dict(conv_kernel_size=BLOCK + 1), "conv_kernel_size"),
        (dict(selector_top_k=VOCAB + 1), "selector_top_k"),
        (dict(selector_rank=None), "needs selector_rank"),
        (dict(algorithm="dflash3"), "algorithm must be one of"),
    ]:
        with pytest.raises(DrafterConfigError, match=message):
            dataclasses.replace(config, **change)
    with pytest.raises(DrafterConfigError, match="only apply to algorithm dflash2"):
        dataclasses.replace(tiny_config(), selector_rank=4)
