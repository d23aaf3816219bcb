"""The data-quality gate: which rows are degenerate training data, and when a shard is refused.

The gate exists because of one incident: 87% of a 914K-sample dataset was an empty think block
and "OK.", and nobody noticed until days of hidden-state extraction were wasted. A shard whose
degenerate fraction is above ``tokenize.max_degenerate_fraction`` fails at its first shard, with
the fraction, the top reasons, example ids and the most common response.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import numpy as np

log = logging.getLogger(__name__)

# Reasons a row is degenerate (bad training data). Keys are stable: they are counted in stats
# and named in config (`tokenize.degenerate_reasons`).
DEGENERATE_REASONS = {
    "generation_error": "the engine gave no response (error row)",
    "empty_response": "empty or whitespace-only response",
    "think_not_closed": "the think block never closed although generation stopped",
    "repetition_loop": "the response repeats the same n-gram over and over",
    "too_few_supervised": "fewer supervised tokens than tokenize.min_supervised_tokens",
    "identical_response": "the same response was given to many different prompts",
    "template_mismatch": "the chat template's renderings do not extend each other",
}


# The gate's settings (the `tokenize` config section), with the schema's defaults.
DEFAULT_GATE = {
    "min_supervised_tokens": 16,
    "max_degenerate_fraction": 0.05,
    "degenerate_reasons": sorted(DEGENERATE_REASONS),
    "identical_response_min_count": 5,
    "identical_response_min_fraction": 0.01,
    "repetition_ngram": 8,
    "repetition_min_repeats": 12,
}
HISTOGRAM_EDGES = [0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class DegenerateShard(RuntimeError):
    """The shard's data is degenerate; the message says why and shows examples. ``summary`` is
    the shard's stats (as written for a passing shard), ``cause`` a one-line account of them."""

    def __init__(self, message: str, summary: dict | None = None, cause: str | None = None):
        super().__init__(message)
        self.summary = summary or {}
        self.cause = cause or "failed the data-quality gate"


def repetition_loop(ids, n: int = 8, min_repeats: int = 12, min_cover: float = 0.5) -> bool:
    """The most frequent n-gram repeats often and covers most of the tokens."""
    if len(ids) < n * min_repeats:
        return False
    ids = np.asarray(ids, dtype=np.uint64)
    # Count 64-bit hashes of the n-grams first: a collision can only raise a count, so a
    # sequence that fails on hashes fails exactly; one that passes is counted again exactly.
    hashes = np.zeros(len(ids) - n + 1, dtype=np.uint64)
    for k in range(n):
        hashes = hashes * np.uint64(0x9E3779B97F4A7C15) + ids[k : len(ids) - n + 1 + k]
    if not _loop_counts(hashes, n, min_repeats, min_cover, len(ids)):
        return False
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)
    grams = np.ascontiguousarray(windows).view(np.dtype((np.void, 8 * n))).ravel()
    return _loop_counts(grams, n, min_repeats, min_cover, len(ids))


def _loop_counts(grams: np.ndarray, n: int, min_repeats: int, min_cover: float, length: int) -> bool:
    _, counts = np.unique(grams, return_counts=True)
    top = int(counts.max())
    return top >= min_repeats and top * n >= min_cover * length


def response_key(message: dict) -> str:
    return f"{(message.get('reasoning_content') or '').strip()}\x00{message.get('content', '').strip()}"


def row_checks(row: dict) -> list[str]:
    """Reasons visible before tokenizing: errors, empty responses, unclosed thinking."""
    if row["error"] is not None:
        return ["generation_error"]
    reasons = []
    for turn in row["turns"]:
        message = row["messages"][turn["message_index"]]
        text = (message["content"] or "").strip() + (message.get("reasoning_content") or "").strip()
        if not text and turn["finish_reason"] != "length":
            reasons.append("empty_response")
        if not turn["think_closed"] and turn["finish_reason"] == "stop":
            reasons.append("think_not_closed")
    return sorted(set(reasons))


