"""Tokenize stage: exact token ids and loss masks per generated shard, and the data-quality gate.

The gate exists because of one incident: 87% of a 914K-sample dataset was an empty think block
and "OK.", and nobody noticed until days of hidden-state extraction were wasted. A shard whose
degenerate fraction is above ``tokenize.max_degenerate_fraction`` fails here, at its first shard,
with the fraction, the top reasons, example ids and the most common response.

Run by hand: ``python -m dflash_pipeline.tokenization --help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.data.tokenize import (
    DEGENERATE_REASONS,
    Sequence,
    TemplateMismatch,
    conversation_pieces,
    needs_rows_per_turn,
    render,
    repetition_loop,
    response_key,
    round_trip_failures,
    tokenize_pieces,
)
from dflash_pipeline.storage import write_atomically

log = logging.getLogger(__name__)

TOKENIZED_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("split", pa.string()),
        ("turn", pa.int32()),  # assistant message index for per-turn rows, -1 for whole conversations
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("num_supervised", pa.int32()),
        ("truncated", pa.bool_()),
    ]
)
HISTOGRAM_EDGES = [0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

DEFAULTS = {
    "max_length": 8192,
    "min_supervised_tokens": 16,
    "max_degenerate_fraction": 0.05,
    "degenerate_reasons": sorted(DEGENERATE_REASONS),
    "identical_response_min_count": 5,
    "identical_response_min_fraction": 0.01,
    "repetition_ngram": 8,
    "repetition_min_repeats": 12,
}


CHUNK = 256  # rows per worker task
_WORKER = None  # the ShardTokenizer a forked worker renders with


def _render_or_error(tokenizer: ShardTokenizer, row: dict):
    try:
        return tokenizer.render_row(row)
    except TemplateMismatch as err:
        return str(err)


def _render_chunk(rows: list[dict]) -> list:
    return [_render_or_error(_WORKER, r) for r in rows]


class DegenerateShard(RuntimeError):
    """The shard's data is degenerate; the message says why and shows examples."""


def _messages(row: dict) -> list[dict]:
    out = []
    for m in row["messages"]:
        msg = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content") is not None:
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def _engine_sequence(tokenizer, messages: list[dict], turn: dict, thinking: bool) -> Sequence | None:
    """Prompt ids + the engine's own generated ids, where the engine returned them."""
    ids = turn.get("output_ids")
    if not ids:
        return None
    prompt = render(tokenizer, messages[: turn["message_index"]], True, thinking)
    seq = Sequence()
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = list(ids)
    if turn["finish_reason"] == "stop" and out[-1] != tokenizer.eos_token_id:
        out.append(tokenizer.eos_token_id)
    seq.input_ids = prompt_ids + out
    seq.loss_mask = [0] * len(prompt_ids) + [1] * len(out)
    seq.text = prompt + tokenizer.decode(out)
    return seq


