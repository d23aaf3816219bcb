"""Token ids and exact loss masks for generated conversations.

The mask comes from token boundaries between rendered prefixes, never from regexes over text:
for an assistant turn, render the history with the generation prompt (what the engine saw), render
the history plus the turn, and supervise the tokens in between, up to and including the
end-of-turn token. Template scaffolding, system, user and tool tokens get 0.

A turn the engine cut at the token limit (``finish_reason: length``) is supervised on exactly the
text it produced: the template closes such a turn anyway (``\n</think>\n\n`` and the end-of-turn
token for one cut mid-thought), so its span ends where its last generated text ends, found by
rendering the turn once more with a marker after that text (``CUT_MARKER``).

Templates that drop earlier turns' reasoning (Qwen3, Qwen3.5/3.6) cannot supervise every turn
in one sequence: the rendering of turn 1 changes once turn 2 exists. Those conversations give one
row per assistant turn (history as the template renders it, the turn itself with its reasoning);
other templates give one row per conversation with every assistant turn supervised.

For throughput (``encode_pieces``) each sequence's whole text is tokenized once and the piece
boundaries are placed on its tokens (by the prompt's own tokens, or by offsets); the unsupervised
pieces are also tokenized apart and must match, so the prompt ids are exactly what the engine was
given. A boundary that falls inside a token sends the sequence back to tokenizing every piece
apart, where the round-trip check flags it as a template mismatch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from dflash_pipeline.data.chat import render, render_many


class TemplateMismatch(ValueError):
    pass


# Appended to the last generated text of a length-cut turn to find where that text ends in the
# template's rendering; never tokenized.
CUT_MARKER = "\ue000dflash:cut\ue000"


def special_token_texts(tokenizer) -> tuple[str, ...]:
    """The literal texts the tokenizer reads as special tokens (longest first): its named and
    additional special tokens and every added token marked special.

    An engine never writes these as text of a turn: it stops at the end-of-turn token, and any
    other special token it generates is a single id that ``skip_special_tokens`` drops from the
    text or keeps as its literal. So where such a literal is found in generated text, the text
    alone cannot say which ids the model produced (that one special id, or ordinary pieces that
    spell it), and tokenizing it would give the special id; the end-of-turn literal would also end
    the turn early. Added tokens that are not special (Qwen3's ``<think>``, ``</think>``,
    ``<tool_call>``) do not count: they are ordinary single tokens of generated text, which
    tokenizing the text gives back as the same id."""
    found = set(tokenizer.all_special_tokens)
    found |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return tuple(sorted((t for t in found if t), key=lambda t: (-len(t), t)))


@functools.lru_cache(maxsize=4)
def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of ``special_token_texts``."""
    ids = tokenizer.convert_tokens_to_ids(list(special_token_texts(tokenizer)))
    return frozenset(i for i in ids if i is not None)


def needs_rows_per_turn(tokenizer, thinking: bool = True) -> bool:
    """True when an assistant turn renders differently once a later turn follows it (Qwen3-style
    templates drop earlier reasoning and empty think blocks): then every turn needs its own row."""
    probe = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
    ]
    first = render(tokenizer, probe[:2], False, thinking)
    return not render(tokenizer, probe, False, thinking).startswith(first)


