"""Token ids and exact loss masks for generated conversations, and the data-quality checks.

The mask comes from token boundaries between rendered prefixes, never from regexes over text:
for an assistant turn, render the history with the generation prompt (what the engine saw), render
the history plus the turn, and supervise the tokens in between, up to and including the
end-of-turn token. Template scaffolding, system, user and tool tokens get 0.

Templates that drop earlier turns' reasoning (Qwen3, Qwen3.5/3.6) cannot supervise every turn
in one sequence: the rendering of turn 1 changes once turn 2 exists. Those conversations give one
row per assistant turn (history as the template renders it, the turn itself with its reasoning);
other templates give one row per conversation with every assistant turn supervised.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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


class TemplateMismatch(ValueError):
    pass


def render(tokenizer, messages: list[dict], generation_prompt: bool, thinking: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
    )


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
class Sequence:
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    text: str = ""  # what was tokenized, piece by piece

    def round_trip_ok(self, tokenizer) -> bool:
        return not round_trip_failures(tokenizer, [self])[0]


def _supervised_span(tokenizer, messages: list[dict], index: int, thinking: bool) -> tuple[str, str]:
    """(prompt text, prompt + turn text up to and including the end-of-turn token)."""
    prompt = render(tokenizer, messages[:index], True, thinking)
    full = render(tokenizer, messages[: index + 1], False, thinking)
    if not full.startswith(prompt):
        raise TemplateMismatch(f"rendering up to turn {index} does not extend its prompt")
    eos = tokenizer.eos_token
    end = full.find(eos, len(prompt))
    if end < 0:
        raise TemplateMismatch(f"turn {index} has no end-of-turn token {eos!r}")
    return prompt, full[: end + len(eos)]


Pieces = list[tuple[str, int]]  # (text, supervised) in order


def conversation_pieces(
    tokenizer, messages: list[dict], thinking: bool, per_turn: bool
) -> list[tuple[int, Pieces]]:
    """(assistant message index or -1, text pieces with their mask value) for one conversation.
    Rendering only: tokenizing is batched over many rows by ``tokenize_pieces``."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if per_turn and len(assistant) > 1:
        return [(i, _single_turn(tokenizer, messages, i, thinking)) for i in assistant]
    if len(assistant) == 1:
        return [(-1, _single_turn(tokenizer, messages, assistant[0], thinking))]
    full = render(tokenizer, messages, False, thinking)
    pieces: Pieces = []
    pos = 0
    for i in assistant:
        prompt, turn = _supervised_span(tokenizer, messages, i, thinking)
        if not full.startswith(turn):
            raise TemplateMismatch(f"turn {i} renders differently inside the whole conversation")
        pieces += [(prompt[pos:], 0), (turn[len(prompt) :], 1)]
        pos = len(turn)
    pieces.append((full[pos:], 0))
    return [(-1, [p for p in pieces if p[0]])]


def _single_turn(tokenizer, messages: list[dict], index: int, thinking: bool) -> Pieces:
    prompt, turn = _supervised_span(tokenizer, messages, index, thinking)
    return [(prompt, 0), (turn[len(prompt) :], 1)]


def tokenize_pieces(tokenizer, all_pieces: list[Pieces]) -> list[Sequence]:
    """Sequences for many piece lists with one batched tokenizer call."""
    flat = [text for pieces in all_pieces for text, _ in pieces]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    out, k = [], 0
    for pieces in all_pieces:
        seq = Sequence()
        for text, mask in pieces:
            seq.input_ids.extend(encoded[k])
            seq.loss_mask.extend([mask] * len(encoded[k]))
            seq.text += text
            k += 1
        out.append(seq)
    return out


def round_trip_failures(tokenizer, seqs: list[Sequence]) -> list[bool]:
    """For each sequence: do the pieces tokenized apart differ from the whole text tokenized at
    once? (A BPE merge across a boundary would shift the mask by a token.)"""
    whole = tokenizer([s.text for s in seqs], add_special_tokens=False)["input_ids"] if seqs else []
    return [w != s.input_ids for w, s in zip(whole, seqs)]


def conversation_sequences(
    tokenizer, messages: list[dict], thinking: bool, per_turn: bool
) -> list[tuple[int, Sequence]]:
    """(assistant message index or -1, sequence) pairs for one conversation."""
    found = conversation_pieces(tokenizer, messages, thinking, per_turn)
    seqs = tokenize_pieces(tokenizer, [pieces for _, pieces in found])
    return [(index, seq) for (index, _), seq in zip(found, seqs)]


def repetition_loop(ids: list[int], n: int = 8, min_repeats: int = 12, min_cover: float = 0.5) -> bool:
    """The most frequent n-gram repeats often and covers most of the tokens."""
    if len(ids) < n * min_repeats:
        return False
    counts = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    _, top = counts.most_common(1)[0]
    return top >= min_repeats and top * n >= min_cover * len(ids)


def response_key(message: dict) -> str:
    return f"{(message.get('reasoning_content') or '').strip()}\x00{message.get('content', '').strip()}"