class ShardTokenizer:
    def __init__(self, tokenizer, thinking: bool, settings: dict | None = None, workers: int = 1):
        self.tokenizer = tokenizer
        self.workers = workers
        self.thinking = thinking
        self.cfg = {**DEFAULTS, **(settings or {})}
        self.per_turn = needs_rows_per_turn(tokenizer, thinking)

    def row_checks(self, row: dict) -> list[str]:
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

    def render_row(self, row: dict) -> list[tuple[int, object]]:
        """(turn, text pieces) per sequence of the row, or (turn, engine Sequence) where the
        engine returned its ids. Raises TemplateMismatch."""
        messages = _messages(row)
        found = conversation_pieces(self.tokenizer, messages, self.thinking, self.per_turn)
        if len(found) == 1 and len(row["turns"]) == 1:
            engine = _engine_sequence(self.tokenizer, messages, row["turns"][0], self.thinking)
            if engine is not None:
                return [(found[0][0], engine)]
        return found

    def render_rows(self, rows: list[dict]) -> list[list[tuple[int, object]] | str]:
        """Rendering is the Python-heavy part: spread it over worker processes."""
        if self.workers <= 1 or len(rows) < 2 * CHUNK:
            return [_render_or_error(self, r) for r in rows]
        global _WORKER
        _WORKER = self  # inherited by the forked workers
        chunks = [rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)]
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(self.workers, mp_context=ctx) as pool:
            return [item for part in pool.map(_render_chunk, chunks) for item in part]

    def sequences(self, rendered: list) -> list[list[tuple[int, Sequence]] | str]:
        """Tokenize every row's pieces with one batched tokenizer call."""
        pending = [
            pieces
            for item in rendered
            if not isinstance(item, str)
            for _, pieces in item
            if not isinstance(pieces, Sequence)
        ]
        encoded = iter(tokenize_pieces(self.tokenizer, pending))
        out = []
        for item in rendered:
            if isinstance(item, str):
                out.append(item)
                continue
            out.append([(turn, p if isinstance(p, Sequence) else next(encoded)) for turn, p in item])
        return out

    def run(self, table: pa.Table, shard_name: str = "shard") -> tuple[pa.Table, dict]:
        cfg = self.cfg
        rows = table.to_pylist()
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
        out, supervised_counts = [], []
        stats = Counter()
        checks = {r["id"]: self.row_checks(r) for r in rows}
        to_render = [r for r in rows if "generation_error" not in checks[r["id"]]]
        rendered = dict(zip((r["id"] for r in to_render), self.sequences(self.render_rows(to_render))))
        all_seqs = [seq for item in rendered.values() if not isinstance(item, str) for _, seq in item]
        failures = iter(round_trip_failures(self.tokenizer, all_seqs))
        for row in rows:
            for turn in row["turns"]:
                finish[turn["finish_reason"]] += 1
            reasons = list(checks[row["id"]])
            if row["id"] in keys and key_counts[keys[row["id"]]] >= identical_limit:
                reasons.append("identical_response")
            produced = rendered.get(row["id"], [])
            if isinstance(produced, str):
                reasons.append("template_mismatch")
                log.warning("%s: %s", row["id"], produced)
                produced = []
            for turn_index, seq in produced:
                if next(failures):
                    stats["round_trip_mismatches"] += 1
                    reasons.append("template_mismatch")
                truncated = len(seq.input_ids) > cfg["max_length"]
                ids = seq.input_ids[: cfg["max_length"]]
                mask = seq.loss_mask[: cfg["max_length"]]
                stats["truncated"] += truncated
                supervised = sum(mask)
                supervised_counts.append(supervised)
                if supervised < cfg["min_supervised_tokens"]:
                    reasons.append("too_few_supervised")
                sup_ids = [i for i, m in zip(ids, mask) if m]
                if repetition_loop(sup_ids, cfg["repetition_ngram"], cfg["repetition_min_repeats"]):
                    reasons.append("repetition_loop")
                out.append(
                    {
                        "id": row["id"],
                        "split": row["split"],
                        "turn": turn_index,
                        "input_ids": ids,
                        "loss_mask": mask,
                        "num_tokens": len(ids),
                        "num_supervised": supervised,
                        "truncated": truncated,
                    }
                )
            reasons_by_id[row["id"]] = sorted(set(reasons))
        counted = set(cfg["degenerate_reasons"])
        degenerate = {i for i, rs in reasons_by_id.items() if counted & set(rs)}
        kept = [r for r in out if r["id"] not in degenerate]
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
            "rows_per_turn": self.per_turn,
            "supervised_tokens_total": sum(r["num_supervised"] for r in kept),
            "tokens_total": sum(r["num_tokens"] for r in kept),
            "supervised_histogram": {
                "edges": HISTOGRAM_EDGES,
                "counts": _histogram(supervised_counts),
            },
            "most_common_response": {"text": common.replace("\x00", " | "), "count": common_n},
        }
        if fraction > cfg["max_degenerate_fraction"]:
            raise DegenerateShard(describe_failure(summary, cfg["max_degenerate_fraction"]))
        return pa.Table.from_pylist(kept, schema=TOKENIZED_SCHEMA), summary


def _histogram(values: list[int]) -> list[int]:
    counts = [0] * (len(HISTOGRAM_EDGES))
    for v in values:
        for k in range(len(HISTOGRAM_EDGES) - 1, -1, -1):
            if v >= HISTOGRAM_EDGES[k]:
                counts[k] += 1
                break
    return counts


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


def tokenize_file(generated: str, model: str, out: str, stats_out: str, thinking: bool, settings: dict) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    table = pq.read_table(generated)
    name = generated.rsplit("/", 1)[-1]
    try:
        workers = os.cpu_count() or 1
        result, summary = ShardTokenizer(tokenizer, thinking, settings, workers).run(table, name)
    except DegenerateShard as err:
        log.error("%s", err)
        raise
    with write_atomically(out) as tmp:
        pq.write_table(result, tmp)
    with write_atomically(stats_out) as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    log.info(
        "%s: %d samples -> %d sequences, %d degenerate (%s), %d supervised tokens",
        name, summary["samples"], summary["sequences_out"], summary["degenerate_samples"],
        summary["reasons"], summary["supervised_tokens_total"],
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.tokenization", description=__doc__)
    parser.add_argument("generated")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--thinking", choices=["on", "off"], default="on")
    parser.add_argument("--settings-json", default="{}", help="the `tokenize` config as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        tokenize_file(args.generated, args.model, args.out, args.stats, args.thinking == "on",
                      json.loads(args.settings_json))
    except DegenerateShard:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