def gate_shard(rows: list[dict], checks: dict[str, list[str]], encoded: dict, cfg: dict,
               shard_name: str, per_turn: bool) -> tuple[list, dict]:
    """Judge a shard: (the kept (row, sequence) pairs, the stats summary), or DegenerateShard.

    ``checks`` are each row's ``row_checks``; ``encoded`` maps a row id to its tokenized sequences
    (objects with ``supervised``, ``truncated``, ``round_trip_ok``, ``fell_back``, ``repetition``,
    ``input_ids``) or to the text of its template mismatch."""
    reasons_by_id: dict[str, list[str]] = {}
    finish = Counter()
    # A response shared by many different prompts is a collapse, not an answer.
    keys = {
        r["id"]: response_key(r["messages"][-1])
        for r in rows
        if r["error"] is None and r["messages"][-1]["role"] == "assistant"
    }
    key_counts = Counter(keys.values())
    identical_limit = max(cfg["identical_response_min_count"], cfg["identical_response_min_fraction"] * len(rows))
    out = []
    supervised_counts = []
    stats = Counter()
    for row in rows:
        for turn in row["turns"]:
            finish[turn["finish_reason"]] += 1
        reasons = list(checks[row["id"]])
        if row["id"] in keys and key_counts[keys[row["id"]]] >= identical_limit:
            reasons.append("identical_response")
        produced = encoded.get(row["id"], [])
        if isinstance(produced, str):
            reasons.append("template_mismatch")
            log.warning("%s: %s", row["id"], produced)
            produced = []
        for seq in produced:
            stats["offset_fallbacks"] += seq.fell_back
            if not seq.round_trip_ok:
                stats["round_trip_mismatches"] += 1
                reasons.append("template_mismatch")
            stats["truncated"] += seq.truncated
            supervised_counts.append(seq.supervised)
            if seq.supervised < cfg["min_supervised_tokens"]:
                reasons.append("too_few_supervised")
            if seq.repetition:
                reasons.append("repetition_loop")
            out.append((row, seq))
        reasons_by_id[row["id"]] = sorted(set(reasons))
    counted = set(cfg["degenerate_reasons"])
    degenerate = {i for i, rs in reasons_by_id.items() if counted & set(rs)}
    kept = [(row, seq) for row, seq in out if row["id"] not in degenerate]
    reason_counts = Counter(reason for rs in reasons_by_id.values() for reason in rs)
    fraction = len(degenerate) / len(rows) if rows else 0.0
    common, common_n = key_counts.most_common(1)[0] if key_counts else ("", 0)
    summary = {
        "shard": shard_name,
        "samples": len(rows),
        "sequences_out": len(kept),
        "degenerate_samples": len(degenerate),
        "degenerate_fraction": round(fraction, 6),
        "reasons": dict(reason_counts.most_common()),
        "examples": {
            reason: [i for i, rs in reasons_by_id.items() if reason in rs][:5] for reason in reason_counts
        },
        "finish_reasons": dict(finish),
        "truncated_sequences": stats["truncated"],
        "round_trip_mismatches": stats["round_trip_mismatches"],
        "offset_fallbacks": stats["offset_fallbacks"],
        "rows_per_turn": per_turn,
        "supervised_tokens_total": sum(seq.supervised for _, seq in kept),
        "tokens_total": sum(len(seq.input_ids) for _, seq in kept),
        "supervised_histogram": {
            "edges": HISTOGRAM_EDGES,
            "counts": _histogram(supervised_counts),
        },
        "most_common_response": {"text": common.replace("\x00", " | "), "count": common_n},
    }
    if fraction > cfg["max_degenerate_fraction"]:
        limit = cfg["max_degenerate_fraction"]
        raise DegenerateShard(describe_failure(summary, limit), summary, summarize_failure(summary, limit))
    return kept, summary


def _histogram(values: list[int]) -> list[int]:
    counts = [0] * (len(HISTOGRAM_EDGES))
    for v in values:
        for k in range(len(HISTOGRAM_EDGES) - 1, -1, -1):
            if v >= HISTOGRAM_EDGES[k]:
                counts[k] += 1
                break
    return counts


def summarize_failure(summary: dict, limit: float) -> str:
    """One line on a failed shard: fraction, top reasons, most common response."""
    top = ", ".join(f"{r} {n}" for r, n in list(summary["reasons"].items())[:3])
    common = summary["most_common_response"]
    return (
        f"failed the data-quality gate: {summary['degenerate_samples']} of {summary['samples']} "
        f"samples ({summary['degenerate_fraction']:.1%}) degenerate, above "
        f"tokenize.max_degenerate_fraction={limit} (top reasons: {top}; most common response, "
        f"{common['count']} times: {common['text'][:80]!r})"
    )


def describe_failure(summary: dict, limit: float) -> str:
    top = list(summary["reasons"].items())[:4]
    reasons = "; ".join(f"{r} {n} ({DEGENERATE_REASONS.get(r, r)})" for r, n in top)
    examples = {r: summary["examples"][r][:3] for r, _ in top}
    common = summary["most_common_response"]
    return (
        f"{summary['shard']}: {summary['degenerate_samples']} of {summary['samples']} samples "
        f"({summary['degenerate_fraction']:.1%}) are degenerate, above "
        f"tokenize.max_degenerate_fraction={limit}. Top reasons: {reasons}. "
        f"Example ids: {json.dumps(examples)}. Most common response ({common['count']} times): "
        f"{common['text'][:120]!r}. Fix the generation (template, thinking mode, sampling, "
        "max tokens) and regenerate this shard before spending GPU time on it."
    )


