"""A generated shard becomes a tokenized one: every row's sequences with exact loss masks
(``dflash_pipeline.data.masks``), in chunks of rows (one batched chat-template call and one batched
tokenizer call each) spread over forked worker processes, then judged by the quality gate
(``dflash_pipeline.data.quality``)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dflash_pipeline.data.masks import (
    MaskedSequence,
    conversation_pieces_many,
    encode_pieces,
    literal_backend,
    needs_rows_per_turn,
    plain_backend,
    special_token_ids,
    special_token_texts,
)
from dflash_pipeline.data.chat import THINK_END, THINK_START
from dflash_pipeline.data.quality import DEFAULT_GATE, gate_shard, row_checks, sequences_repetition

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
# Settings of the `tokenize` config section that shape sequences; the gate's are in DEFAULT_GATE.
DEFAULTS = {"max_length": 8192, **DEFAULT_GATE}

CHUNK = 256  # rows per batch at most: one rendering call, one tokenizer call, one worker task
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


def _messages(row: dict) -> list[dict]:
    out = []
    for m in row["messages"]:
        msg = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content") is not None:
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def engine_turn(row: dict) -> dict | None:
    """The turn of a row with one assistant turn whose engine returned its token ids (such a row
    takes the engine's ids after the rendered prompt), else None."""
    turns = row["turns"]
    single = len(turns) == 1 and sum(m["role"] == "assistant" for m in row["messages"]) == 1
    return turns[0] if single and turns[0].get("output_ids") else None


def cut_fields(row: dict) -> dict[int, str]:
    """For each turn of the row cut at the token limit: its message index and the field its
    generated text ends with (the reasoning when the think block never closed)."""
    out = {}
    for turn in row["turns"]:
        if turn["finish_reason"] == "length":
            message = row["messages"][turn["message_index"]]
            inside = not turn["think_closed"] and message.get("reasoning_content") is not None
            out[turn["message_index"]] = "reasoning_content" if inside else "content"
    return out


def _engine_sequences(tokenizer, requests: list[tuple[list[tuple[str, int]], dict]]) -> list[tuple[MaskedSequence, bool]]:
    """(prompt ids + the engine's own generated ids, round trip ok) for each (rendered pieces,
    turn) whose engine returned its ids; batched like the rest. The end-of-turn id is added
    to a turn that stopped without it; a turn cut at the token limit keeps exactly its ids.

    The round trip asks whether the ids are the tokenizer's own split of their text. When they
    are exactly the tokens of the rendered prompt + turn, they decode to that text and the answer
    is yes without decoding; only the others are decoded and checked on their decoded text:
    each run of ids between special-token ids, from the prompt's last special token on, must be
    the tokenizer's split of its text with special-token literals read as plain text. Special
    tokens are where the tokenizer splits a text first, so for text without such literals this
    is the whole text's tokenization; a literal ``<|im_end|>`` the model spelled in ordinary
    tokens stays those tokens."""
    if not requests:
        return []
    backend = plain_backend(tokenizer)
    rendered = ["".join(text for text, _ in pieces) for pieces, _ in requests]
    prompts = backend.encode_batch_fast([pieces[0][0] for pieces, _ in requests], add_special_tokens=False)
    wholes = backend.encode_batch_fast(rendered, add_special_tokens=False)
    special = special_token_ids(tokenizer)
    seqs, runs, run_owner = [], [], []
    for (pieces, turn), text, prompt, whole in zip(requests, rendered, prompts, wholes):
        out = list(turn["output_ids"])
        if turn["finish_reason"] == "stop" and out[-1] != tokenizer.eos_token_id:
            out.append(tokenizer.eos_token_id)
        ids = prompt.ids
        seq = MaskedSequence(ids + out, [0] * len(ids) + [1] * len(out), text)
        if whole.ids != seq.input_ids:
            start = len(ids)  # the prompt's ids up to its last special token are its own split
            while start and ids[start - 1] not in special:
                start -= 1
            for run in _runs_between(seq.input_ids[start:], special):
                runs.append(run)
                run_owner.append(len(seqs))
        seqs.append(seq)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        texts = [tokenizer.decode(run) for run in runs]
    else:
        # What ``tokenizer.decode`` returns without the clean-up, without its per-id type checks
        # (those took longer than decoding).
        texts = backend.decode_batch(runs, skip_special_tokens=False) if runs else []
    again = literal_backend(tokenizer).encode_batch_fast(texts, add_special_tokens=False) if texts else []
    failed = {k for k, run, split in zip(run_owner, runs, again) if split.ids != run}
    return [(seq, k not in failed) for k, seq in enumerate(seqs)]


def _runs_between(ids: list[int], special: frozenset[int]) -> list[list[int]]:
    """The runs of ids between special-token ids (which are dropped)."""
    runs, run = [], []
    for i in ids:
        if i in special:
            if run:
                runs.append(run)
            run = []
        else:
            run.append(i)
    if run:
        runs.append(run)
    return runs


def _single_token_id(tokenizer, token: str) -> int | None:
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(found) != token:
        return None
    return int(found)


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
    repetition: dict | None  # the looping span's measurement (quality.sequences_repetition), or None


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
        self.special_texts = special_token_texts(tokenizer)
        # The think markers' ids, where they are single tokens: the repetition check judges the
        # thinking and the answer apart.
        self.think_ids = tuple(_single_token_id(tokenizer, t) for t in (THINK_START, THINK_END))

    def encode_rows(self, rows: list[dict]) -> list[list[TokenizedSequence] | str]:
        """Every sequence of each row, or the row's TemplateMismatch text: renderings and
        tokenization batched over the rows. A row with one turn whose engine returned its ids
        takes those ids after the rendered prompt."""
        found = conversation_pieces_many(
            self.tokenizer, [_messages(r) for r in rows], self.thinking, self.per_turn, [cut_fields(r) for r in rows]
        )
        text_pieces, engine_requests = [], []
        for row, item in zip(rows, found):
            if isinstance(item, str):
                continue
            if engine_turn(row):
                engine_requests.append((item[0][1], engine_turn(row)))
            else:
                text_pieces += [pieces for _, pieces in item]
        encoded = iter(encode_pieces(self.tokenizer, text_pieces))
        engine = iter(_engine_sequences(self.tokenizer, engine_requests))
        out: list[list[TokenizedSequence] | str] = []
        for row, item in zip(rows, found):
            if isinstance(item, str):
                out.append(item)
                continue
            if engine_turn(row):
                seq, round_trip_ok = next(engine)
                ids, mask = np.array(seq.input_ids, np.int32), np.array(seq.loss_mask, np.int8)
                out.append([self._checked(item[0][0], ids, mask, round_trip_ok, False)])
            else:
                out.append([
                    self._checked(turn, e.input_ids, e.loss_mask, e.round_trip_ok, e.fell_back)
                    for (turn, _), e in zip(item, encoded)
                ])
        seqs = [seq for item in out if not isinstance(item, str) for seq in item]
        found = sequences_repetition([(s.input_ids, s.loss_mask) for s in seqs], self.cfg, *self.think_ids)
        for seq, repetition in zip(seqs, found):
            seq.repetition = repetition
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
            repetition=None,  # measured for the whole chunk at once, in encode_rows
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
        rows = table.to_pylist()
        # Special-token literals in generated text matter only where the text must be tokenized.
        checks = {r["id"]: row_checks(r, () if engine_turn(r) else self.special_texts) for r in rows}
        to_render = [r for r in rows if "generation_error" not in checks[r["id"]]]
        skipped = len(rows) - len(to_render)  # error rows: done without tokenizing
        report = (lambda done, tokens: on_progress(skipped + done, tokens)) if on_progress else None
        encoded = dict(zip((r["id"] for r in to_render), self.encode_all(to_render, report)))
        kept, summary = gate_shard(rows, checks, encoded, self.cfg, shard_name, self.per_turn)
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
