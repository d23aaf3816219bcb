"""Load and validate the workflow configuration against ``dflash_pipeline/config/schema.yaml``.

The schema is the single documentation of every key and its default. Validation fills the
defaults in and, on a bad value, raises a ``ConfigError`` whose message names the key by its
dotted path (``dataset.max_bad_fraction``), so a user can fix the file without reading a trace.
"""

from __future__ import annotations

import copy
import functools
import math
import posixpath
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import yaml

# The checkout (the default working directory of the command-line stages: its config.yaml).
REPO = Path(__file__).resolve().parents[2]
# Package data (pyproject.toml), so an installed package validates configs without a checkout.
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "config" / "schema.yaml"


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


class ConfigFileError(ConfigError):
    """A config file that cannot be read: ``path`` as given and the ``reason``."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"config file {path} {reason}")
        self.path, self.reason = str(path), reason


# libyaml's parser where PyYAML has it: the same documents (the resolvers are PyYAML's own), at a
# tenth of the time of the pure-Python one.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.cache
def _parsed_schema(path: str) -> dict:
    # Parsed once per process: modules read their defaults from it at import (schema_defaults),
    # and every job, Snakemake's parse of the workflow and each command-line tool start by
    # importing several of them; parsed each time, the 60 KB file cost a job ~1.5 CPU seconds.
    with open(path, encoding="utf-8") as fh:
        return yaml.load(fh, Loader=_SAFE_LOADER)


def load_schema(path: str | Path = SCHEMA_PATH) -> dict:
    """The schema as a new dict: callers may change theirs (the cached parse stays as read)."""
    return copy.deepcopy(_parsed_schema(str(path)))


def _fill_defaults(instance: Any, schema: dict) -> None:
    """Set each missing property that has a ``default`` in the schema, recursively."""
    if not isinstance(instance, dict) or schema.get("type") != "object":
        return
    for name, sub in schema.get("properties", {}).items():
        if name not in instance and "default" in sub:
            instance[name] = copy.deepcopy(sub["default"])
        if name in instance:
            _fill_defaults(instance[name], sub)


def schema_defaults(section: str) -> dict:
    """The defaults of one config section as ``dflash_pipeline/config/schema.yaml`` gives them: the one source
    of the defaults a stage's command line and its option objects show."""
    config: dict = {section: {}}
    _fill_defaults(config, load_schema())
    return config[section]


# Numbers as YAML 1.2 writes them. PyYAML (YAML 1.1, what Snakemake reads config files with) takes
# an exponent only after a dot: `6e-4` and `1e12` are text to it, `6.0e-4` a number; and the nested
# values of a `--config key='{...}'` override are all text (Snakemake parses them with YAML's
# BaseLoader).
_INTEGER = re.compile(r"[-+]?[0-9]+")
_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_BOOLEAN = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_NULL = {"null", "Null", "NULL", "~"}


def _as_typed(value: str, types: list) -> Any:
    """``value`` as the number, boolean or null it spells for a key of schema ``types`` that
    takes no string; else unchanged (the validator then names the key)."""
    if "null" in types and value in _NULL:
        return None
    if "boolean" in types and value in _BOOLEAN:
        return _BOOLEAN[value]
    if ("integer" in types or "number" in types) and _INTEGER.fullmatch(value):
        return int(value)
    if "number" in types and _NUMBER.fullmatch(value):
        return float(value)
    return value


def _read_as_written(instance: Any, schema: dict) -> Any:
    """``instance`` with every text value whose key's schema takes a number, boolean or null
    (and no string) read as that: the config means what its author wrote, whether YAML 1.1 or a
    `--config` override turned it into text."""
    if not isinstance(schema, dict):
        return instance
    if isinstance(instance, str):
        types = schema.get("type")
        types = types if isinstance(types, list) else [types] if types else []
        return instance if "string" in types or not types else _as_typed(instance, types)
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        other = schema.get("additionalProperties")
        for key, value in instance.items():
            sub = properties.get(key, other if isinstance(other, dict) else None)
            if sub is not None:
                instance[key] = _read_as_written(value, sub)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        instance[:] = [_read_as_written(item, schema["items"]) for item in instance]
    return instance


