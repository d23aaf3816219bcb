"""The demo's synthetic task: add or subtract two multi-digit numbers, reasoning column by column.

Each problem has a user question ("What is 347 + 58?"), a short reasoning trace (one line per
digit column, "7+8=15, write 5 carry 1") and a one-line answer ("347 + 58 = 405"). The
assistant's turn wraps the reasoning in a Qwen3-style think block, so a target trained on it
produces the same response shape as a real reasoning model: ``<think>\\n...\\n</think>\\n\\n``
then the answer, then the end-of-turn token. ``follows_format`` checks that shape.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# Chat markup. Every one of these is a single token of the demo tokenizer.
END_OF_TEXT = "<|endoftext|>"
TURN_START = "<|im_start|>"
END_OF_TURN = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
MASK = "<|mask|>"  # reserved for the DFlash drafter; never appears in any text
MARKUP = (END_OF_TEXT, TURN_START, END_OF_TURN, THINK_START, THINK_END, MASK)

MIN_DIGITS, MAX_DIGITS = 2, 4

_QUESTIONS = {
    "+": (
        "What is {a} + {b}?",
        "Compute {a} + {b}.",
        "Calculate {a} + {b}.",
        "What is {a} plus {b}?",
        "Add {a} and {b}.",
        "What is the sum of {a} and {b}?",
    ),
    "-": (
        "What is {a} - {b}?",
        "Compute {a} - {b}.",
        "Calculate {a} - {b}.",
        "What is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "What is the difference between {a} and {b}?",
    ),
}

# A closed think block, a blank line, then the answer; the end-of-turn token is handled apart.
_RESPONSE = re.compile(r"<think>\n(?P<reasoning>.*)\n</think>\n\n(?P<answer>.*)", re.DOTALL)


@dataclass(frozen=True)
class Problem:
    question: str
    reasoning: str
    answer: str


def sample_problem(rng: random.Random) -> Problem:
    """Draw one problem; subtraction keeps the larger number first so results stay non-negative."""
    op = rng.choice("+-")
    a, b = _number(rng), _number(rng)
    if op == "-" and a < b:
        a, b = b, a
    result = a + b if op == "+" else a - b
    steps = _addition_steps(a, b) if op == "+" else _subtraction_steps(a, b)
    return Problem(
        question=rng.choice(_QUESTIONS[op]).format(a=a, b=b),
        reasoning="\n".join(steps),
        answer=f"{a} {op} {b} = {result}",
    )


def prompt_messages(problem: Problem, system: str | None = None) -> list[dict[str, str]]:
    """The chat prompt for a problem: an optional system turn, then the user's question."""
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": problem.question}]


def assistant_text(problem: Problem, thinking: bool) -> str:
    """The assistant turn's text as the chat template renders it (without the end-of-turn token).

    With thinking off the think block is present but empty, as Qwen3 renders it.
    """
    reasoning = problem.reasoning if thinking else ""
    return f"{THINK_START}\n{reasoning}\n{THINK_END}\n\n{problem.answer}"


def follows_format(generated_text: str, *, require_end_of_turn: bool = False) -> bool:
    """True iff the text is a closed think block followed by a non-empty answer.

    The text may end with the end-of-turn token (``require_end_of_turn`` makes it mandatory);
    no other chat markup may appear inside the reasoning or the answer.
    """
    text = generated_text
    if text.endswith(END_OF_TURN):
        text = text[: -len(END_OF_TURN)]
    elif require_end_of_turn:
        return False
    match = _RESPONSE.fullmatch(text)
    if match is None or not match["answer"].strip():
        return False
    body = match["reasoning"] + match["answer"]
    return not any(tag in body for tag in MARKUP)


def _number(rng: random.Random) -> int:
    digits = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _columns(a: int, b: int) -> list[tuple[int, int]]:
    """Digit pairs from the ones column up; the shorter number is padded with zeros."""
    width = max(len(str(a)), len(str(b)))
    return [(a // 10**i % 10, b // 10**i % 10) for i in range(width)]


def _addition_steps(a: int, b: int) -> list[str]:
    steps, carry = [], 0
    for x, y in _columns(a, b):
        total = x + y + carry
        line = f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={total}, write {total % 10}"
        carry = total // 10
        steps.append(line + (" carry 1" if carry else ""))
    if carry:
        steps.append("write the carry 1")
    return steps


def _subtraction_steps(a: int, b: int) -> list[str]:
    steps, borrow = [], 0
    for x, y in _columns(a, b):
        left = f"{x}-1" if borrow else f"{x}"
        top = x - borrow
        if top >= y:
            steps.append(f"{left}-{y}={top - y}, write {top - y}")
            borrow = 0
        else:
            steps.append(f"{left}<{y}, borrow: {top + 10}-{y}={top + 10 - y}, write {top + 10 - y}")
            borrow = 1
    return steps
