"""A generated shard becomes a tokenized one: every row's sequences with exact loss masks
(``dflash_pipeline.data.loss_masks``), in chunks of rows (one batched chat-template call and one batched
tokenizer call each) spread over forked worker processes, then judged by the quality gate
(``dflash_pipeline.data.quality``)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.data.loss_masks import (
    MaskedSequence,
    Pieces,
    conversation_pieces_many,
    encode_pieces,
    literal_backend,
    needs_rows_per_turn,
    plain_backend,
    special_token_ids,
    special_token_texts,
)
from dflash_pipeline.data.chat import THINK_END, THINK_START
from dflash_pipeline.data.quality import DEFAULT_GATE, gate_shard, row_checks
from dflash_pipeline.data.repetition import sequences_repetition

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
DEFAULTS = {"max_length": schema_defaults("tokenize")["max_length"], **DEFAULT_GATE}

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
        meta.append(
            [
                (s.turn, len(s.input_ids), s.truncated, s.supervised, s.round_trip_ok, s.fell_back, s.repetition)
                for s in item
            ]
        )
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
            seqs.append(
                TokenizedSequence(
                    turn,
                    ids[pos : pos + n],
                    masks[pos : pos + n],
                    truncated,
                    supervised,
                    round_trip_ok,
                    fell_back,
                    repetition,
                )
            )
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


def engine_turns(row: dict, found: list[tuple[int, Pieces]]) -> list[list[dict | None]]:
    """For each sequence of a row (its ``conversation_pieces_many`` item): the turn of each
    supervised piece, in order, whose engine returned its token ids, which take the place of the
    piece's text; None where the text is tokenized (``transformers serve`` returns no ids). A
    sequence of index -1 supervises every assistant turn of the row in order (its only one, or
    all of a whole conversation's); a per-turn sequence, the turn of its index."""
    with_ids = {turn["message_index"]: turn for turn in row["turns"] if turn.get("output_ids")}
    assistant = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
    out = []
    for index, pieces in found:
        indices = assistant if index == -1 else [index]
        supervised = sum(1 for _, mask in pieces if mask)
        # Every assistant turn has its piece (masks._pieces); were one missing, which ids
        # belong where could not be told, and the text is tokenized instead.
        out.append([with_ids.get(i) for i in indices] if supervised == len(indices) else [None] * supervised)
    return out


def text_checks(row: dict, special_texts: tuple[str, ...]) -> list[str]:
    """``row_checks`` with special-token literals looked for only in the generated text of turns
    tokenized from their text: a turn whose engine ids are used is those ids, however its text
    reads. (Earlier turns' text in a per-turn row's history is tokenized as the engine's prompt
    was, so a literal there is what the engine was given.)"""
    text_turns = [turn for turn in row["turns"] if not turn.get("output_ids")]
    if len(text_turns) == len(row["turns"]):
        return row_checks(row, special_texts)
    reasons = row_checks(row)
    if text_turns and "generation_error" not in reasons:
        reasons = sorted(set(reasons) | set(row_checks({**row, "turns": text_turns}, special_texts)))
    return reasons


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


def _turn_ids(turn: dict, end_of_turn: int) -> list[int]:
    """A turn's engine ids as supervised: the end-of-turn id is added to a turn that stopped
    without it; a turn cut at the token limit keeps exactly its ids."""
    ids = list(turn["output_ids"])
    if turn["finish_reason"] == "stop" and ids[-1] != end_of_turn:
        ids.append(end_of_turn)
    return ids


def _engine_sequences(tokenizer, requests: list[tuple[Pieces, list[dict | None]]]) -> list[tuple[MaskedSequence, bool]]:
    """(ids and loss mask, round trip ok) for each (pieces, turns of its supervised pieces as
    ``engine_turns`` gives them) with at least one turn whose engine returned its ids: those ids
    (``_turn_ids``) in place of the turn's text, every other piece tokenized apart, all of them
    in one batched call. A per-turn sequence is the rendered prompt's ids + the turn's; a whole
    conversation's, the text between turns (from a turn's end-of-turn token on, which its piece
    holds, to the next turn's generation prompt) tokenized apart around the turns' ids.

    The round trip asks whether the ids are the tokenizer's own split of their text. When they
    are exactly the tokens of the rendered conversation, they decode to that text and the answer
    is yes without decoding; only the others are decoded and checked on their decoded text:
    each run of ids between special-token ids that holds engine ids or crosses from one piece to
    the next must be the tokenizer's split of its text with special-token literals read as plain
    text (a run inside one piece tokenized apart is that split already). Special tokens are where
    the tokenizer splits a text first, so for text without such literals this is the whole
    text's tokenization; a literal ``<|im_end|>`` the model spelled in ordinary tokens stays
    those tokens."""
    if not requests:
        return []
    backend = plain_backend(tokenizer)
    eos = tokenizer.eos_token_id
    texts, plans = [], []  # the pieces tokenized as text, of all sequences; (text index or ids, mask) per piece
    for pieces, turns in requests:
        supervised = iter(turns)
        plan = []
        for text, mask in pieces:
            turn = next(supervised) if mask else None
            if turn is None:
                plan.append((len(texts), mask))
                texts.append(text)
            else:
                plan.append((_turn_ids(turn, eos), 1))
        plans.append(plan)
    rendered = ["".join(text for text, _ in pieces) for pieces, _ in requests]
    apart = backend.encode_batch_fast(texts, add_special_tokens=False) if texts else []
    wholes = backend.encode_batch_fast(rendered, add_special_tokens=False)
    special = special_token_ids(tokenizer)
    seqs, runs, run_owner = [], [], []
    for plan, text, whole in zip(plans, rendered, wholes):
        parts = [(apart[part].ids, mask, False) if isinstance(part, int) else (part, mask, True) for part, mask in plan]
        seq = MaskedSequence(text=text)
        for ids, mask, _ in parts:
            seq.input_ids += ids
            seq.loss_mask += [mask] * len(ids)
        if whole.ids != seq.input_ids:
            for run in _runs_to_check(parts, special):
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


def _runs_to_check(parts: list[tuple[list[int], int, bool]], special: frozenset[int]) -> list[list[int]]:
    """The runs of ids between special-token ids (which are dropped) over a sequence's pieces
    (ids, mask, from the engine) that hold engine ids or cross from one piece to the next."""
    runs, run, checked = [], [], False
    for ids, _, from_engine in parts:
        for k, i in enumerate(ids):
            if i in special:
                if checked:
                    runs.append(run)
                run, checked = [], False
                continue
            checked = checked or from_engine or (k == 0 and bool(run))
            run.append(i)
    if checked:
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
    repetition: dict | None  # the looping span's measurement (repetition.sequences_repetition), or None


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
        tokenization batched over the rows. A sequence with a turn whose engine returned its ids
        takes those ids for that turn (``_engine_sequences``); the others are tokenized from
        their text (``encode_pieces``)."""
        found = conversation_pieces_many(
            self.tokenizer, [_messages(r) for r in rows], self.thinking, self.per_turn, [cut_fields(r) for r in rows]
        )
        turns_of = [None if isinstance(item, str) else engine_turns(row, item) for row, item in zip(rows, found)]
        text_pieces, engine_requests = [], []
        for item, turns in zip(found, turns_of):
            if isinstance(item, str):
                continue
            for (_, pieces), seq_turns in zip(item, turns):
                if any(seq_turns):
                    engine_requests.append((pieces, seq_turns))
                else:
                    text_pieces.append(pieces)
        encoded = iter(encode_pieces(self.tokenizer, text_pieces))
        engine = iter(_engine_sequences(self.tokenizer, engine_requests))
        out: list[list[TokenizedSequence] | str] = []
        for item, turns in zip(found, turns_of):
            if isinstance(item, str):
                out.append(item)
                continue
            seqs = []
            for (turn, _), seq_turns in zip(item, turns):
                if any(seq_turns):
                    seq, round_trip_ok = next(engine)
                    ids, mask = np.array(seq.input_ids, np.int32), np.array(seq.loss_mask, np.int8)
                    seqs.append(self._checked(turn, ids, mask, round_trip_ok, False))
                else:
                    e = next(encoded)
                    seqs.append(self._checked(turn, e.input_ids, e.loss_mask, e.round_trip_ok, e.fell_back))
            out.append(seqs)
        seqs = [seq for item in out if not isinstance(item, str) for seq in item]
        found = sequences_repetition([(s.input_ids, s.loss_mask) for s in seqs], self.cfg, *self.think_ids)
        for seq, repetition in zip(seqs, found):
            seq.repetition = repetition
        return out

    def _checked(
        self, turn: int, ids: np.ndarray, mask: np.ndarray, round_trip_ok: bool, fell_back: bool
    ) -> TokenizedSequence:
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
        checks = {r["id"]: text_checks(r, self.special_texts) for r in rows}
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