def _key_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "additionalProperties":
        # The offending key is not in the path; it is named in the message.
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        parts.append(extra[0] if extra else "?")
    return ".".join(parts) or "(top level)"


# JSON Schema's "integer" takes any number with a zero fraction (2.0, 1e12 in JSON): the workflow
# would then call range(2.0) and fail with a trace. A config's counts must be written as integers.
_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool)
)
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_TYPES)


def _describe(error: jsonschema.ValidationError) -> str:
    key = _key_path(error)
    if error.validator == "additionalProperties":
        known = ", ".join(sorted(error.schema.get("properties", {})))
        return f"config key '{key}' is not a known key (known here: {known})"
    value = error.instance
    if error.validator == "type" and isinstance(value, float) and value.is_integer():
        # An integer written as a float: say what is wrong with the integer itself first (a
        # bound), else how to write it.
        whole = _Validator(error.schema).iter_errors(int(value))
        beyond = next((e for e in whole if e.validator != "type"), None)
        if beyond is not None and beyond.validator in _BOUNDS:
            return f"config key '{key}': {value!r} is outside its range {_range(beyond.schema)}"
        if beyond is not None:
            return f"config key '{key}': {value!r} {beyond.message.split(' ', 1)[1]}"
        return f"config key '{key}': {value!r} is not an integer (write {int(value)})"
    if error.validator in _BOUNDS:
        return f"config key '{key}': {value!r} is outside its range {_range(error.schema)}"
    return f"config key '{key}': {error.message}"


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _range(schema: dict) -> str:
    """A key's bounds as an interval: ``(0, 1]``, ``[1, inf)``."""
    low = schema.get("exclusiveMinimum", schema.get("minimum"))
    high = schema.get("exclusiveMaximum", schema.get("maximum"))
    return (
        ("(" if "exclusiveMinimum" in schema or low is None else "[")
        + ("-inf" if low is None else f"{low!r}")
        + ", "
        + ("inf" if high is None else f"{high!r}")
        + (")" if "exclusiveMaximum" in schema or high is None else "]")
    )


def _non_finite(instance: Any, path: tuple = ()) -> list[tuple[str, float]]:
    """(dotted key, value) of every NaN or infinity in the config: YAML's .nan and .inf pass
    every minimum and maximum (each comparison with NaN is false) and mean nothing as a setting."""
    if isinstance(instance, float) and not math.isfinite(instance):
        return [(".".join(path) or "(top level)", instance)]
    if isinstance(instance, dict):
        return [found for k, v in instance.items() for found in _non_finite(v, (*path, str(k)))]
    if isinstance(instance, list):
        return [found for i, v in enumerate(instance) for found in _non_finite(v, (*path, str(i)))]
    return []


def _results_dir_problem(config: dict) -> str | None:
    """A results_dir that leaves the working directory (absolute, or `..` above it): outputs
    of a run would land wherever the command happens to run from, and below an S3 prefix such
    a path makes keys outside the run's prefix. Allowed only when the config says so."""
    results_dir = config.get("results_dir")
    if not isinstance(results_dir, str) or config.get("results_dir_outside_workdir") is True:
        return None
    normal = posixpath.normpath(results_dir)
    if posixpath.isabs(normal):
        reason = "is an absolute path, outside the working directory"
    elif normal == ".." or normal.startswith("../"):
        reason = "leaves the working directory"
    else:
        return None
    return (
        f"config key 'results_dir': {results_dir!r} {reason}; use a relative folder inside it, "
        "or set results_dir_outside_workdir: true (local runs only)"
    )


