"""The config schema fills defaults and names the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dflash_pipeline.core.config import ConfigError, load_schema, validate_config

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


@pytest.mark.parametrize("example", sorted((REPO / "config/examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_are_valid(example):
    validate_config(yaml.safe_load(example.read_text()))


def test_dflash2_keys_have_defaults_and_cross_key_rules_are_checked():
    train = validate_config({"train": {"algorithm": "dflash2"}})["train"]
    assert (train["conv_kernel_size"], train["conv_group_size"]) == (2, 16)
    assert (train["selector_rank"], train["selector_top_k"]) == (256, 16)
    assert train["selector_gold_policy"] == "strict" and train["selector_normalization"] == "base"
    assert validate_config({"train": {}})["train"]["algorithm"] == "dflash"
    with pytest.raises(ConfigError, match="evaluate.engine: vllm cannot serve a DFlash2 drafter"):
        validate_config({"train": {"algorithm": "dflash2"}, "evaluate": {"engine": "vllm"}})
    with pytest.raises(ConfigError, match="train.conv_kernel_size: 9 is larger than train.block_size 8"):
        validate_config({"train": {"algorithm": "dflash2", "conv_kernel_size": 9, "block_size": 8}})
    with pytest.raises(ConfigError, match="selector_gold_policy"):
        validate_config({"train": {"selector_gold_policy": "insert"}})
    # DFlash is not held to DFlash2's rules.
    validate_config({"train": {"conv_kernel_size": 9, "block_size": 8}, "evaluate": {"engine": "vllm"}})
