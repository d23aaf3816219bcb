"""Tokenize stage: exact token ids and loss masks per generated shard, and the data-quality gate.

The gate exists because of one incident: 87% of a 914K-sample dataset was an empty think block
and "OK.", and nobody noticed until days of hidden-state extraction were wasted. A shard whose
degenerate fraction is above ``tokenize.max_degenerate_fraction`` fails here, at its first shard,
with the fraction, the top reasons, example ids and the most common response.

Rows go through in chunks (one batched chat-template call and one batched tokenizer call each),
spread over forked worker processes; ``bench/tokenize_throughput.py`` measures the stage against
the bare batched tokenizer. Live telemetry goes under ``_progress/tokenize/shard-NNNNN/``.

Run by hand: ``python -m dflash_pipeline.stages.tokenize --help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_pipeline.data.tokenize import (
    DEGENERATE_REASONS,
    Sequence,
    conversation_pieces_many,
    encode_pieces,
    needs_rows_per_turn,
    plain_backend,
    repetition_loop,
    response_key,
    round_trip_failures,
)
from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.core.storage import open_storage, write_atomically

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


CHUNK = 256  # rows per batch at most: one rendering call, one tokenizer call, one worker task
TELEMETRY_EVERY_S = 10.0
_WORKER = None  # (ShardTokenizer, rows) a forked worker encodes from


def _encode_chunk(bounds: tuple[int, int]) -> tuple:
    tokenizer, rows = _WORKER
    return _pack(tokenizer.encode_rows(rows[bounds[0] : bounds[1]]))


def _pack(part: list) -> tuple:
    """A chunk's results as two arrays and small tuples: pickling one pair of arrays per sequence
    back from a worker cost more than tokenizing a short conversation."""
    meta, ids, masks = [], [], []
    for item in part:
        if isinstance(item, str):
            meta.append(item)
            continue
        meta.append([(s.turn, len(s.input_ids), s.truncated, s.supervised, s.round_trip_ok, s.fell_back, s.repetition)
                     for s in item])
        ids += [s.input_ids for s in item]
        masks += [s.loss_mask for s in item]
    return meta, np.concatenate(ids or [np.zeros(0, np.int32)]), np.concatenate(masks or [np.zeros(0, np.int8)])


def _unpack(packed: tuple) -> list:
    meta, ids, masks = packed
    out, pos = [], 0
    for item in meta:
        if isinstance(item, str):
            out.append(item)
            continue
        seqs = []
        for turn, n, truncated, supervised, round_trip_ok, fell_back, repetition in item:
            seqs.append(TokenizedSequence(turn, ids[pos : pos + n], masks[pos : pos + n], truncated, supervised,
                                   round_trip_ok, fell_back, repetition))
            pos += n
        out.append(seqs)
    return out


def _worker_init() -> None:
    # One worker per core: the tokenizer's own thread pool inside each worker would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


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


def _engine_sequences(tokenizer, requests: list[tuple[list[tuple[str, int]], dict]]) -> list[tuple[Sequence, bool]]:
    """(prompt ids + the engine's own generated ids, round trip ok) for each (rendered pieces,
    turn) whose engine returned its ids; batched like the rest.

    The round trip asks whether the ids are the tokenizer's own split of their text. When they
    are exactly the tokens of the rendered prompt + turn, they decode to that text and the answer
    is yes without decoding; only the others are decoded and checked on their decoded text."""
    if not requests:
        return []
    backend = plain_backend(tokenizer)
    rendered = ["".join(text for text, _ in pieces) for pieces, _ in requests]
    prompts = backend.encode_batch_fast([pieces[0][0] for pieces, _ in requests], add_special_tokens=False)
    wholes = backend.encode_batch_fast(rendered, add_special_tokens=False)
    seqs, generated, undecided = [], [], []
    for (pieces, turn), text, prompt, whole in zip(requests, rendered, prompts, wholes):
        out = list(turn["output_ids"])
        if turn["finish_reason"] == "stop" and out[-1] != tokenizer.eos_token_id:
            out.append(tokenizer.eos_token_id)
        ids = prompt.ids
        seq = Sequence(ids + out, [0] * len(ids) + [1] * len(out), text)
        if whole.ids != seq.input_ids:
            undecided.append(len(seqs))
        seqs.append(seq)
        generated.append(out)
    outs = [generated[k] for k in undecided]
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        texts = [tokenizer.decode(out) for out in outs]
    else:
        # What ``tokenizer.decode`` returns without the clean-up, without its per-id type checks
        # (those took longer than decoding).
        texts = backend.decode_batch(outs, skip_special_tokens=False)
    for k, text in zip(undecided, texts):
        seqs[k].text = requests[k][0][0][0] + text
    failed = dict(zip(undecided, round_trip_failures(tokenizer, [seqs[k] for k in undecided])))
    return [(seq, not failed.get(k, False)) for k, seq in enumerate(seqs)]


@dataclass
class TokenizedSequence:
    """One tokenized sequence of a row, truncated, with what the gate needs to know about it."""

    turn: int
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8
    truncated: bool
    supervised: int
    round_trip_ok: bool
    fell_back: bool
    repetition: bool


class ShardTokenizer:
    def __init__(
        self, tokenizer, thinking: bool, settings: dict | None = None, workers: int = 1, chunk_rows: int = CHUNK
    ):
        self.tokenizer = tokenizer
        self.workers = workers
        self.chunk_rows = chunk_rows
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

    def encode_rows(self, rows: list[dict]) -> list[list[TokenizedSequence] | str]:
        """Every sequence of each row, or the row's TemplateMismatch text: renderings and
        tokenization batched over the rows. A row with one turn whose engine returned its ids
        takes those ids after the rendered prompt."""
        found = conversation_pieces_many(self.tokenizer, [_messages(r) for r in rows], self.thinking, self.per_turn)
        text_pieces, engine_requests = [], []
        for row, item in zip(rows, found):
            if isinstance(item, str):
                continue
            if len(item) == 1 and len(row["turns"]) == 1 and row["turns"][0].get("output_ids"):
                engine_requests.append((item[0][1], row["turns"][0]))
            else:
                text_pieces += [pieces for _, pieces in item]
        encoded = iter(encode_pieces(self.tokenizer, text_pieces))
        engine = iter(_engine_sequences(self.tokenizer, engine_requests))
        out: list[list[TokenizedSequence] | str] = []
        for row, item in zip(rows, found):
            if isinstance(item, str):
                out.append(item)
                continue
            if len(item) == 1 and len(row["turns"]) == 1 and row["turns"][0].get("output_ids"):
                seq, round_trip_ok = next(engine)
                ids, mask = np.array(seq.input_ids, np.int32), np.array(seq.loss_mask, np.int8)
                out.append([self._checked(item[0][0], ids, mask, round_trip_ok, False)])
            else:
                out.append([
                    self._checked(turn, e.input_ids, e.loss_mask, e.round_trip_ok, e.fell_back)
                    for (turn, _), e in zip(item, encoded)
                ])
        return out

    def _checked(self, turn: int, ids: np.ndarray, mask: np.ndarray, round_trip_ok: bool, fell_back: bool) -> TokenizedSequence:
        cfg = self.cfg
        limit = cfg["max_length"]
        truncated = len(ids) > limit
        ids, mask = ids[:limit], mask[:limit]
        return TokenizedSequence(
            turn=turn,
            input_ids=ids,
            loss_mask=mask,
            truncated=truncated,
            supervised=int(mask.sum()),
            round_trip_ok=round_trip_ok,
            fell_back=fell_back,
            repetition=repetition_loop(ids[mask.astype(bool)], cfg["repetition_ngram"], cfg["repetition_min_repeats"]),
        )

    def encode_all(self, rows: list[dict], on_chunk=None) -> list[list[TokenizedSequence] | str]:
        """``encode_rows`` over chunks of rows, in worker processes when there are several;
        ``on_chunk(rows_done, tokens_done)`` after each chunk."""
        step = self.chunk_rows
        if self.workers > 1:
            # Several chunks per worker, or one long-response chunk leaves the other workers idle.
            step = max(1, min(step, -(-len(rows) // (4 * self.workers))))
        bounds = [(i, min(i + step, len(rows))) for i in range(0, len(rows), step)]
        out: list = []
        tokens = 0

        def add(part: list) -> None:
            nonlocal tokens
            out.extend(part)
            tokens += sum(len(seq.input_ids) for item in part if not isinstance(item, str) for seq in item)
            if on_chunk:
                on_chunk(len(out), tokens)

        if self.workers <= 1 or len(bounds) < 2:
            for lo, hi in bounds:
                add(self.encode_rows(rows[lo:hi]))
            return out
        global _WORKER
        _WORKER = (self, rows)  # inherited by the forked workers: no rows are pickled to them
        ctx = multiprocessing.get_context("fork")
        try:
            with ProcessPoolExecutor(min(self.workers, len(bounds)), mp_context=ctx, initializer=_worker_init) as pool:
                for packed in pool.map(_encode_chunk, bounds):
                    add(_unpack(packed))
        finally:
            _WORKER = None
        return out

    def run(self, table: pa.Table, shard_name: str = "shard", on_progress=None) -> tuple[pa.Table, dict]:
        """The shard's tokenized table and stats; ``on_progress(samples_done, tokens_done)`` as
        chunks finish. Raises DegenerateShard."""
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
        out: list[tuple[dict, TokenizedSequence]] = []
        supervised_counts = []
        stats = Counter()
        checks = {r["id"]: self.row_checks(r) for r in rows}
        to_render = [r for r in rows if "generation_error" not in checks[r["id"]]]
        skipped = len(rows) - len(to_render)  # error rows: done without tokenizing
        report = (lambda done, tokens: on_progress(skipped + done, tokens)) if on_progress else None
        encoded = dict(zip((r["id"] for r in to_render), self.encode_all(to_render, report)))
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
            "rows_per_turn": self.per_turn,
            "supervised_tokens_total": sum(seq.supervised for _, seq in kept),
            "tokens_total": sum(len(seq.input_ids) for _, seq in kept),
            "supervised_histogram": {
                "edges": HISTOGRAM_EDGES,
                "counts": _histogram(supervised_counts),
            },
            "most_common_response": {"text": common.replace("\x00", " | "), "count": common_n},
        }
        if fraction > cfg["max_degenerate_fraction"]:
            raise DegenerateShard(describe_failure(summary, cfg["max_degenerate_fraction"]))
        return tokenized_table(kept), summary


def tokenized_table(kept: list[tuple[dict, TokenizedSequence]]) -> pa.Table:
    """The output table, its list columns built from concatenated arrays rather than row by row."""
    lengths = np.fromiter((len(seq.input_ids) for _, seq in kept), dtype=np.int32, count=len(kept))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int32)]).astype(np.int32))

    def concat(name: str, dtype) -> np.ndarray:
        parts = [getattr(seq, name) for _, seq in kept]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

    columns = [
        pa.array([row["id"] for row, _ in kept], pa.string()),
        pa.array([row["split"] for row, _ in kept], pa.string()),
        pa.array([seq.turn for _, seq in kept], pa.int32()),
        pa.ListArray.from_arrays(offsets, pa.array(concat("input_ids", np.int32))),
        pa.ListArray.from_arrays(offsets, pa.array(concat("loss_mask", np.int8))),
        pa.array(lengths, pa.int32()),
        pa.array([seq.supervised for _, seq in kept], pa.int32()),
        pa.array([seq.truncated for _, seq in kept], pa.bool_()),
    ]
    return pa.Table.from_arrays(columns, schema=TOKENIZED_SCHEMA)


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


class TokenizeTelemetry:
    """Live state of one tokenize job for the status page, in the same shape as the generate
    stage's (``_progress/tokenize/shard-NNNNN/telemetry.json``), written at most every
    ``every_s`` seconds while running and once at the end."""

    def __init__(self, progress: ShardProgress | None, total: int, every_s: float = TELEMETRY_EVERY_S):
        self.progress = progress
        self.total = total
        self.every_s = every_s
        self.started = time.time()
        self.last_write = 0.0
        self.done = 0
        self.tokens = 0

    def record(self, state: str) -> dict:
        elapsed = max(time.time() - self.started, 1e-6)
        rate = self.done / elapsed
        return {
            "state": state,
            "samples_total": self.total,
            "samples_done": self.done,
            "tokens_per_s": round(self.tokens / elapsed, 2),
            "elapsed_s": round(elapsed, 1),
            "eta_s": round((self.total - self.done) / rate, 1) if rate > 0 else None,
        }

    def update(self, done: int, tokens: int) -> None:
        self.done, self.tokens = done, tokens
        if time.time() - self.last_write >= self.every_s:
            self.write("running")

    def write(self, state: str) -> None:
        if self.progress is not None:
            self.last_write = time.time()
            self.progress.write_telemetry(self.record(state))


def tokenize_file(
    generated: str,
    model: str,
    out: str,
    stats_out: str,
    thinking: bool,
    settings: dict,
    run_url: str | None = None,
    shard: int | None = None,
    workers: int | None = None,
) -> dict:
    """Tokenize one generated shard; with ``run_url`` and ``shard``, live telemetry goes under
    the run's ``_progress/tokenize/``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    table = pq.read_table(generated)
    name = generated.rsplit("/", 1)[-1]
    progress = ShardProgress(open_storage(run_url), "tokenize", shard) if run_url and shard is not None else None
    telemetry = TokenizeTelemetry(progress, table.num_rows)
    telemetry.write("running")
    try:
        shard_tokenizer = ShardTokenizer(tokenizer, thinking, settings, workers or os.cpu_count() or 1)
        result, summary = shard_tokenizer.run(table, name, telemetry.update)
    except BaseException as err:
        if isinstance(err, DegenerateShard):
            log.error("%s", err)
        telemetry.write("failed")
        raise
    with write_atomically(out) as tmp:
        pq.write_table(result, tmp)
    with write_atomically(stats_out) as tmp:
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
    telemetry.write("done")
    log.info(
        "%s: %d samples -> %d sequences, %d degenerate (%s), %d supervised tokens",
        name, summary["samples"], summary["sequences_out"], summary["degenerate_samples"],
        summary["reasons"], summary["supervised_tokens_total"],
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.stages.tokenize", description=__doc__)
    parser.add_argument("generated")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("--thinking", choices=["on", "off"], default="on")
    parser.add_argument("--settings-json", default="{}", help="the `tokenize` config as JSON")
    parser.add_argument("--run-url", default=None, help="run root (local folder or s3://) for live telemetry")
    parser.add_argument("--shard", type=int, default=None, help="shard number, for live telemetry")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: all cores)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        tokenize_file(args.generated, args.model, args.out, args.stats, args.thinking == "on",
                      json.loads(args.settings_json), args.run_url, args.shard, args.workers)
    except DegenerateShard:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
