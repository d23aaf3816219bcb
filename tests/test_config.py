"""The config schema fills defaults and names the bad key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.core.config import (
    RULE_KEYS,
    ConfigError,
    job_settings,
    SCHEMA_PATH,
    load_schema,
    rule_params,
    split_section,
    validate_config,
)

REPO = Path(__file__).resolve().parent.parent


def test_embedded_default_config_is_valid_and_complete():
    config = validate_config(yaml.safe_load((REPO / "config.yaml").read_text()))
    assert config["target"]["build_demo"] is True
    assert config["dataset"]["paths"] == ["data/demo/prompts.jsonl"]


def test_defaults_are_filled_in_nested_objects():
    config = validate_config({"dataset": {"paths": ["x.jsonl"]}})
    assert config["num_shards"] == 2
    assert config["dataset"]["max_bad_fraction"] == 0.05
    assert config["target"]["model"] == "resources/demo-target"


def test_every_schema_property_is_documented_with_a_default():
    def walk(schema, path):
        for name, sub in schema.get("properties", {}).items():
            assert "description" in sub or sub.get("type") == "object", f"{path}{name}"
            assert "default" in sub, f"{path}{name} has no default"
            walk(sub, f"{path}{name}.")

    walk(load_schema(), "")


def test_the_settings_that_lived_in_code_are_schema_defaults():
    """Each default once, in the schema: the run lease's lifetime, the live telemetry's interval,
    how many prepared shards tune draws from, fetch's parallel downloads, and every rule's time
    limit and memory."""
    import inspect

    from dflash_pipeline.core.jobstate import Telemetry
    from dflash_pipeline.core.lease import RunLease
    from dflash_pipeline.stages import fetch

    defaults = validate_config({})
    assert defaults["lease"]["ttl_s"] == 300 and defaults["tokenize"]["telemetry_every_seconds"] == 10
    assert defaults["tune"]["prompt_shards"] == 8 and defaults["fetch"]["jobs"] == 8
    # No second default in the code that reads them.
    assert inspect.signature(RunLease).parameters["ttl_s"].default is inspect.Parameter.empty
    assert inspect.signature(Telemetry).parameters["every_s"].default is inspect.Parameter.empty
    assert inspect.signature(fetch.fetch).parameters["jobs"].default == defaults["fetch"]["jobs"]
    # Every rule's time limit and memory come from resources (mem_mb through job_memory for the
    # rules whose memory follows the model, with resources.mem_mb as the floor).
    asked: dict[str, dict[str, str]] = {}
    for smk in sorted((REPO / "rules").glob("*.smk")):
        rule = None
        for line in smk.read_text().splitlines():
            if found := re.match(r"rule (\w+):", line):
                rule = found[1]
            elif found := re.match(r"\s+(runtime|mem_mb)=(.*),$", line):
                asked.setdefault(rule, {})[found[1]] = found[2]
    resources = load_schema()["properties"]["resources"]["properties"]
    assert set(asked) == set(resources["runtime_minutes"]["properties"])
    assert set(resources["mem_mb"]["properties"]) == set(asked) - {"tune"}  # tune asks for generate's
    for rule, wanted in asked.items():
        assert wanted["runtime"] == f'config["resources"]["runtime_minutes"]["{rule}"]', rule
        assert wanted["mem_mb"] == f'config["resources"]["mem_mb"]["{rule}"]' or wanted["mem_mb"].startswith(
            "job_memory("
        ), rule


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"dataset": {"max_bad_fraction": 2}}, "dataset.max_bad_fraction"),
        ({"num_shards": 0}, "num_shards"),
        ({"dataset": {"pathz": ["a.jsonl"]}}, "dataset.pathz"),
        ({"shards": 3}, "shards"),
        ({"run": "has space"}, "run"),
        ({"target": {"build_demo": "yes"}}, "target.build_demo"),
    ],
)
def test_invalid_config_names_the_bad_key(config, named):
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert f"'{named}'" in str(err.value)


@pytest.mark.parametrize(
    ("config", "line"),
    [
        # YAML's 2.0 is a float, which JSON Schema's "integer" would take: range(2.0) then fails.
        ({"num_shards": 2.0}, "config key 'num_shards': 2.0 is not an integer (write 2)"),
        (
            {"tune": {"concurrencies": [16, 32.0]}},
            "config key 'tune.concurrencies.1': 32.0 is not an integer (write 32)",
        ),
        # A float beyond a bound: the bound, not how to write the integer.
        (
            {"generation": {"max_new_tokens": 1e12}},
            "config key 'generation.max_new_tokens': 1000000000000.0 is outside its range [1, 1048576]",
        ),
        (
            {"generation": {"concurrency": 10**8}},
            "config key 'generation.concurrency': 100000000 is outside its range [1, 65536]",
        ),
        # Learning rates far off any sane one (the 1e12 diverged every step), written as
        # YAML 1.1 reads them (text) or as numbers.
        (
            {"train": {"learning_rate": "1e12"}},
            "config key 'train.learning_rate': 1000000000000.0 is outside its range (0, 1]",
        ),
        ({"train": {"learning_rate": 0.0}}, "config key 'train.learning_rate': 0.0 is outside its range (0, 1]"),
        (
            {"generation": {"sampling": {"temperature": float("nan")}}},
            "config key 'generation.sampling.temperature': nan is not a finite number",
        ),
        ({"evaluate": {"temperature": float("inf")}}, "config key 'evaluate.temperature': inf is not a finite number"),
        (
            {"engines": {"vllm": {"env": {"X": float("-inf")}}}},
            "config key 'engines.vllm.env.X': -inf is not a finite number",
        ),
        (
            {"results_dir": "/scratch/runs"},
            "config key 'results_dir': '/scratch/runs' is an absolute path, outside the working directory; "
            "use a relative folder inside it, or set results_dir_outside_workdir: true (local runs only)",
        ),
        (
            {"results_dir": "runs/../../elsewhere"},
            "config key 'results_dir': 'runs/../../elsewhere' leaves the working directory; "
            "use a relative folder inside it, or set results_dir_outside_workdir: true (local runs only)",
        ),
    ],
)
def test_edge_values_are_refused_in_one_line_naming_key_value_and_reason(config, line):
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert str(err.value).splitlines() == ["invalid configuration:", f"  {line}"]


def test_results_dir_outside_the_working_directory_only_when_allowed():
    assert validate_config({"results_dir": "runs/../results"})["results_dir"] == "runs/../results"
    allowed = {"results_dir": "/scratch/runs", "results_dir_outside_workdir": True}
    assert validate_config(allowed)["results_dir"] == "/scratch/runs"
    assert validate_config({"num_shards": 99999, "generation": {"max_new_tokens": 2**20}})["num_shards"] == 99999


@pytest.mark.parametrize("example", sorted((REPO / "config/examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(example):
    validate_config(yaml.safe_load(example.read_text()))


def test_dflash2_keys_have_defaults_and_cross_key_rules_are_checked():
    train = validate_config({"train": {"algorithm": "dflash2"}})["train"]
    assert (train["conv_kernel_size"], train["conv_group_size"]) == (2, 16)
    assert (train["selector_rank"], train["selector_top_k"]) == (256, 16)
    assert train["selector_gold_policy"] == "strict" and train["selector_normalization"] == "base"
    assert validate_config({"train": {}})["train"]["algorithm"] == "dflash"
    # Which engine serves DFlash2 is the engine-limits table's business, checked against the
    # installed engine at plan time (tests/test_engine_limits.py), not the schema's.
    validate_config({"train": {"algorithm": "dflash2"}, "evaluate": {"engine": "vllm"}})
    with pytest.raises(ConfigError, match="train.conv_kernel_size: 9 is larger than train.block_size 8"):
        validate_config({"train": {"algorithm": "dflash2", "conv_kernel_size": 9, "block_size": 8}})
    with pytest.raises(ConfigError, match="selector_gold_policy"):
        validate_config({"train": {"selector_gold_policy": "insert"}})
    # DFlash is not held to DFlash2's rules.
    validate_config({"train": {"conv_kernel_size": 9, "block_size": 8}, "evaluate": {"engine": "vllm"}})
    # The engines feed taps in ascending layer order (SGLang 0.5.17 on an H100, bench/README.md):
    # any other order is refused by the config check, before a run generates anything.
    with pytest.raises(ConfigError, match=r"train.target_layer_ids: \[9, 1\] must be strictly ascending"):
        validate_config({"train": {"target_layer_ids": [9, 1]}})
    assert validate_config({"train": {"target_layer_ids": [1, 9]}})["train"]["target_layer_ids"] == [1, 9]


# --- which keys define a rule's output (its `params`) and which only say how the job runs ---


def _section_schema(section):
    return load_schema()["properties"][section]["properties"]


@pytest.mark.parametrize("rule", sorted(RULE_KEYS))
def test_every_key_of_a_rules_section_is_classified_once(rule):
    table = RULE_KEYS[rule]
    assert not table["defining"] & table["operational"]
    assert table["defining"] | table["operational"] == set(_section_schema(table["section"]))


def test_rule_params_keep_the_defining_keys_only_in_a_stable_order():
    config = validate_config({"generation": {"concurrency": 7, "sampling": {"top_p": 0.9, "temperature": 0.6}}})
    params = rule_params(config, "generate")
    assert set(params) == {"engine", "thinking", "max_new_tokens", "seed", "sampling"}
    # The order of keys in the YAML file does not change the params' repr (Snakemake's trigger).
    assert list(params["sampling"]) == sorted(params["sampling"])
    reordered = validate_config({"generation": {"sampling": {"temperature": 0.6, "top_p": 0.9}}})
    assert repr(rule_params(reordered, "generate")) == repr(params)


@pytest.mark.parametrize(
    ("rule", "key", "value"),
    [
        ("generate", "concurrency", 3),
        ("generate", "telemetry_every_seconds", 1),
        ("tokenize", "telemetry_every_seconds", 1),
        ("generate", "server", {"port_base": 31000}),
        ("train", "checkpoint_every_steps", 7),
        ("train", "metrics_every_seconds", 1),
        ("extract", "learning_rate", 0.1),
        ("evaluate", "engine_extra_args", ["--x"]),
    ],
)
def test_an_operational_key_leaves_the_params_alone_and_reaches_the_job(rule, key, value):
    section = RULE_KEYS[rule]["section"]
    base = validate_config({})
    changed = validate_config({section: {key: value}})
    assert rule_params(changed, rule) == rule_params(base, rule)
    settings = job_settings(changed, rule, rule_params(changed, rule))
    assert settings == changed[section] and settings[key] == changed[section][key]


@pytest.mark.parametrize(
    ("rule", "key", "value"),
    [
        ("generate", "max_new_tokens", 9),
        ("generate", "sampling", {"temperature": 0.5}),
        ("train", "learning_rate", 0.1),
        ("train", "gpus_per_job", 4),
        ("extract", "hidden_dtype", "float32"),
        ("evaluate", "max_prompts", 3),
        ("tokenize", "max_length", 64),
    ],
)
def test_a_defining_key_changes_the_params(rule, key, value):
    section = RULE_KEYS[rule]["section"]
    assert rule_params(validate_config({section: {key: value}}), rule) != rule_params(validate_config({}), rule)


def test_an_unclassified_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="'generation.new_knob' is neither output-defining nor operational"):
        split_section("generate", {"new_knob": 1})


# --- example configs: complete configs, omitted keys take the schema's defaults ---


def _schema_defaults(schema, path=()):
    """(dotted path, default) of every leaf property of the schema."""
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            yield from _schema_defaults(sub, (*path, name))
        else:
            yield (*path, name), sub["default"]


def _given(config, path):
    for part in path:
        if not isinstance(config, dict) or part not in config:
            return False
        config = config[part]
    return True


def _value(config, path):
    for part in path:
        config = config[part]
    return config


@pytest.mark.parametrize("example", sorted((REPO / "config/examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_take_the_schema_default_for_every_omitted_key(example):
    """The workflow reads an example alone (the demo's config.yaml only without --configfile,
    see the Snakefile) and fills omitted keys from the schema: a key the example leaves out must
    come out as the schema's default, never the demo's value."""
    raw = yaml.safe_load(example.read_text())
    parsed = validate_config(raw)
    omitted = [(path, default) for path, default in _schema_defaults(load_schema()) if not _given(raw, path)]
    assert omitted, "the example sets every key: nothing to check"
    for path, default in omitted:
        assert _value(parsed, path) == default, f"{example.name}: {'.'.join(path)}"
    # The keys that the demo's values used to leak into (issue: a 256-wide drafter MLP).
    assert parsed["train"]["intermediate_size"] is None and parsed["evaluate"]["simulated_rows"] == 64


def test_the_stage_order_is_one_list_that_the_schema_repeats():
    from dflash_pipeline.core.layout import STAGES

    assert tuple(load_schema()["properties"]["until"]["enum"]) == STAGES


def test_a_float_shard_count_stops_the_dry_run_in_one_line(workflow):
    # Before: the schema took 2.0 as an integer and rules/common.smk failed in range(2.0).
    workflow.write_config(num_shards=2.0)
    assert "num_shards: 2.0" in (workflow.root / "config.yaml").read_text()
    proc = workflow.snakemake("-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "  config key 'num_shards': 2.0 is not an integer (write 2)" in out.splitlines()
    assert "TypeError" not in out and "Traceback" not in out


@pytest.mark.parametrize(("written", "value"), [("6e-4", 0.0006), ("1e-5", 1e-5), ("3E-4", 0.0003), ("+.5e-3", 0.0005)])
def test_a_number_in_exponent_notation_is_read_as_a_number_from_a_file_and_from_config_overrides(
    tmp_path, written, value
):
    """PyYAML (YAML 1.1, Snakemake's reader) takes `6e-4` as text; Snakemake's `--config` parses a
    nested override with YAML's BaseLoader, every value text. Both mean the number written."""
    from snakemake.cli import parse_config

    from dflash_pipeline.core.config import layered_config

    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  learning_rate: {written}\n  segments: 3\n")
    from_file = layered_config(path)
    assert from_file["train"]["learning_rate"] == written  # what YAML 1.1 gives
    override = parse_config([f"train={{learning_rate: {written}, segments: 3, checkpoint_async: false}}"])
    assert override["train"] == {"learning_rate": written, "segments": "3", "checkpoint_async": "false"}
    for config in (from_file, override):
        train = validate_config(config)["train"]
        assert train["learning_rate"] == value and type(train["learning_rate"]) is float
        assert train["segments"] == 3 and type(train["segments"]) is int
    assert validate_config(override)["train"]["checkpoint_async"] is False


def test_text_is_left_as_text_where_a_key_takes_text_or_no_number():
    config = validate_config(
        {"run": "1e3", "train": {"tracker_dir": "2e5"}, "engines": {"vllm": {"env": {"A": "1e3"}}}}
    )
    assert config["run"] == "1e3" and config["train"]["tracker_dir"] == "2e5"
    assert config["engines"]["vllm"]["env"]["A"] == "1e3"  # a key of [string, number]: as written
    with pytest.raises(ConfigError, match=r"config key 'train.segments': '1e3' is not of type 'integer'"):
        validate_config({"train": {"segments": "1e3"}})


@pytest.mark.workflow
def test_the_dry_run_reads_exponents_as_written_and_refuses_a_learning_rate_out_of_range(workflow):
    config = workflow.root / "config.yaml"
    config.write_text(config.read_text().replace("learning_rate: 0.003", "learning_rate: 6e-4"))
    assert "  learning_rate: 6e-4" in config.read_text().splitlines()
    assert workflow.planned_jobs()["train"] == 2
    proc = workflow.snakemake("-n", "--config", "train={learning_rate: 1e12}", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "  config key 'train.learning_rate': 1000000000000.0 is outside its range (0, 1]" in out.splitlines()
    assert "Traceback" not in out


@pytest.mark.parametrize(
    "train, expected",
    [
        ({"mode": "online", "taps_from": "engine"}, True),
        ({"mode": "online", "taps_from": "target"}, False),
        ({"mode": "offline", "taps_from": "engine"}, False),  # offline reads extract's taps
        ({"mode": "online"}, False),
    ],
)
def test_one_predicate_says_whether_training_takes_taps_from_an_engine(train, expected):
    from dflash_pipeline.core.config import trains_from_engine_taps

    assert trains_from_engine_taps(train) is expected


def test_the_schema_is_parsed_once_as_pure_python_yaml_reads_it_and_each_caller_gets_its_own_copy():
    first = load_schema()
    assert first == yaml.load(SCHEMA_PATH.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    first["properties"]["train"]["properties"].clear()
    first["properties"].pop("evaluate")
    second = load_schema()
    assert second["properties"]["train"]["properties"] and "evaluate" in second["properties"]
