"""Repetition loops in generated responses: a span that repeats one unit of tokens (exactly or
with small drifts: a counter, a substituted word, a number of another length) for most of its
length. The data-quality gate (``data.quality``) flags rows whose response loops; this module
measures it, in numpy, on all spans of a shard at once (``bench/repetition.py``).
"""

from __future__ import annotations

import numpy as np

# The repetition-loop check (``repetition_loop``): fixed parts of the method; the thresholds are
# settings (DEFAULT_GATE, `tokenize.repetition_*`).
LOOP_BLOCK = 128  # tokens scored together: the resolution at which a loop is found
LOOP_ANCHOR = 3  # k-gram length whose earlier occurrences propose periods and follow drifting units
LOOP_HOPS = 2  # earlier occurrences of a k-gram looked at (the most recent ones)
LOOP_DRIFT = 16  # a unit of P tokens may shift by P // LOOP_DRIFT tokens from one repeat to the next
LOOP_CANDIDATES = 3  # periods tried per block: the most frequent distances to earlier occurrences
MIN_LOOP_TOKENS = 64  # shorter runs are not loops (a row of dashes, an indentation)
LOOP_GROUP = 1 << 16  # tokens measured in one pass (larger groups ran slower: cache)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _previous_occurrence(x: np.ndarray, k: int) -> np.ndarray:
    """For each position i, the last j < i whose k-gram ending at j equals the one ending at i,
    or -1. By hashes (64 bits less those of the position): a collision only proposes a wrong
    period, which the exact test rejects."""
    n = len(x)
    prev = np.full(n, -1, np.int64)
    if n <= k:
        return prev
    u = x.astype(np.uint64)
    h = np.zeros(n - k + 1, np.uint64)
    for j in range(k):
        h = h * _MIX + u[j : n - k + 1 + j] + np.uint64(1)
    h = (h ^ (h >> np.uint64(31))) * _MIX  # the last id reaches the high bits too
    # One sort of (hash high bits, position): equal hashes end up side by side in position order.
    bits = max(1, int(len(h) - 1).bit_length())
    keys = np.sort((h >> np.uint64(bits) << np.uint64(bits)) | np.arange(len(h), dtype=np.uint64))
    order = (keys & np.uint64((1 << bits) - 1)).astype(np.int64)
    grams = keys >> np.uint64(bits)
    same = grams[1:] == grams[:-1]
    prev[order[1:][same] + k - 1] = order[:-1][same] + k - 1
    return prev