def validate_config(config: dict, schema: dict | None = None) -> dict:
    """Return a copy of ``config`` with defaults filled in; raise ConfigError if it is invalid.
    One line per bad key: its dotted path, its value and the reason."""
    schema = load_schema() if schema is None else schema
    config = _read_as_written(copy.deepcopy(dict(config)), schema)
    _fill_defaults(config, schema)
    problems = {key: f"config key '{key}': {value!r} is not a finite number" for key, value in _non_finite(config)}
    errors = sorted(_Validator(schema).iter_errors(config), key=lambda e: list(e.absolute_path))
    for error in errors:
        problems.setdefault(_key_path(error), _describe(error))
    results_dir = _results_dir_problem(config)
    if results_dir and "results_dir" not in problems:
        problems["results_dir"] = results_dir
    lines = list(problems.values()) or _cross_key_problems(config)
    if lines:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    return config


def _cross_key_problems(config: dict) -> list[str]:
    """Rules that span keys, checked before any job starts rather than hours into a run."""
    train = config.get("train") or {}
    problems = []
    if train.get("algorithm") == "dflash2" and train.get("conv_kernel_size", 1) > train.get("block_size", 2):
        problems.append(
            f"train.conv_kernel_size: {train['conv_kernel_size']} is larger than train.block_size {train['block_size']}"
        )
    # Refused before generation, not hours later at the train job.
    order = target_layer_order_problem(train.get("target_layer_ids") or [])
    if order:
        problems.append(f"train.target_layer_ids: {order}")
    evaluate = config.get("evaluate") or {}
    quantized = quantized_engine_problem(
        evaluate.get("engine", "transformers"), evaluate.get("target_quantization"), "evaluate.engine"
    )
    if quantized:
        problems.append(f"evaluate.target_quantization: {quantized} (set engine: transformers)")
    return problems


def quantized_engine_problem(engine: str, quantization: str | None, engine_key: str) -> str | None:
    """Why ``quantization`` cannot be evaluated through ``engine`` (None: it can), ``engine_key``
    naming where the engine was chosen: a serving engine serves the checkpoint's own weights, so
    only the project's loop measures a quantized target. The config check and evaluate's command
    line both ask here."""
    if not quantization or engine == "transformers":
        return None
    return f"{quantization} applies to the project's loop only; {engine_key} {engine} would serve the checkpoint's own weights"


def target_layer_order_problem(ids: Sequence[int]) -> str | None:
    """Why ``ids`` cannot be a drafter's target layers, or None. The engines feed the drafter the
    tapped layers in ascending order whatever order its config lists: SGLang 0.5.17 measured on an
    H100 (reversing them left its tau unchanged and cut the loop's by 40%), vLLM by its capture
    returning layers in ascending id order (model/taps.py). A drafter trained on another order is
    served wrong. Checked by the run's config and by DrafterConfig (so by every export loaded)."""
    if list(ids) == sorted(set(ids)):
        return None
    return (
        f"{list(ids)} must be strictly ascending: the engines feed the drafter the tapped layers "
        "in ascending order whatever order the config lists"
    )


def layered_config(configfiles: Sequence[str | Path] | str | Path | None, workdir: Path = REPO) -> dict:
    """The raw config of `snakemake [--configfile A [B ...]]` run in ``workdir``, before validation.

    As the Snakefile and Snakemake 9 do it: without config files, ``workdir/config.yaml`` (the
    Snakefile's ``configfile:``, skipped whenever --configfile is given); with them, those files
    alone, each loaded by Snakemake's ``load_configfile`` (JSON or YAML) and applied in order by
    its ``update_config`` onto an empty dict (``snakemake.settings.types.ConfigSettings``): later
    files update earlier ones, nested mappings merged key by key, anything else replaced."""
    from snakemake.common.configfile import load_configfile
    from snakemake.utils import update_config
    from snakemake_interface_common.exceptions import WorkflowError

    if isinstance(configfiles, (str, Path)):
        configfiles = [configfiles]
    config: dict = {}
    for given in configfiles or ["config.yaml"]:
        # Relative to the working directory of the run, as Snakemake reads them; named as given
        # when that is where the command runs.
        path = Path(workdir) / given
        named = given if Path(workdir).resolve() == Path.cwd().resolve() else path
        if path.is_dir():
            raise ConfigFileError(named, "is a folder, not a file")
        if not path.is_file():
            raise ConfigFileError(named, "does not exist" if not path.exists() else "is not a regular file")
        try:
            update_config(config, load_configfile(path))
        except WorkflowError as err:
            raise ConfigFileError(named, f"cannot be read: {_unreadable_because(path, err)}") from None
    return config


