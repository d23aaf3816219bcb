"""The data-quality gate: which rows are degenerate training data, and when a shard is refused.

The gate exists because of one incident: 87% of a 914K-sample dataset was an empty think block
and "OK.", and nobody noticed until days of hidden-state extraction were wasted. A shard fails
when its degenerate fraction is above ``tokenize.max_degenerate_fraction`` and it holds at least
``tokenize.min_degenerate_rows`` degenerate samples (one odd sample of a 13-sample trial run is no
evidence about the generation; the incident's shards fail at once). The message gives the
fraction, the top reasons, example ids, the most common response when it is common, and advice by
cause: a greedy run (regenerating repeats the same text), off-domain prompts, a chat template
problem, a length cut. The sampling that produced the rows is read from their fingerprints
(``dflash_pipeline.engines.regenerate.fingerprint``) unless the caller passes it.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

from dflash_pipeline.core.config import TOKENIZE_GATE_KEYS, schema_defaults
from dflash_pipeline.data.repetition import REPETITION_EXAMPLES, REPETITION_SETTINGS

log = logging.getLogger(__name__)

# Reasons a row is degenerate (bad training data). Keys are stable: they are counted in stats
# and named in config (`tokenize.degenerate_reasons`).
DEGENERATE_REASONS = {
    "generation_error": "the engine gave no response (error row)",
    "empty_response": "empty or whitespace-only response",
    "think_not_closed": "the think block never closed although generation stopped",
    "repetition_loop": "the thinking or the answer loops: a unit of tokens repeated (nearly) verbatim over much of it",
    "too_few_supervised": "fewer supervised tokens than tokenize.min_supervised_tokens",
    "identical_response": "the same response was given to many different prompts",
    "template_mismatch": "the chat template's renderings do not extend each other",
    "special_token_in_text": (
        "a generated turn's text holds a special token's literal (e.g. <|im_end|>) and the engine "
        "returned no token ids: which ids the model produced cannot be recovered from the text"
    ),
}


# The gate's settings (keys of the `tokenize` config section), with the schema's defaults.
GATE_SETTINGS = TOKENIZE_GATE_KEYS
DEFAULT_GATE = {key: schema_defaults("tokenize")[key] for key in GATE_SETTINGS}
HISTOGRAM_EDGES = [0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# The failure message quotes the most common response only when it is common: given to at least
# this many prompts and to tokenize.identical_response_min_fraction of the shard. Two prompts can
# share a short answer by chance ("4."); three of a trial's dozen, or 1% of a shard, sharing one
# is what a collapse (the incident's "OK.") looks like, and the quote then says what it is.
MOST_COMMON_MIN_COUNT = 3
# A reason is a cause the advice speaks to when it holds for this share of the degenerate samples.
CAUSE_MIN_SHARE = 0.2


class DegenerateShard(RuntimeError):
    """The shard's data is degenerate; the message says why and shows examples. ``summary`` is
    the shard's stats (as written for a passing shard), ``cause`` a one-line account of them."""

    def __init__(self, message: str, summary: dict | None = None, cause: str | None = None):
        super().__init__(message)
        self.summary = summary or {}
        self.cause = cause or "failed the data-quality gate"


def response_key(message: dict) -> str:
    return f"{(message.get('reasoning_content') or '').strip()}\x00{message.get('content', '').strip()}"


def row_checks(row: dict, special_texts: tuple[str, ...] = ()) -> list[str]:
    """Reasons visible before tokenizing: errors, empty responses, unclosed thinking, and
    generated text (content or reasoning of a generated turn) holding any of ``special_texts``,
    the literals of the tokenizer's special tokens (pass none for a row whose engine ids are
    used instead of its text)."""
    if row["error"] is not None:
        return ["generation_error"]
    reasons = []
    for turn in row["turns"]:
        message = row["messages"][turn["message_index"]]
        content, reasoning = message["content"] or "", message.get("reasoning_content") or ""
        if not (content.strip() + reasoning.strip()) and turn["finish_reason"] != "length":
            reasons.append("empty_response")
        if not turn["think_closed"] and turn["finish_reason"] == "stop":
            reasons.append("think_not_closed")
        if any(literal in content or literal in reasoning for literal in special_texts):
            reasons.append("special_token_in_text")
    return sorted(set(reasons))


def generation_sampling(rows: list[dict]) -> dict | None:
    """The sampling settings that generated ``rows`` (``temperature``, ``top_p``, ``seed``,
    ``max_new_tokens``, ...), read from their fingerprints (``regenerate.fingerprint``: a digest,
    ``:``, the JSON of what produced the row); None when no row's fingerprint says, or rows
    disagree."""
    found = set()
    for row in rows:
        digest, _, payload = (row.get("fingerprint") or "").partition(":")
        try:
            sampling = json.loads(payload).get("sampling") if payload else None
        except (ValueError, AttributeError):
            sampling = None
        if isinstance(sampling, dict):
            found.add(json.dumps(sampling, sort_keys=True))
    return json.loads(found.pop()) if len(found) == 1 else None