@dataclass
class MaskedSequence:
    """A sequence's token ids, its loss mask and the text it was tokenized from."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    text: str = ""  # what was tokenized, piece by piece

    def round_trip_ok(self, tokenizer) -> bool:
        return not round_trip_failures(tokenizer, [self])[0]


def _supervised_span(prompt: str, full: str, index: int, eos: str, marked: str | None = None) -> tuple[str, str]:
    """(prompt text, prompt + turn text up to and including the end-of-turn token) from the
    renderings of the history with the generation prompt and of the history plus the turn.

    The turn ends at the rendering's last end-of-turn token: the literal text of that token
    inside the turn's own text must not end it early. For a turn cut at the token limit
    ``marked`` is the rendering with ``CUT_MARKER`` after its last generated text, and the turn
    ends there instead, without the closing tokens the template adds."""
    if not full.startswith(prompt):
        raise TemplateMismatch(f"rendering up to turn {index} does not extend its prompt")
    if marked is not None:
        cut = marked.find(CUT_MARKER, len(prompt)) if marked.startswith(prompt) else -1
        if cut < 0 or not full.startswith(marked[:cut]):
            raise TemplateMismatch(f"turn {index} (cut at the token limit): the rendering does not end with its text")
        return prompt, marked[:cut]
    end = full.rfind(eos, len(prompt))
    if end < 0:
        raise TemplateMismatch(f"turn {index} has no end-of-turn token {eos!r}")
    return prompt, full[: end + len(eos)]


def _marked(message: dict, field: str) -> dict:
    marked = dict(message)
    marked[field] = (marked.get(field) or "") + CUT_MARKER
    return marked


Pieces = list[tuple[str, int]]  # (text, supervised) in order


def conversation_pieces(
    tokenizer, messages: list[dict], thinking: bool, per_turn: bool, cut: dict[int, str] | None = None
) -> list[tuple[int, Pieces]]:
    """(assistant message index or -1, text pieces with their mask value) for one conversation.
    Raises TemplateMismatch."""
    found = conversation_pieces_many(tokenizer, [messages], thinking, per_turn, None if cut is None else [cut])[0]
    if isinstance(found, str):
        raise TemplateMismatch(found)
    return found


def conversation_pieces_many(
    tokenizer,
    conversations: list[list[dict]],
    thinking: bool,
    per_turn: bool,
    cut: list[dict[int, str]] | None = None,
) -> list[list[tuple[int, Pieces]] | str]:
    """``conversation_pieces`` for many conversations, with all renderings in two batched calls;
    a conversation whose renderings do not extend each other gives the TemplateMismatch text.

    ``cut`` maps, per conversation, the index of each assistant turn cut at the token limit to
    the message field its generated text ends with (``reasoning_content`` for a turn cut inside
    its think block, else ``content``)."""
    prompts, fulls = [], []  # what to render, with and without the generation prompt
    plans = []
    for n, messages in enumerate(conversations):
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        whole = len(assistant) != 1 and not (per_turn and len(assistant) > 1)
        cut_fields = cut[n] if cut else {}
        spans = []
        for i in assistant:
            marked = None
            if i in cut_fields:
                marked = len(fulls) + 1
            spans.append((i, len(prompts), len(fulls), marked))
            prompts.append(messages[:i])
            fulls.append(messages[: i + 1])
            if marked is not None:
                fulls.append(messages[:i] + [_marked(messages[i], cut_fields[i])])
        plans.append((spans, len(fulls) if whole else None))
        if whole:
            fulls.append(messages)
    prompt_texts = render_many(tokenizer, prompts, True, thinking)
    full_texts = render_many(tokenizer, fulls, False, thinking)
    eos = tokenizer.eos_token
    out: list[list[tuple[int, Pieces]] | str] = []
    for spans, whole_at in plans:
        try:
            turns = [
                (i, _supervised_span(prompt_texts[p], full_texts[f], i, eos, None if m is None else full_texts[m]))
                for i, p, f, m in spans
            ]
            out.append(_pieces(turns, None if whole_at is None else full_texts[whole_at]))
        except TemplateMismatch as err:
            out.append(str(err))
    return out


def _pieces(turns: list[tuple[int, tuple[str, str]]], full: str | None) -> list[tuple[int, Pieces]]:
    """Rows of one conversation: one per turn (``full`` None; a single turn's row is the whole
    conversation, index -1), or one for the whole ``full`` rendering with every turn supervised.

    Every assistant turn keeps its supervised piece, even an empty one (a turn cut before it
    wrote anything): the k-th supervised piece is the k-th assistant turn, which is how the
    engine's ids of a turn find the piece they replace (``tokenized.engine_turns``)."""
    if full is None:
        single = len(turns) == 1
        return [(-1 if single else i, [(prompt, 0), (turn[len(prompt) :], 1)]) for i, (prompt, turn) in turns]
    pieces: Pieces = []
    pos = 0
    for i, (prompt, turn) in turns:
        if not full.startswith(turn):
            raise TemplateMismatch(f"turn {i} renders differently inside the whole conversation")
        pieces += [(prompt[pos:], 0), (turn[len(prompt) :], 1)]
        pos = len(turn)
    pieces.append((full[pos:], 0))
    return [(-1, [p for p in pieces if p[0] or p[1]])]


