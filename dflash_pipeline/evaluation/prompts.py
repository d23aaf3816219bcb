"""Evaluation prompts: JSONL rows of OpenAI ``messages`` (ShareGPT ``conversations`` too), or the
prepare stage's parquet of ingested prompts (``id``, ``split``, ``messages``, ``source``).

Rows are validated by the same rules as the prepare stage; a bad row stops the evaluation with the
file, the row number and the reason (an evaluation silently missing prompts would report a tau for
another set than the one asked for). Trailing assistant turns are dropped: the target answers the
last user (or tool) turn itself. A row's prompt set is its ``prompt_set`` field, else the dataset
file named in its ``source`` ("gsm8k.jsonl:12" -> "gsm8k"), else "default".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dflash_pipeline.core.storage import is_s3_url, open_object
from dflash_pipeline.data.prompts import BadRow, parse_row, prompt_hash

DEFAULT_PROMPT_SET = "default"


class PromptFileError(ValueError):
    pass


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    prompt_set: str
    messages: list[dict]  # OpenAI messages ending with the turn the target answers


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptFileError(
                    f"{path} row {number}: malformed JSON ({err.msg} at column {err.colno})"
                ) from None


def _parquet_rows(url: str) -> Iterator[tuple[int, object]]:
    """Rows of a parquet file or object, read by byte range one row group at a time (a reader
    that stops at its limit fetches only the row groups it read, not the whole object)."""
    import pyarrow.parquet as pq

    storage, key = open_object(url)
    with storage.open_ranged(key) as raw:
        number = 0
        for batch in pq.ParquetFile(raw).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                number += 1
                yield number, row


def _prompt_set(row: dict, path: Path, number: int) -> str:
    prompt_set = row.get("prompt_set")
    if prompt_set is None and isinstance(row.get("source"), str):
        prompt_set = PurePosixPath(row["source"].rsplit(":", 1)[0]).name.split(".")[0] or None
    prompt_set = prompt_set or DEFAULT_PROMPT_SET
    if not isinstance(prompt_set, str):
        raise PromptFileError(f"{path} row {number}: prompt_set must be a string")
    return prompt_set


def read_eval_prompts(path: str | Path, limit: int | None = None, split: str | None = None) -> list[EvalPrompt]:
    """The prompts of ``path`` (.jsonl or .parquet, or an s3:// parquet object such as the run's
    ingested prompts, read by byte range); with ``split``, only rows whose ``split`` field equals
    it (the prepare stage marks held-out prompts ``heldout``)."""
    url = str(path)
    path = Path(url) if not is_s3_url(url) else PurePosixPath(url)
    if is_s3_url(url):
        if path.suffix not in (".parquet", ".pq"):
            raise PromptFileError(f"prompts object {url}: only parquet is read from S3")
    elif not Path(url).is_file():
        raise PromptFileError(f"prompts file {path} does not exist")
    rows = _parquet_rows(url) if path.suffix in (".parquet", ".pq") else _jsonl_rows(path)
    prompts: list[EvalPrompt] = []
    seen: dict[str, int] = {}
    for number, row in rows:
        if split is not None and isinstance(row, dict):
            if "split" not in row:
                raise PromptFileError(f"{path} row {number}: no `split` field to select split {split!r} by")
            if row["split"] != split:
                continue
        parsed = parse_row(row, str(path), number)
        if isinstance(parsed, BadRow):
            raise PromptFileError(parsed.describe())
        messages = [{"role": role, "content": content} for role, content in parsed.messages]
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        prompt_id = parsed.source_id or prompt_hash(parsed.prompt_turns)
        if prompt_id in seen:
            raise PromptFileError(
                f"{path} row {number}: id {prompt_id!r} repeats row {seen[prompt_id]}; evaluation ids must be unique"
            )
        seen[prompt_id] = number
        prompts.append(EvalPrompt(prompt_id, _prompt_set(row, path, number), messages))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        selected = f" in split {split!r}" if split is not None else ""
        raise PromptFileError(f"prompts file {path} has no rows{selected}")
    return prompts