def _block_periodicity(x: np.ndarray, floor: np.ndarray, max_period: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block's best period and how many of its tokens repeat at that period.

    ``x`` holds several spans one after the other, each padded to whole blocks with ids that
    match nothing (distinct negative numbers); ``floor[i]`` is where i's span starts: nothing
    before it counts. A token at position i repeats at period P when it equals the token P or
    2P back (two periods back: a token substituted in one repeat breaks one comparison, not
    two), or, for P >= LOOP_DRIFT, when its k-gram occurred P -/+ d or 2P -/+ 2d back with
    d = P // LOOP_DRIFT (a unit whose length changes by a few tokens, e.g. a number that grows
    a digit, stays aligned). The periods tried per block are the most frequent distances from
    its k-grams to their previous occurrences (at most ``max_period``); the test of each is
    exact. Cost: two sorts and a few gathers over all the tokens, O(n log n)."""
    n = len(x)
    nb = n // block
    prev = _previous_occurrence(x, LOOP_ANCHOR).astype(np.int32)
    x, floor = x.astype(np.int32), floor.astype(np.int32)  # ids and positions fit; half the traffic
    # Distances to the 1st, 2nd, ... previous occurrence of each position's k-gram in its own
    # span (0: none).
    idx = np.arange(n, dtype=np.int32)
    lags = np.zeros((LOOP_HOPS, n), np.int32)
    p = np.where(prev >= floor, prev, -1)
    for hop in range(LOOP_HOPS):
        lags[hop] = np.where(p >= 0, idx - p, 0)
        p = np.where(p >= 0, prev[np.maximum(p, 0)], -1)
        p = np.where(p >= floor, p, -1)
    first = lags[0]
    voters = np.nonzero((first > 0) & (first <= max_period))[0]
    cand = np.zeros((nb, LOOP_CANDIDATES), np.int32)
    if len(voters):
        # 32-bit keys where they fit (sorting them is about twice as fast).
        kind = np.int32 if nb * (block + 1) * (max_period + 1) < 2**31 else np.int64
        keys, counts = np.unique(
            (voters // block).astype(kind) * (max_period + 1) + first[voters].astype(kind), return_counts=True
        )
        blocks, periods = keys // (max_period + 1), keys % (max_period + 1)
        # Per block: most votes first, then the shorter period (one sort of a composite key).
        ranked = np.sort((blocks * (block + 1) + block - counts.astype(kind)) * (max_period + 1) + periods)
        blocks, periods = ranked // ((block + 1) * (max_period + 1)), ranked % (max_period + 1)
        rank = np.arange(len(blocks)) - np.searchsorted(blocks, blocks)
        top = rank < LOOP_CANDIDATES
        cand[blocks[top], rank[top]] = periods[top]
    pos = idx.reshape(nb, 1, block)
    here = x[pos]
    low_end = floor[pos]
    period = cand[:, :, None]
    hit = np.zeros((nb, LOOP_CANDIDATES, block), bool)
    for back in (period, 2 * period):
        src = pos - back
        hit |= (src >= low_end) & (here == x[np.maximum(src, 0)])
    hit &= period > 0
    drift = period // LOOP_DRIFT  # 0 below LOOP_DRIFT: nothing the exact test has not counted
    for unit in (1, 2):  # within unit * (P -/+ d): one unsigned comparison (lags are >= 0)
        low, width = np.where(period > 0, unit * (period - drift), -1), (2 * unit * drift).astype(np.uint32)
        for at in lags.reshape(LOOP_HOPS, nb, 1, block):
            hit |= (at - low).view(np.uint32) <= width
    counts = hit.sum(-1)
    # The shortest period within 2% of the best count: a multiple of the unit scores as well.
    near = counts >= counts.max(1, keepdims=True) - max(1, block // 50)
    best = np.where(near & (cand > 0), cand, np.iinfo(np.int32).max).argmin(1)
    rows = np.arange(nb)
    return cand[rows, best].astype(np.int64), counts[rows, best]


def _repeating(x: np.ndarray, lo: int, hi: int, period: int) -> np.ndarray:
    """Whether each token of x[lo:hi] equals the token one or two periods back."""
    i = np.arange(lo, hi)
    one, two = i - period, i - 2 * period
    return ((one >= 0) & (x[i] == x[np.maximum(one, 0)])) | ((two >= 0) & (x[i] == x[np.maximum(two, 0)]))


def _extent(hits: np.ndarray, min_match: float) -> int:
    """How far a loop reaches into a block: the longest prefix of ``hits`` that ends on a hit and
    repeats at least ``min_match`` of its tokens."""
    density = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    ok = np.nonzero(hits & (density >= min_match))[0]
    return int(ok[-1]) + 1 if len(ok) else 0


def measure_repetitions(
    spans: list, max_period: int = 1024, min_match: float = 0.75, min_repeats: int = 4
) -> list[dict]:
    """The loops of each span of ids and the fraction of the span they cover.

    A loop is a run of consecutive blocks each with at least ``min_match`` of its tokens repeating
    at a period of at most ``max_period`` (``_block_periodicity``), extended into the blocks on
    either side as far as the repeats go, plus the unit's first occurrence before it; it must
    hold ``min_repeats`` units and MIN_LOOP_TOKENS tokens. Each measurement: ``fraction`` (loop
    tokens / span tokens), ``loop_tokens``, ``tokens``, and for the longest loop its ``period``,
    ``repeats`` (its length / period), ``match`` (the fraction of its blocks' tokens that
    repeat) and ``start``. The spans are measured together, in groups of about LOOP_GROUP
    tokens: numpy's cost per call, not per token, is what a short span would pay alone."""
    spans = [np.asarray(span) for span in spans]
    out = [_no_loop(len(span)) for span in spans]
    todo = [k for k, span in enumerate(spans) if len(span) >= MIN_LOOP_TOKENS]
    next_k = 0
    while next_k < len(todo):
        group, tokens = [], 0
        while next_k < len(todo) and (not group or tokens + len(spans[todo[next_k]]) <= LOOP_GROUP):
            group.append(todo[next_k])
            tokens += len(spans[todo[next_k]])
            next_k += 1
        padded = [-(-len(spans[k]) // LOOP_BLOCK) * LOOP_BLOCK for k in group]
        offsets = np.concatenate([[0], np.cumsum(padded)])
        x = -1 - np.arange(offsets[-1], dtype=np.int64)  # the padding: distinct, matches nothing
        floor = np.repeat(offsets[:-1], padded)
        for k, lo in zip(group, offsets[:-1]):
            x[lo : lo + len(spans[k])] = spans[k]
        periods, counts = _block_periodicity(x, floor, max_period, LOOP_BLOCK)
        for k, lo, hi in zip(group, offsets[:-1] // LOOP_BLOCK, offsets[1:] // LOOP_BLOCK):
            n = len(spans[k])
            match = counts[lo:hi] / np.minimum(LOOP_BLOCK, n - np.arange(hi - lo) * LOOP_BLOCK)
            if (match >= min_match).any():
                out[k] = _loops(spans[k].astype(np.int64), periods[lo:hi], match, min_match, min_repeats)
    return out


def _no_loop(n: int) -> dict:
    return {"fraction": 0.0, "loop_tokens": 0, "tokens": n, "period": 0, "repeats": 0.0, "match": 0.0, "start": 0}


def _loops(x: np.ndarray, periods: np.ndarray, match: np.ndarray, min_match: float, min_repeats: int) -> dict:
    """A span's measurement from its blocks' periods and repeating fractions."""
    n = len(x)
    out = _no_loop(n)
    good = np.concatenate([[False], match >= min_match, [False]])
    starts = np.nonzero(good[1:] & ~good[:-1])[0]
    ends = np.nonzero(~good[1:] & good[:-1])[0]
    covered, longest, previous_end = 0, None, 0
    for b0, b1 in zip(starts, ends):
        values, votes = np.unique(periods[b0:b1], return_counts=True)
        period = int(values[votes.argmax()])
        lo, hi = b0 * LOOP_BLOCK, min(n, b1 * LOOP_BLOCK)
        end = hi + _extent(_repeating(x, hi, min(n, hi + LOOP_BLOCK), period), min_match)
        first = lo - _extent(_repeating(x, max(0, lo - LOOP_BLOCK), lo, period)[::-1], min_match)
        start = max(first - period, previous_end, 0)
        length = end - start
        if length < MIN_LOOP_TOKENS or length < min_repeats * period:
            continue
        previous_end = end
        covered += int(length)
        if longest is None or length > longest["loop_tokens"]:
            lengths = np.minimum(LOOP_BLOCK, n - np.arange(b0, b1) * LOOP_BLOCK)
            longest = {
                "loop_tokens": int(length),
                "period": period,
                "repeats": round(float(length / period), 1),
                "match": round(float((match[b0:b1] * lengths).sum() / lengths.sum()), 3),
                "start": int(start),
            }
    if longest:
        out.update(longest)
    out["loop_tokens"] = covered
    out["fraction"] = round(float(covered / n), 4)
    return out


def measure_repetition(ids, max_period: int = 1024, min_match: float = 0.75, min_repeats: int = 4) -> dict:
    """``measure_repetitions`` of one span."""
    return measure_repetitions([ids], max_period, min_match, min_repeats)[0]


def repetition_loop(
    ids, max_period: int = 1024, min_match: float = 0.75, min_repeats: int = 4, min_fraction: float = 0.3
) -> dict | None:
    """The span's measurement (``measure_repetition``) if loops cover ``min_fraction`` of it."""
    found = measure_repetition(ids, max_period, min_match, min_repeats)
    return found if found["loop_tokens"] and found["fraction"] >= min_fraction else None


def response_spans(ids, mask, think_start: int | None, think_end: int | None) -> list[tuple[str, np.ndarray]]:
    """The supervised ids as (``thinking`` | ``answer``, ids) spans. Each supervised run (an
    assistant turn) is split after its first ``think_end`` token; a run without one is thinking
    where a think block is open at its end (cut by the token limit; the prompt may open it), and
    answer otherwise. Token ids, not texts: the check sees the very ids trained on, the engine's
    own ids included, without tokenizing anything again."""
    ids = np.asarray(ids)
    supervised = np.asarray(mask).astype(bool)
    edges = np.diff(np.concatenate([[False], supervised, [False]]).astype(np.int8))
    opens = np.nonzero(ids == think_start)[0] if think_start is not None else np.zeros(0, np.int64)
    closes = np.nonzero(ids == think_end)[0] if think_end is not None else np.zeros(0, np.int64)
    spans = []
    for lo, hi in zip(np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]):
        inside = closes[(closes >= lo) & (closes < hi)]
        if len(inside):
            cut = int(inside[0]) + 1
            spans += [("thinking", ids[lo:cut]), ("answer", ids[cut:hi])]
            continue
        last_open = opens[opens < hi].max(initial=-1)
        last_close = closes[closes < hi].max(initial=-1)
        spans.append(("thinking" if last_open > last_close else "answer", ids[lo:hi]))
    return spans


def sequences_repetition(
    sequences: list[tuple], cfg: dict, think_start: int | None = None, think_end: int | None = None
) -> list[dict | None]:
    """For each (ids, mask) sequence, its looping span that loops over the largest fraction of
    itself (the measurement, ``span`` naming it), or None. All spans measured together."""
    spans, owners = [], []
    for k, (ids, mask) in enumerate(sequences):
        if int(np.count_nonzero(mask)) < MIN_LOOP_TOKENS:
            continue  # no span can hold a loop: most short rows stop here
        for name, span in response_spans(ids, mask, think_start, think_end):
            if len(span) >= MIN_LOOP_TOKENS:
                spans.append(span)
                owners.append((k, name))
    found = measure_repetitions(
        spans, cfg["repetition_max_period"], cfg["repetition_min_match"], cfg["repetition_min_repeats"]
    )
    out: list[dict | None] = [None] * len(sequences)
    for (k, name), m in zip(owners, found):
        if m["loop_tokens"] and m["fraction"] >= cfg["repetition_min_fraction"]:
            if out[k] is None or m["fraction"] > out[k]["fraction"]:
                out[k] = {"span": name, **m}
    return out


def sequence_repetition(
    ids, mask, cfg: dict, think_start: int | None = None, think_end: int | None = None
) -> dict | None:
    """``sequences_repetition`` of one sequence."""
    return sequences_repetition([(ids, mask)], cfg, think_start, think_end)[0]


REPETITION_SETTINGS = (
    "repetition_max_period",
    "repetition_min_match",
    "repetition_min_repeats",
    "repetition_min_fraction",
)
REPETITION_EXAMPLES = 20  # flagged sequences whose measurements the stats keep