def tokenize_pieces(tokenizer, all_pieces: list[Pieces]) -> list[MaskedSequence]:
    """Sequences for many piece lists, each piece tokenized apart, with one batched call."""
    flat = [text for pieces in all_pieces for text, _ in pieces]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    out, k = [], 0
    for pieces in all_pieces:
        seq = MaskedSequence()
        for text, mask in pieces:
            seq.input_ids.extend(encoded[k])
            seq.loss_mask.extend([mask] * len(encoded[k]))
            seq.text += text
            k += 1
        out.append(seq)
    return out


@dataclass
class Encoded:
    """One sequence's ids and loss mask as arrays, and how they were checked."""

    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8
    round_trip_ok: bool  # the pieces tokenized apart give the whole text's tokens
    fell_back: bool = False  # the boundaries were not found on the whole text's tokens


def _token_starting_at(encoding, char: int, length: int, tokens: int) -> int | None:
    """Index of the token that starts exactly at character ``char`` of a text of ``length``
    characters and ``tokens`` tokens, or None when a token spans that character boundary."""
    if char == 0:
        return 0
    if char == length:
        return tokens
    token = encoding.char_to_token(char)
    if token is None or encoding.token_to_chars(token)[0] != char:
        return None
    if token > 0 and encoding.token_to_chars(token - 1)[1] > char:
        return None
    return token


@functools.lru_cache(maxsize=4)
def plain_backend(tokenizer):
    """A copy of the fast tokenizer's backend with padding and truncation off: what
    ``tokenizer(texts, add_special_tokens=False)`` runs, without touching the settings that a
    saved tokenizer may carry (padding to the longest, to the left) on the shared object."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    return backend


@functools.lru_cache(maxsize=4)
def literal_backend(tokenizer):
    """``plain_backend`` that reads the literal text of special tokens as plain text (what
    ``split_special_tokens=True`` does): how a model spells ``<|im_end|>`` in ordinary tokens.
    Added tokens that are not special are still read as themselves."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(plain_backend(tokenizer).to_str())
    backend.encode_special_tokens = True
    return backend


def encode_pieces(tokenizer, all_pieces: list[Pieces]) -> list[Encoded]:
    """Ids and loss masks for many piece lists, tokenizing each whole text once.

    Every unsupervised piece (template, system, user, tool and history text) tokenized apart must
    give exactly the whole text's tokens at its place, so the prompt ids are the ones the engine
    was given, and every piece boundary must start a token of the whole text; the supervised text
    takes the whole text's tokens between those boundaries. A prompt followed by one turn (the
    common row) needs no offsets: the prompt's own tokens, matched at the start, fix the boundary.
    Other rows place their boundaries by the whole text's offsets. Where a boundary falls inside
    a token, or an unsupervised piece differs, the sequence falls back to tokenizing every piece
    apart (``tokenize_pieces``) and its round trip is checked against the whole text, as
    ``round_trip_failures`` does.
    """
    out: list[Encoded | None] = [None] * len(all_pieces)
    prompt_and_turn, other = [], []
    for k, pieces in enumerate(all_pieces):
        simple = len(pieces) == 2 and not pieces[0][1] and pieces[1][1]
        (prompt_and_turn if simple else other).append(k)
    _encode_prompt_and_turn(tokenizer, all_pieces, prompt_and_turn, out)
    _encode_by_offsets(tokenizer, all_pieces, other, out)
    fallback = [k for k, e in enumerate(out) if e is None]
    if fallback:
        pieced = tokenize_pieces(tokenizer, [all_pieces[k] for k in fallback])
        for k, seq, failed in zip(fallback, pieced, round_trip_failures(tokenizer, pieced)):
            ids = np.array(seq.input_ids, dtype=np.int32)
            out[k] = Encoded(ids, np.array(seq.loss_mask, dtype=np.int8), not failed, fell_back=True)
    return out


