"""Generate-stage rows of one user question and one generated answer, for the tokenize and
data-quality tests: ``generated_row`` builds any such row, ``healthy`` one the gate keeps."""

from __future__ import annotations


def generated_row(i, content, reasoning, finish="stop", closed=True, error=None, fingerprint="f"):
    """Row ``s{i}``: "What is i + i?" answered with ``content`` after the thinking ``reasoning``;
    ``finish`` and ``closed`` are the turn's finish reason and whether its think block closed."""
    return {
        "id": f"s{i}",
        "shard": 0,
        "split": "train",
        "messages": [
            {"role": "user", "content": f"What is {i} + {i}?", "reasoning_content": None},
            {"role": "assistant", "content": content, "reasoning_content": reasoning},
        ],
        "turns": [
            {
                "message_index": 1,
                "finish_reason": finish,
                "think_closed": closed,
                "prompt_tokens": 10,
                "completion_tokens": 10,
                "output_ids": None,
            }
        ],
        "prompt_tokens": 10,
        "completion_tokens": 10,
        "error": error,
        "fingerprint": fingerprint,
    }


def healthy(i):
    """A row with a short worked sum in its thinking and the answer after it."""
    steps = "\n".join(f"{d}+{d}={2 * d}, write {2 * d % 10}" for d in range(1, 4))
    return generated_row(i, f"{i} + {i} = {2 * i}", steps)
