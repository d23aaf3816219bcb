"""Prompt rows: read a dataset file, validate each row, normalise it, give it a stable id.

A row becomes a ``Prompt`` (OpenAI-style ``messages`` of ``role``/``content``) or a ``BadRow``
that names the file, the 1-based row number and the reason. Nothing here decides shards or
writes files; ``dflash_pipeline.stages.prepare`` does that.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

# Reasons a row is quarantined. Keys are stable (they are counted in summaries).
BAD_REASONS = {
    "not_utf8": "not valid UTF-8",
    "malformed_json": "malformed JSON",
    "too_large": "row larger than dataset.max_row_bytes",
    "not_an_object": "row is not a JSON object",
    "no_conversation": "no `messages` or `conversations` field",
    "empty_conversation": "empty conversation",
    "bad_turn": "a turn is not an object with a role and string content",
    "unknown_role": "unknown role",
    "no_user_turn": "no user turn",
}


@dataclass(frozen=True)
class Prompt:
    messages: tuple[tuple[str, str], ...]  # (role, content) in order
    source_id: str | None
    source: str  # "<file>:<row>"

    @property
    def prompt_turns(self) -> list[tuple[str, str]]:
        """The turns that define the prompt: everything but assistant turns (regenerated)."""
        return [(role, content) for role, content in self.messages if role != "assistant"]


@dataclass(frozen=True)
class BadRow:
    file: str
    row: int
    reason: str  # a key of BAD_REASONS
    detail: str

    def describe(self) -> str:
        return f"{self.file} row {self.row}: {BAD_REASONS[self.reason]} ({self.detail})"

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "row": self.row,
            "reason": self.reason,
            "detail": self.detail,
        }


def prompt_hash(turns: list[tuple[str, str]]) -> str:
    """Stable hash of prompt turns: the id of rows without a usable source id, and the dedupe key."""
    canonical = json.dumps(turns, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:20]


def _turns(row: dict) -> tuple[list, str, str, str] | str:
    """(turn list, role field, content field, shape) or a reason key."""
    if isinstance(row.get("messages"), list):
        return row["messages"], "role", "content", "openai"
    if isinstance(row.get("conversations"), list):
        return row["conversations"], "from", "value", "sharegpt"
    if "messages" in row or "conversations" in row:
        return "bad_turn"
    return "no_conversation"


def parse_row(row, file: str, number: int, id_field: str = "id") -> Prompt | BadRow:
    """Validate one decoded row and normalise it to OpenAI messages."""

    def bad(reason: str, detail: str) -> BadRow:
        return BadRow(file, number, reason, detail)

    if not isinstance(row, dict):
        return bad("not_an_object", type(row).__name__)
    shape = _turns(row)
    if isinstance(shape, str):
        return bad(shape, f"fields: {sorted(row)[:8]}")
    turns, role_field, content_field, kind = shape
    if not turns:
        return bad("empty_conversation", f"{kind} conversation has no turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(content_field), str):
            return bad("bad_turn", f"turn {i}: expected an object with string `{content_field}`")
        raw_role = turn.get(role_field)
        role = SHAREGPT_ROLES.get(raw_role) if kind == "sharegpt" else raw_role
        if role not in ROLES:
            return bad("unknown_role", f"turn {i}: {role_field}={raw_role!r}")
        messages.append((role, turn[content_field]))
    if not any(role == "user" for role, _ in messages):
        return bad("no_user_turn", f"roles: {[r for r, _ in messages]}")
    source_id = row.get(id_field)
    source_id = None if source_id in (None, "") else str(source_id)
    return Prompt(tuple(messages), source_id, f"{file}:{number}")


def parse_json_line(
    line: bytes, file: str, number: int, max_row_bytes: int, id_field: str = "id"
) -> Prompt | BadRow:
    """Decode and validate one JSONL line (bytes, without its newline)."""
    if len(line) > max_row_bytes:
        return BadRow(file, number, "too_large", f"{len(line)} bytes > {max_row_bytes}")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadRow(file, number, "not_utf8", f"byte {err.start}")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return BadRow(file, number, "malformed_json", err.msg + f" at column {err.colno}")
    return parse_row(row, file, number, id_field)


def read_jsonl(
    path: Path, file: str, max_row_bytes: int, id_field: str = "id"
) -> Iterator[Prompt | BadRow]:
    """Rows of a JSONL file; blank lines are skipped but still counted in row numbers."""
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            line = line.rstrip(b"\r\n")
            if line.strip():
                yield parse_json_line(line, file, number, max_row_bytes, id_field)


def read_parquet(
    path: Path, file: str, max_row_bytes: int, id_field: str = "id", batch_rows: int = 4096
) -> Iterator[Prompt | BadRow]:
    """Rows of a parquet file, streamed in record batches."""
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        for row in batch.to_pylist():
            number += 1
            size = len(json.dumps(row, ensure_ascii=False, default=str).encode("utf-8"))
            if size > max_row_bytes:
                yield BadRow(file, number, "too_large", f"{size} bytes > {max_row_bytes}")
            else:
                yield parse_row(row, file, number, id_field)


def detect_format(name: str) -> str:
    lowered = name.lower()
    if lowered.endswith((".jsonl", ".json", ".jsonl.txt")):
        return "jsonl"
    if lowered.endswith((".parquet", ".pq")):
        return "parquet"
    raise ValueError(f"{name}: unknown dataset format (expected .jsonl or .parquet)")


def read_prompt_file(
    path: Path, file: str, max_row_bytes: int, id_field: str = "id"
) -> Iterator[Prompt | BadRow]:
    """Rows of one dataset file; ``file`` is the name used in messages (local path or URL)."""
    reader = read_jsonl if detect_format(file) == "jsonl" else read_parquet
    return reader(path, file, max_row_bytes, id_field)