def _encode_prompt_and_turn(tokenizer, all_pieces: list[Pieces], which: list[int], out: list) -> None:
    if not which:
        return
    backend = plain_backend(tokenizer)
    wholes = backend.encode_batch_fast(
        [all_pieces[k][0][0] + all_pieces[k][1][0] for k in which], add_special_tokens=False
    )
    prompts = backend.encode_batch_fast([all_pieces[k][0][0] for k in which], add_special_tokens=False)
    for k, whole, prompt in zip(which, wholes, prompts):
        ids, prompt_ids = whole.ids, prompt.ids
        if ids[: len(prompt_ids)] == prompt_ids:
            mask = np.ones(len(ids), dtype=np.int8)
            mask[: len(prompt_ids)] = 0
            out[k] = Encoded(np.array(ids, dtype=np.int32), mask, True)


def _encode_by_offsets(tokenizer, all_pieces: list[Pieces], which: list[int], out: list) -> None:
    if not which:
        return
    backend = plain_backend(tokenizer)
    texts = ["".join(text for text, _ in all_pieces[k]) for k in which]
    wholes = backend.encode_batch(texts, add_special_tokens=False)
    fixed_texts = [text for k in which for text, supervised in all_pieces[k] if not supervised]
    fixed = iter(backend.encode_batch_fast(fixed_texts, add_special_tokens=False) if fixed_texts else [])
    for k, text, whole in zip(which, texts, wholes):
        ids = whole.ids
        mask = np.zeros(len(ids), dtype=np.int8)
        ok = True
        char = start = 0
        for piece, supervised in all_pieces[k]:
            apart = None if supervised else next(fixed).ids  # consumed in order, checked or not
            if not ok:
                continue
            char += len(piece)
            end = _token_starting_at(whole, char, len(text), len(ids))
            if end is None or (apart is not None and apart != ids[start:end]):
                ok = False
                continue
            if supervised:
                mask[start:end] = 1
            start = end
        if ok:
            out[k] = Encoded(np.array(ids, dtype=np.int32), mask, True)


def round_trip_failures(tokenizer, seqs: list[MaskedSequence]) -> list[bool]:
    """For each sequence: do the pieces tokenized apart differ from the whole text tokenized at
    once? (A BPE merge across a boundary would shift the mask by a token.)"""
    if not seqs:
        return []
    whole = plain_backend(tokenizer).encode_batch_fast([s.text for s in seqs], add_special_tokens=False)
    return [w.ids != s.input_ids for w, s in zip(whole, seqs)]


def conversation_sequences(
    tokenizer, messages: list[dict], thinking: bool, per_turn: bool, cut: dict[int, str] | None = None
) -> list[tuple[int, MaskedSequence]]:
    """(assistant message index or -1, sequence) pairs for one conversation; ``cut`` as in
    ``conversation_pieces_many``."""
    found = conversation_pieces(tokenizer, messages, thinking, per_turn, cut)
    encoded = encode_pieces(tokenizer, [pieces for _, pieces in found])
    return [
        (index, MaskedSequence(e.input_ids.tolist(), e.loss_mask.tolist(), "".join(t for t, _ in pieces)))
        for (index, pieces), e in zip(found, encoded)
    ]
