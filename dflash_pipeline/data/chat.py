"""Chat rendering with the target's own template, and splitting a response into reasoning and answer.

The pipeline renders every prompt itself, so the text the engine continues is exactly the text
training and serving will see.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def render(tokenizer, messages: list[dict], generation_prompt: bool, thinking: bool) -> str:
    return render_many(tokenizer, [messages], generation_prompt, thinking)[0]


def render_many(tokenizer, conversations: list[list[dict]], generation_prompt: bool, thinking: bool) -> list[str]:
    """One batched ``apply_chat_template`` call: the same rendering as one call per conversation
    without paying the call's set-up (template lookup, special-token map) each time."""
    if not conversations:
        return []
    return tokenizer.apply_chat_template(
        conversations, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
    )


def render_prompt(tokenizer, messages: list[dict], thinking: bool) -> str:
    """The prompt text for the next assistant turn after ``messages``."""
    return render(tokenizer, messages, True, thinking)


@dataclass(frozen=True)
class SplitResponse:
    reasoning: str | None  # None when the response has no think block
    content: str
    think_closed: bool


def split_reasoning(prompt_text: str, generated: str, end_of_turn: str | None = None) -> SplitResponse:
    """Separate ``<think>...</think>`` from the answer.

    Handles templates whose generation prompt already opens the think block (Qwen3.5/3.6 end the
    prompt with ``<think>\\n``) and responses cut at the token limit inside the think block.
    """
    text = generated
    if end_of_turn and text.endswith(end_of_turn):
        text = text[: -len(end_of_turn)]
    opened_in_prompt = prompt_text.rstrip().endswith(THINK_START)
    if not opened_in_prompt:
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            text = stripped[len(THINK_START) :]
        elif THINK_END not in text:
            return SplitResponse(None, text.strip(), think_closed=True)
        # else: a response that closes a think block it never opened; as the engines'
        # reasoning parsers do, everything before </think> is reasoning.
    reasoning, closed, answer = text.partition(THINK_END)
    if not closed:
        return SplitResponse(reasoning.strip("\n"), "", think_closed=False)
    return SplitResponse(reasoning.strip("\n"), answer.strip(), think_closed=True)


def assistant_message(split: SplitResponse) -> dict:
    message = {"role": "assistant", "content": split.content}
    if split.reasoning is not None:
        message["reasoning_content"] = split.reasoning
    return message