def gate_shard(
    rows: list[dict],
    checks: dict[str, list[str]],
    encoded: dict,
    cfg: dict,
    shard_name: str,
    per_turn: bool,
    sampling: dict | None = None,
) -> tuple[list, dict]:
    """Judge a shard: (the kept (row, sequence) pairs, the stats summary), or DegenerateShard.

    ``checks`` are each row's ``row_checks``; ``encoded`` maps a row id to its tokenized sequences
    (objects with ``supervised``, ``truncated``, ``round_trip_ok``, ``fell_back``, ``repetition``
    (``sequence_repetition``'s measurement or None), ``input_ids``) or to the text of its template
    mismatch. ``sampling``: the generation's sampling settings (at least ``temperature``; also
    ``seed`` and ``max_new_tokens`` where known), for the failure's advice; None: read from the
    rows' fingerprints (``generation_sampling``), and where they do not say, the advice does not
    presume greedy or sampled generation."""
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
    loops = []  # the measurements of the sequences the repetition check flagged
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
                loops.append({"id": row["id"], "turn": seq.turn, **seq.repetition})
            out.append((row, seq))
        reasons_by_id[row["id"]] = sorted(set(reasons))
    counted = set(cfg["degenerate_reasons"])
    degenerate = {i for i, rs in reasons_by_id.items() if counted & set(rs)}
    kept = [(row, seq) for row, seq in out if row["id"] not in degenerate]
    reason_counts = Counter(reason for rs in reasons_by_id.values() for reason in rs)
    fraction = len(degenerate) / len(rows) if rows else 0.0
    common, common_n = key_counts.most_common(1)[0] if key_counts else ("", 0)
    # Degenerate samples cut by the token limit (finish_reason length) for a reason other than a
    # loop (a loop runs to the limit too; a larger one would not end it).
    cut = [
        row["id"] for row in rows
        if row["id"] in degenerate and "repetition_loop" not in reasons_by_id[row["id"]]
        and any(turn["finish_reason"] == "length" for turn in row["turns"])
    ]  # fmt: skip
    if sampling is None:
        sampling = generation_sampling(rows)
    limit = cfg["max_degenerate_fraction"]
    min_rows = cfg.get("min_degenerate_rows", DEFAULT_GATE["min_degenerate_rows"])
    summary = {
        "shard": shard_name,
        "samples": len(rows),
        "sequences_out": len(kept),
        "degenerate_samples": len(degenerate),
        "degenerate_fraction": round(fraction, 6),
        "reasons": dict(reason_counts.most_common()),
        "examples": {reason: [i for i, rs in reasons_by_id.items() if reason in rs][:5] for reason in reason_counts},
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
        "most_common_response": {
            "text": common.replace("\x00", " | "),
            "count": common_n,
            "common": common_n >= max(MOST_COMMON_MIN_COUNT, cfg["identical_response_min_fraction"] * len(rows)),
        },
        "degenerate_reasons": dict(
            Counter(r for i in degenerate for r in reasons_by_id[i] if r in counted).most_common()
        ),
        "length_cut": {
            "samples": len(cut),
            "reasons": dict(Counter(r for i in cut for r in reasons_by_id[i] if r in counted).most_common()),
        },
        "sampling": sampling,
        "gate": {"max_degenerate_fraction": limit, "min_degenerate_rows": min_rows},
        "repetition": {
            "settings": {key: cfg.get(key, DEFAULT_GATE[key]) for key in REPETITION_SETTINGS},
            "flagged_sequences": len(loops),
            "flagged_spans": dict(Counter(loop["span"] for loop in loops).most_common()),
            "examples": loops[:REPETITION_EXAMPLES],
        },
    }
    if fraction > limit and len(degenerate) >= min_rows:
        summary["gate"]["verdict"] = "failed"
        raise DegenerateShard(describe_failure(summary, limit), summary, summarize_failure(summary, limit))
    if fraction > limit:
        summary["gate"]["verdict"] = "passed: too few degenerate samples to judge"
        log.warning(
            "%s: %d of %d samples (%.1f%%) are degenerate, above tokenize.max_degenerate_fraction=%s, "
            "but fewer than tokenize.min_degenerate_rows=%d: too few to judge the generation by; the "
            "shard passes without them (reasons: %s)",
            shard_name,
            len(degenerate),
            len(rows),
            100 * fraction,
            limit,
            min_rows,
            summary["degenerate_reasons"],
        )
    else:
        summary["gate"]["verdict"] = "passed"
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
    """One line on a failed shard: fraction, top reasons, the most common response when it is
    common, the likely causes."""
    top = ", ".join(f"{r} {n}" for r, n in list(summary["reasons"].items())[:3])
    common = summary["most_common_response"]
    quote = f"; most common response, {common['count']} times: {common['text'][:80]!r}" if _is_common(common) else ""
    labels = [label for label, _ in failure_advice(summary)]
    causes = f"likely cause{'s' if len(labels) > 1 else ''}: {', '.join(labels)}"
    return (
        f"failed the data-quality gate: {summary['degenerate_samples']} of {summary['samples']} "
        f"samples ({summary['degenerate_fraction']:.1%}) degenerate, above "
        f"tokenize.max_degenerate_fraction={limit} (top reasons: {top}{quote}; {causes})"
    )