def trains_from_engine_taps(train: dict) -> bool:
    """Whether training takes its taps from a taps server on the job's node (online training
    with ``train.taps_from: engine``); offline training reads extract's taps whatever it says."""
    return train.get("mode") == "online" and train.get("taps_from", "target") == "engine"


def _unreadable_because(path: Path, err: Exception) -> str:
    """Why Snakemake's reader refused a config file, in one line: the YAML parser's own reason
    (line and column) where it has one; Snakemake's message names neither."""
    try:
        yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as yaml_err:
        err = yaml_err
    return " ".join(str(err).split())


def load_run_config(configfiles: Sequence[str | Path] | str | Path | None, workdir: Path = REPO) -> dict:
    """The config a `snakemake [--configfile A [B ...]]` run in ``workdir`` sees: the layered
    files (``layered_config``) validated, the schema's defaults filled in (rules/common.smk);
    ConfigError names an invalid key."""
    return validate_config(layered_config(configfiles, workdir))


# The data-quality gate's settings (keys of the `tokenize` section): they decide which rows a
# tokenize shard keeps, so they define its output (data/quality.py reads them by these names).
TOKENIZE_GATE_KEYS = (
    "min_supervised_tokens",
    "max_degenerate_fraction",
    "min_degenerate_rows",
    "degenerate_reasons",
    "identical_response_min_count",
    "identical_response_min_fraction",
    "repetition_max_period",
    "repetition_min_match",
    "repetition_min_repeats",
    "repetition_min_fraction",
)

# train's keys (extract's section too): data, optimizer, schedule and drafter shape. gpus_per_job
# is here because the global batch is batch_size x processes. export_dtype is the export rule's
# own param; hidden_dtype reaches training through extract's outputs (its inputs) in offline mode.
TRAIN_DEFINING = {
    "mode",
    # The target's taps are a quantized target's (model.quantized): other taps, another drafter.
    "target_quantization",
    "segments",
    "steps_per_segment",
    "batch_size",
    "gpus_per_job",
    "num_layers",
    "intermediate_size",
    "block_size",
    "target_layer_ids",
    "layer_types",
    "sliding_window",
    "mask_token_id",
    "num_anchors",
    "loss_decay_gamma",
    "learning_rate",
    "min_lr_ratio",
    "warmup_ratio",
    "weight_decay",
    "grad_clip",
    "seed",
    "algorithm",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "selector_loss_weight",
    "selector_warmup_ratio",
    "selector_ramp_ratio",
    "selector_gold_policy",
    "selector_normalization",
    "selector_stop_gradient",
}
# attention: sdpa and flex are tested equal; loss_chunk_rows only bounds memory.
TRAIN_OPERATIONAL = {
    "checkpoint_every_steps",
    "attention",
    "loss_chunk_rows",
    "export_dtype",
    "metrics_every_seconds",
    "hidden_dtype",
    "retries",
    # Where and how checkpoints and data copies are written, and a budget check.
    "checkpoint_async",
    "data_cache_dir",
    "offline_max_bytes",
    # The experiment tracker: what is logged where, never what is trained.
    "tracker",
    "tracker_dir",
    "tracker_project",
    # The same taps either way (checked per run), so switching retrains nothing.
    "taps_from",
    "taps_server",
    # When a step counts as diverged: a sound run's steps are all applied whatever it says.
    "divergence",
    # What rule segment_tau measures of each segment (its own param), never what is trained.
    "segment_eval",
}
EXTRACT_DEFINING = {"num_layers", "target_layer_ids", "hidden_dtype", "target_quantization"}

