"""Argument types shared by the stage CLIs (``python -m dflash_pipeline.stages.<name>``).

Each is a ``type=`` for ``argparse``: it returns the value (converted where it says so) or raises
``ArgumentTypeError``, which argparse reports in one line, ``PROG: error: argument --NAME: REASON``
(after its usage), with exit code 2 and no traceback. The checks run while the arguments are
parsed, so bad input is refused before any model, tokenizer or engine is touched: a missing model
folder never reaches transformers (whose "Repo id must be in the form ..." names neither the
argument nor the folder).

Paths are checked on the local file system; ``or_s3`` lets an argument that also takes an
``s3://`` URL pass such a URL through unchecked (the storage layer reports it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from typing import NoReturn
from pathlib import Path

# A Hugging Face hub id ("Org/name"): what a missing model folder often turns out to be.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(value: str) -> bool:
    """``org/name`` as a model hub names it (a missing local folder that may be meant as one)."""
    return bool(_HUB_ID.match(value))


def shown(value: str, limit: int = 100) -> str:
    """The value as the error quotes it: repr (one line, whatever it holds), cut to ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 4]}...{text[-1]}"


def _fail(message: str) -> NoReturn:
    raise argparse.ArgumentTypeError(message)


def existing_file(value: str) -> str:
    """A local file that exists (not a folder)."""
    path = Path(value)
    if path.is_file():
        return value
    if path.is_dir():
        _fail(f"{shown(value)} is a folder, not a file")
    if path.exists():
        _fail(f"{shown(value)} is not a regular file")
    _fail(f"no such file: {shown(value)}")


def existing_dir(value: str) -> str:
    """A local folder that exists."""
    path = Path(value)
    if path.is_dir():
        return value
    if path.exists():
        _fail(f"{shown(value)} is a file, not a folder")
    hint = ""
    if looks_like_hub_id(value):
        hint = " (it looks like a hub id: the stages read a local folder; download it first)"
    _fail(f"no such folder: {shown(value)}{hint}")


def model_dir(value: str) -> str:
    """A local Hugging Face format folder (a target, or an exported drafter): it holds config.json."""
    existing_dir(value)
    if not (Path(value) / "config.json").is_file():
        _fail(f"{shown(value)} is not a model folder (no config.json in it)")
    return value


def or_s3(check: Callable[[str], str]) -> Callable[[str], str]:
    """``check`` for a local path; an ``s3://`` URL passes through as it is."""

    def local_or_s3(value: str) -> str:
        return value if value.startswith("s3://") else check(value)

    local_or_s3.__name__ = f"{check.__name__}_or_s3"
    return local_or_s3


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer ``low`` or more (and ``high`` or less)."""
    wanted = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def check(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            _fail(f"{shown(value)} is not an integer")
        if number < low or (high is not None and number > high):
            _fail(f"{shown(value)} is out of range: must be {wanted}")
        return number

    check.__name__ = "int"
    return check


def float_range(low: float, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number ``low`` or more (more than ``low`` with ``low_open``), ``high`` or less."""
    above = f"> {low:g}" if low_open else f">= {low:g}"
    wanted = f"a number {above}" + ("" if high is None else f" and <= {high:g}")

    def check(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            _fail(f"{shown(value)} is not a number")
        if not math.isfinite(number):
            _fail(f"{shown(value)} is not a finite number")
        if number < low or (low_open and number == low) or (high is not None and number > high):
            _fail(f"{shown(value)} is out of range: must be {wanted}")
        return number

    check.__name__ = "float"
    return check


positive_int = int_range(1)
non_negative_int = int_range(0)
port = int_range(1, 65535)
non_negative_float = float_range(0.0)
positive_float = float_range(0.0, low_open=True)
probability = float_range(0.0, 1.0)  # a fraction or probability, 0 and 1 included


def shard_name(value: str) -> str:
    """A shard name such as ``00003`` (digits only), kept as it is written."""
    if not (value.isascii() and value.isdigit()):
        _fail(f"{shown(value)} is not a shard number such as 00003")
    return value


def _parse_object(text: str, what: str) -> dict:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        _fail(f"{what} is not valid JSON: {err}")
    if not isinstance(document, dict):
        _fail(f"{what} must be a JSON object ({{...}}), not {type(document).__name__}")
    return document


def json_object(value: str) -> dict:
    """A JSON object given inline (a config section); returns it parsed."""
    return _parse_object(value, shown(value))


def _read_json_object(value: str) -> dict:
    existing_file(value)
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        _fail(f"{shown(value)} cannot be read: {err}")
    return _parse_object(text, shown(value))


def json_file(value: str) -> str:
    """A local file holding one JSON object; returns the path (the stage reads it)."""
    _read_json_object(value)
    return value


def shard_of(expected: str, reader: str) -> Callable[[str], str]:
    """A local parquet shard written by stage ``expected`` (told by its columns,
    ``dflash_pipeline.data.shard_kinds``): another stage's shard is refused naming both."""
    from dflash_pipeline.data.shard_kinds import ShardKindError, require_file_kind

    def check(value: str) -> str:
        existing_file(value)
        try:
            require_file_kind(value, expected, reader)
        except ShardKindError as err:
            _fail(str(err))
        return value

    check.__name__ = f"{expected}_shard"
    return check


def shard_lists(required: str, checks: dict[str, Callable[[str], str]]) -> Callable[[str], str]:
    """A local JSON file of shard lists, ``{NAME: {SHARD: PATH}}`` for each NAME of ``checks``
    (each PATH checked by its function; ``required``'s list must name a shard); returns the path
    (the stage reads it). A job's lists go in a file: at 10,000 shards they are past argv's limit."""

    def check(value: str) -> str:
        listed = _read_json_object(value)  # read once: at 10,000 shards the file is large
        where = shown(value)
        unknown = sorted(set(listed) - set(checks))
        if unknown:
            _fail(f"{where}: unknown key {shown(unknown[0])} (the lists are {', '.join(checks)})")
        for name, path_check in checks.items():
            shards = listed.get(name, {})
            if not isinstance(shards, dict) or not all(isinstance(p, str) and p for p in shards.values()):
                _fail(f"{where}: {name} must be an object {{SHARD: PATH}}, got {shown(json.dumps(shards))}")
            for shard, path in shards.items():
                try:
                    path_check(path)
                except argparse.ArgumentTypeError as err:
                    _fail(f"{where}: {name} shard {shard}: {err}")
        if not listed.get(required):
            _fail(f"{where}: no {required} shards")
        return value

    check.__name__ = "shard_lists"
    return check