def describe_failure(summary: dict, limit: float) -> str:
    top = list(summary["reasons"].items())[:4]
    reasons = "; ".join(f"{r} {n} ({DEGENERATE_REASONS.get(r, r)})" for r, n in top)
    examples = {r: summary["examples"][r][:3] for r, _ in top}
    common = summary["most_common_response"]
    quote = f" Most common response ({common['count']} times): {common['text'][:120]!r}." if _is_common(common) else ""
    loops = describe_loops(summary) if "repetition_loop" in dict(top) else ""
    min_rows = summary.get("gate", {}).get("min_degenerate_rows", DEFAULT_GATE["min_degenerate_rows"])
    advice = " ".join(text for _, text in failure_advice(summary))
    return (
        f"{summary['shard']}: {summary['degenerate_samples']} of {summary['samples']} samples "
        f"({summary['degenerate_fraction']:.1%}) are degenerate, above "
        f"tokenize.max_degenerate_fraction={limit} (and at least tokenize.min_degenerate_rows={min_rows}). "
        f"Top reasons: {reasons}. Example ids: {json.dumps(examples)}.{quote}{loops} What to do: {advice}"
    )


def _is_common(common: dict) -> bool:
    # Summaries written before the "common" flag: the old rule (always quoted) less single answers.
    return bool(common.get("common", common.get("count", 0) >= MOST_COMMON_MIN_COUNT))


# Reasons that say what the model wrote (as opposed to the engine failing, the template or a
# token limit: think_not_closed is advised on as a length cut).
CONTENT_REASONS = ("empty_response", "identical_response", "too_few_supervised", "repetition_loop")
# Reasons that say many prompts got nothing worth training on: the prompts may not be the target's.
SHORT_ANSWER_REASONS = ("empty_response", "identical_response", "too_few_supervised")