# Which keys of a rule's config section define what the rule writes. Only these go into the
# rule's `params`, Snakemake's `params` rerun trigger: editing any other key of the section (how
# a job runs: concurrency, intervals, ports, retries, kernels, resources) must not regenerate
# finished shards or retrain a finished segment. Jobs read those keys from the workflow config
# (``job_settings``), which is no rerun trigger. Every key of a section is listed on exactly one
# side (tests/test_config.py checks this against the schema), so a new key must be classified.
RULE_KEYS: dict[str, dict[str, Any]] = {
    "ingest": {
        "section": "dataset",
        "defining": {"paths", "id_field", "max_row_bytes", "max_bad_fraction", "heldout_fraction"},
        "operational": set(),
    },
    "generate": {
        "section": "generation",
        # Model and chat template come from `target.model` (a param of its own).
        "defining": {"engine", "thinking", "max_new_tokens", "seed", "sampling"},
        "operational": {
            "endpoints",
            "gpus_per_job",
            "concurrency",
            "request_timeout_s",
            "hung_after_s",
            "max_retries",
            "max_consecutive_failures",
            "max_error_fraction",
            "part_every_samples",
            "part_every_seconds",
            "telemetry_every_seconds",
            "server",
            "retries",
        },
    },
    "tokenize": {
        "section": "tokenize",
        # Lengths, the degenerate-sample rules and the gate decide which rows a shard keeps.
        "defining": {"max_length", *TOKENIZE_GATE_KEYS},
        "operational": {"telemetry_every_seconds"},
    },
    "extract": {
        "section": "train",
        # The taps stored: which target layers (the default rule depends on num_layers), in
        # which dtype. Everything else about the drafter is training's business.
        "defining": EXTRACT_DEFINING,
        "operational": (TRAIN_DEFINING | TRAIN_OPERATIONAL) - EXTRACT_DEFINING,
    },
    "train": {
        "section": "train",
        "defining": TRAIN_DEFINING,
        "operational": TRAIN_OPERATIONAL,
    },
    "evaluate": {
        "section": "evaluate",
        "defining": {
            "engine",
            "engine_parity_tolerance",
            "max_prompts",
            "max_new_tokens",
            "temperature",
            "lossless_margin",
            "parity_tolerance",
            "simulated_rows",
            "benchmark_prompts",
            # The target measured against: an FP8 one computes other logits and taps.
            "target_quantization",
        },
        # target_mismatch: whether a mismatch fails the job, never what is measured.
        "operational": {
            "engine_mem_fraction",
            "engine_extra_args",
            "engine_hung_after_s",
            "engine_reference_url",
            "target_mismatch",
        },
    },
}


def _canonical(value: Any) -> Any:
    """Dicts with sorted keys, recursively: Snakemake compares params by their repr, and the
    order of keys in a YAML file says nothing about a stage's output."""
    if isinstance(value, dict):
        return {key: _canonical(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_canonical(item) for item in value]
    return value


def split_section(rule: str, section: dict) -> tuple[dict, dict]:
    """The rule's config section as (defining, operational) keys; see ``RULE_KEYS``."""
    if rule not in RULE_KEYS:
        raise ConfigError(f"no key table for rule '{rule}' (known: {', '.join(sorted(RULE_KEYS))})")
    table = RULE_KEYS[rule]
    unknown = sorted(set(section) - table["defining"] - table["operational"])
    if unknown:
        raise ConfigError(
            f"config key '{table['section']}.{unknown[0]}' is neither output-defining nor "
            f"operational for rule '{rule}' (dflash_pipeline.core.config.RULE_KEYS)"
        )
    defining = {k: v for k, v in section.items() if k in table["defining"]}
    operational = {k: v for k, v in section.items() if k in table["operational"]}
    return _canonical(defining), operational


def rule_params(config: dict, rule: str) -> dict:
    """What a rule passes as its `settings` param: the output-defining keys of its section."""
    return split_section(rule, config[RULE_KEYS[rule]["section"]])[0]


def job_settings(config: dict, rule: str, defining: dict) -> dict:
    """The whole section for the job: ``defining`` (the rule's param) and the operational keys
    read from the workflow config (``snakemake.config`` in a script)."""
    _, operational = split_section(rule, config[RULE_KEYS[rule]["section"]])
    return {**operational, **defining}
