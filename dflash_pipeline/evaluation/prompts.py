"""Evaluation prompts: a JSONL file of OpenAI ``messages`` rows (ShareGPT ``conversations`` too).

Rows are validated by the same rules as the prepare stage; a bad row stops the evaluation with the
file, the row number and the reason (an evaluation silently missing prompts would report a tau for
another set than the one asked for). Trailing assistant turns are dropped: the target answers the
last user (or tool) turn itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.data.prompts import BadRow, parse_row, prompt_hash

DEFAULT_PROMPT_SET = "default"


class PromptFileError(ValueError):
    pass


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    prompt_set: str
    messages: list[dict]  # OpenAI messages ending with the turn the target answers


def read_eval_prompts(path: str | Path, limit: int | None = None) -> list[EvalPrompt]:
    """Rows of ``path``; a row's ``prompt_set`` field groups it (default: "default")."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompts file {path} does not exist")
    prompts: list[EvalPrompt] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptFileError(
                    f"{path} row {number}: malformed JSON ({err.msg} at column {err.colno})"
                ) from None
            parsed = parse_row(row, str(path), number)
            if isinstance(parsed, BadRow):
                raise PromptFileError(parsed.describe())
            messages = [{"role": role, "content": content} for role, content in parsed.messages]
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
            prompt_id = parsed.source_id or prompt_hash(parsed.prompt_turns)
            if prompt_id in seen:
                raise PromptFileError(
                    f"{path} row {number}: id {prompt_id!r} repeats row {seen[prompt_id]}; "
                    "evaluation ids must be unique"
                )
            seen[prompt_id] = number
            prompt_set = row.get("prompt_set") or DEFAULT_PROMPT_SET
            if not isinstance(prompt_set, str):
                raise PromptFileError(f"{path} row {number}: prompt_set must be a string")
            prompts.append(EvalPrompt(prompt_id, prompt_set, messages))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise PromptFileError(f"prompts file {path} has no rows")
    return prompts
