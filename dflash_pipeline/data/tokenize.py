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


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Sequence:
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    text: str = ""  # what was tokenized, piece by piece

    def round_trip_ok(self, tokenizer) -> bool:
        """The pieces tokenized apart give the same ids as the whole text tokenized at once
        (a BPE merge across a boundary would shift the mask by a token)."""
        return _ids(tokenizer, self.text) == self.input_ids


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


def conversation_sequences(tokenizer, messages: list[dict], thinking: bool, per_turn: bool) -> list[tuple[int, Sequence]]:
    """(assistant message index or -1, sequence) pairs for one conversation."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if per_turn and len(assistant) > 1:
        return [(i, _single_turn(tokenizer, messages, i, thinking)) for i in assistant]
    if len(assistant) == 1:
        return [(-1, _single_turn(tokenizer, messages, assistant[0], thinking))]
    full = render(tokenizer, messages, False, thinking)
    seq = Sequence()
    pos = 0
    for i in assistant:
        prompt, turn = _supervised_span(tokenizer, messages, i, thinking)
        if not full.startswith(turn):
            raise TemplateMismatch(f"turn {i} renders differently inside the whole conversation")
        _append(tokenizer, seq, prompt[pos:], 0)
        _append(tokenizer, seq, turn[len(prompt) :], 1)
        pos = len(turn)
    _append(tokenizer, seq, full[pos:], 0)
    return [(-1, seq)]


def _single_turn(tokenizer, messages: list[dict], index: int, thinking: bool) -> Sequence:
    prompt, turn = _supervised_span(tokenizer, messages, index, thinking)
    seq = Sequence()
    _append(tokenizer, seq, prompt, 0)
    _append(tokenizer, seq, turn[len(prompt) :], 1)
    return seq


def _append(tokenizer, seq: Sequence, text: str, mask: int) -> None:
    ids = _ids(tokenizer, text) if text else []
    seq.text += text
    seq.input_ids.extend(ids)
    seq.loss_mask.extend([mask] * len(ids))


def repetition_loop(ids: list[int], n: int = 8, min_repeats: int = 12, min_cover: float = 0.5) -> bool:
    """The most frequent n-gram repeats often and covers most of the tokens."""
    if len(ids) < n * min_repeats:
        return False
    counts = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    _, top = counts.most_common(1)[0]
    return top >= min_repeats and top * n >= min_cover * len(ids)


def response_key(message: dict) -> str:
    return f"{(message.get('reasoning_content') or '').strip()}\x00{message.get('content', '').strip()}"
