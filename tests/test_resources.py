"""Host memory per job follows the target's and the drafter's sizes (SLURM kills a job that
outgrows its request): a 27B target on 8 ranks is not 16 GB, and the demo keeps the floors."""

from __future__ import annotations

import json

import pytest
import yaml

from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.resources import MODEL_SIZED_RULES, checkpoint_bytes, drafter_params, job_memory_mb
from tests.conftest import REPO

# Qwen3.6-27B's text shape (hidden 5120, intermediate 17408) and its bf16 checkpoint's size.
QWEN36_27B = {"text_config": {"hidden_size": 5120, "intermediate_size": 17408}}
WEIGHTS = 54_000_000_000


def fake_27b(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN36_27B))
    index = {"metadata": {"total_size": WEIGHTS}, "weight_map": {}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_the_27b_example_asks_for_what_its_jobs_hold(tmp_path):
    config = yaml.safe_load((REPO / "config/examples/qwen3.6-27b.yaml").read_text())
    config["target"]["model"] = str(fake_27b(tmp_path / "qwen"))
    config = validate_config(config)
    assert checkpoint_bytes(config["target"]["model"]) == WEIGHTS
    params = drafter_params(config["target"]["model"], config["train"])
    assert 1.5e9 < params < 2.5e9  # 5 layers of hidden 5120 (the authors' drafter: ~1.7B)
    mem = job_memory_mb(config)
    target_mb = 1.2 * WEIGHTS / 1e6
    assert mem["generate"] > target_mb  # the engine loads the target through host memory
    assert mem["train"] > 8 * target_mb  # eight ranks, each with its own target
    assert params * 8 / 1e6 < mem["export"] < params * 12 / 1e6  # fp32 weights + their copy, no moments
    assert mem["evaluate"] > target_mb and mem["evaluate"] < 2 * target_mb  # bf16 on the GPU


def test_the_speculators_export_also_holds_the_verifiers_embedding_and_head(tmp_path):
    folder = fake_27b(tmp_path / "qwen")
    shape = {**QWEN36_27B["text_config"], "vocab_size": 248320, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps({"text_config": shape}))
    config = validate_config({"target": {"model": str(folder)}, "train": {"num_layers": 5}})
    zlab = job_memory_mb(config)["export"]
    both = job_memory_mb(config, speculators_export=True)["export"]
    head_mb = 2 * 248320 * 5120 * 2 / 1e6  # embedding + LM head, bf16: ~5.1 GB
    assert both - zlab == pytest.approx(2 * head_mb, abs=1000)  # read, and held again while written


def test_the_demo_and_a_missing_folder_keep_the_floors(tmp_path, demo_model):
    """The floors are the config's resources.mem_mb (the schema's defaults unless set)."""
    config = validate_config({"target": {"model": str(tmp_path / "not-built-yet")}})
    floors = {rule: config["resources"]["mem_mb"][rule] for rule in MODEL_SIZED_RULES}
    assert job_memory_mb(config) == floors == {
        "generate": 8000, "extract": 16000, "train": 16000, "export": 8000, "evaluate": 16000,
        "segment_tau": 16000,
    }  # fmt: skip
    demo = validate_config(yaml.safe_load((REPO / "config.yaml").read_text()) | {"target": {"model": str(demo_model)}})
    assert job_memory_mb(demo) == floors  # a few MB of weights: the floors
    raised = validate_config(
        {"target": {"model": str(tmp_path / "not-built-yet")}, "resources": {"mem_mb": {"train": 64000}}}
    )
    assert job_memory_mb(raised)["train"] == 64000
