"""Load and validate the workflow configuration against ``config/schema.yaml``.

The schema is the single documentation of every key and its default. Validation fills the
defaults in and, on a bad value, raises a ``ConfigError`` whose message names the key by its
dotted path (``dataset.max_bad_fraction``), so a user can fix the file without reading a trace.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


def load_schema(path: str | Path = SCHEMA_PATH) -> dict:
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _fill_defaults(instance: Any, schema: dict) -> None:
    """Set each missing property that has a ``default`` in the schema, recursively."""
    if not isinstance(instance, dict) or schema.get("type") != "object":
        return
    for name, sub in schema.get("properties", {}).items():
        if name not in instance and "default" in sub:
            instance[name] = copy.deepcopy(sub["default"])
        if name in instance:
            _fill_defaults(instance[name], sub)


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "additionalProperties":
        # The offending key is not in the path; it is named in the message.
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        parts.append(extra[0] if extra else "?")
    return ".".join(parts) or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    key = _key_path(error)
    if error.validator == "additionalProperties":
        known = ", ".join(sorted(error.schema.get("properties", {})))
        return f"config key '{key}' is not a known key (known here: {known})"
    return f"config key '{key}': {error.message}"


def validate_config(config: dict, schema: dict | None = None) -> dict:
    """Return a copy of ``config`` with defaults filled in; raise ConfigError if it is invalid."""
    schema = load_schema() if schema is None else schema
    config = copy.deepcopy(dict(config))
    _fill_defaults(config, schema)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    lines = [_describe(e) for e in errors] or _cross_key_problems(config)
    if lines:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    return config


def _cross_key_problems(config: dict) -> list[str]:
    """Rules that span keys, checked before any job starts rather than hours into a run."""
    train, evaluate = config.get("train") or {}, config.get("evaluate") or {}
    problems = []
    if train.get("algorithm") == "dflash2":
        if evaluate.get("engine", "transformers") != "transformers":
            problems.append(
                f"evaluate.engine: {evaluate['engine']} cannot serve a DFlash2 drafter "
                "(train.algorithm: dflash2); the pinned engine versions load DFlash only, use transformers"
            )
        if train.get("conv_kernel_size", 1) > train.get("block_size", 2):
            problems.append(
                f"train.conv_kernel_size: {train['conv_kernel_size']} is larger than "
                f"train.block_size {train['block_size']}"
            )
    return problems


def load_config(path: str | Path, overrides: dict | None = None) -> dict:
    """Read a YAML config file, apply ``overrides`` (top-level keys) and validate it."""
    with open(path, encoding="utf-8") as fh:
        config = yaml.safe_load(fh) or {}
    config.update(overrides or {})
    return validate_config(config)