def failure_advice(summary: dict) -> list[tuple[str, str]]:
    """(cause, what to do) for each likely cause of a failed shard, the most frequent first.

    A reason counts as a cause when it holds for CAUSE_MIN_SHARE of the degenerate samples (the
    top one always does). The causes: the engine failing (generation_error); a chat template
    problem (template_mismatch: regenerating changes nothing); special tokens in text without ids;
    a length cut (degenerate samples cut at finish_reason length, or thinking never closed: raise
    generation.max_new_tokens); off-domain prompts (many empty, identical or too short answers);
    and for what the model wrote, whether regenerating can help at all: a greedy run
    (temperature 0) repeats the same text, a seeded or sampled one draws from the same
    distribution, so the sampling or the prompts must change."""
    counts = summary.get("degenerate_reasons") or summary.get("reasons") or {}
    total = summary.get("degenerate_samples") or sum(counts.values()) or 1
    length_cut = summary.get("length_cut") or {}
    cut = length_cut.get("samples", 0)
    # What the model wrote, apart from the samples the token limit cut short: those are the
    # limit's doing, not the prompts' or the sampling's.
    uncut = {r: n - length_cut.get("reasons", {}).get(r, 0) for r, n in counts.items()}
    ranked = sorted(uncut.items(), key=lambda kv: -kv[1])
    causes = {r for i, (r, n) in enumerate(ranked) if n > 0 and (i == 0 or n >= CAUSE_MIN_SHARE * total)}
    sampling = summary.get("sampling") or {}
    max_tokens = sampling.get("max_new_tokens")
    now = f" (now {max_tokens})" if max_tokens else ""
    advice: list[tuple[int, str, str]] = []  # (weight, cause, text)

    def add(weight: int, cause: str, text: str) -> None:
        advice.append((weight, cause, text))

    if "generation_error" in causes:
        add(
            uncut["generation_error"],
            "engine errors",
            f"The engine gave no response for {counts['generation_error']} samples (generation_error): see the "
            "generate job's log for the errors (timeouts: generation.request_timeout_s), fix the engine and "
            "regenerate this shard; these rows say nothing about the model.",
        )
    if "template_mismatch" in causes:
        add(
            uncut["template_mismatch"],
            "a chat template problem",
            f"A chat template problem ({counts['template_mismatch']} template_mismatch): the template's renderings "
            "of these conversations do not extend each other, so their loss masks cannot be placed, and "
            "regenerating gives the same mismatch. Check the chat template of target.model (and "
            "generation.thinking) on the example ids; if the rows are fine, leave template_mismatch out of "
            "tokenize.degenerate_reasons.",
        )
    if "special_token_in_text" in causes:
        add(
            uncut["special_token_in_text"],
            "special tokens in text",
            f"{counts['special_token_in_text']} generated turns hold a special token's literal and the engine "
            "returned no token ids (special_token_in_text): use an engine that returns the ids (sglang, vllm), "
            "or leave special_token_in_text out of tokenize.degenerate_reasons to train on the text as written.",
        )
    not_closed = uncut.get("think_not_closed", 0) if "think_not_closed" in causes else 0
    if cut >= CAUSE_MIN_SHARE * total or not_closed:
        what = []
        if cut >= CAUSE_MIN_SHARE * total:
            what.append(f"{cut} degenerate samples were cut by the token limit (finish_reason length)")
        if not_closed:
            what.append(
                f"{not_closed} ended inside the thinking (think_not_closed: the engine said stop, as some "
                "do for a cut at the server's context length)"
            )
        add(
            max(cut, not_closed),
            "a length cut",
            f"A length cut: {' and '.join(what)}. Raise generation.max_new_tokens{now}, and the server's "
            "context length with it, so that the thinking fits, then regenerate this shard.",
        )
    if causes & set(SHORT_ANSWER_REASONS):
        n = max(uncut.get(r, 0) for r in SHORT_ANSWER_REASONS if r in causes)
        add(
            n,
            "off-domain prompts",
            "Many prompts got an empty, a too short or the same answer (empty_response, too_few_supervised, "
            "identical_response): read the prompts of the example ids. Prompts the target has nothing to say "
            "to (no request in them, placeholders, tool output, another domain) get answers like 'OK.': "
            "filter them out of dataset.paths. An empty think block before a short answer can also mean the "
            "thinking mode is off (generation.thinking).",
        )
    if causes & set(CONTENT_REASONS):
        n = max(uncut.get(r, 0) for r in CONTENT_REASONS if r in causes)
        temperature = sampling.get("temperature")
        if temperature is not None and float(temperature) == 0:
            add(
                n,
                "greedy generation",
                "The generation is greedy (temperature 0): regenerating with the same settings gives the same "
                "text, so deleting the shard to regenerate it changes nothing. Change the sampling "
                "(generation.sampling.temperature, top_p: the model card's recommended values for this "
                "thinking mode) or the prompts, then regenerate.",
            )
        elif temperature is not None:
            seed = sampling.get("seed")
            seeded = (
                f" with generation.seed {seed} sent with every request, regenerating repeats much the same samples"
                if seed is not None
                else ", regenerating draws new samples from the same distribution"
            )
            add(
                n,
                "the sampling or the prompts",
                f"The generation samples at temperature {temperature}{seeded}: the degenerate share will be about "
                "the same. Change what produces them (generation.sampling, generation.thinking or the prompts), "
                "then regenerate.",
            )
        else:
            add(
                n,
                "the generation settings or the prompts",
                "Fix what produces these answers (the sampling, the thinking mode, the prompts) before regenerating "
                "this shard: regenerating with the same settings gives the same kind of output (at temperature 0, "
                "the same text).",
            )
    if not advice:
        add(
            1,
            "the generation settings",
            "Fix the generation (template, thinking mode, sampling, max tokens) and regenerate this shard before "
            "spending GPU time on it.",
        )
    advice.sort(key=lambda item: -item[0])
    return [(cause, text) for _, cause, text in advice]


def describe_loops(summary: dict, count: int = 3) -> str:
    """The repetition check's thresholds and the measurements of a few flagged sequences."""
    rep = summary["repetition"]
    settings = ", ".join(f"tokenize.{key}={value}" for key, value in rep["settings"].items())
    examples = "; ".join(
        f"{loop['id']} {loop['span']}: period {loop['period']} x {loop['repeats']}, {loop['match']:.0%} of tokens "
        f"repeat, loops over {loop['fraction']:.0%} of {loop['tokens']} tokens"
        for loop in rep["examples"][:count]
    )
    return f" Repetition loops ({settings}): {examples}."
