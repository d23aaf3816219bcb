"""`tune` on the demo target with two real engines (`transformers serve` and vLLM's CPU build):
the rule measures its settings on the run's own prompts, `plan` names the measurement as its
generation rate, a generate job takes the chosen concurrency (the config leaves it null), and a
changed tune key measures again without regenerating a finished shard."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_pipeline.core import layout
from tests.support.engine_envs import VLLM_CPU_ENV, VLLM_CPU_MEM_FRACTION, vllm_python
from tests.test_generate_workflow import SLOW

pytestmark = pytest.mark.workflow

RUN = "results/demo"
TUNE_RESULT = f"{RUN}/{layout.TUNE_RESULT}"
# One of the demo's two shards: tune reads both prepared shards, generate builds this one.
GENERATED = f"{RUN}/{layout.shard_key('generate', 0)}"
CONCURRENCIES = [1, 4]


def engine_settings(engine: str) -> tuple[dict, dict | None]:
    """The `engines` section and the `generation.server` section of each engine (None: the demo's)."""
    if engine == "vllm":
        server = {"mem_fraction": VLLM_CPU_MEM_FRACTION, "extra_args": [], "startup_timeout_s": SLOW}
        return {"vllm": {"python": str(vllm_python()), "env": dict(VLLM_CPU_ENV)}}, server
    return {}, None


# vLLM's case in a lane of vLLM servers (tests/conftest.py XDIST_GROUPS): one at a time.
@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=pytest.mark.xdist_group("vllm_taps"))])
def test_tune_measures_the_engine_and_generate_and_plan_take_its_choice(engine, workflow, demo_model, tmp_path):
    engines, server = engine_settings(engine)
    generation = {"engine": engine, "concurrency": None, "max_new_tokens": 32}
    if server:
        generation["server"] = server
    tune = {"enabled": True, "prompts": 8, "concurrencies": CONCURRENCIES, "max_new_tokens": 24}
    workflow.write_config(
        # 16 prompts in the demo's two shards: tune replays 8 of them, generate builds one shard.
        dataset={"paths": [workflow.few_prompts(16)], "heldout_fraction": 0.1},
        target={"model": str(demo_model), "build_demo": False},
        until="generate",
        gpu_lock_dir=str(tmp_path / "locks"),
        engines=engines,
        generation=generation,
        tune=tune,
    )
    workflow.snakemake("tune")
    result = json.loads((workflow.root / TUNE_RESULT).read_text())
    assert result["engine"] == engine and result["prompts"] == 8 and result["max_new_tokens"] == 24
    assert [s["concurrency"] for s in result["settings"]] == CONCURRENCIES
    for setting in result["settings"]:
        assert setting["requests"] == 8 and setting["errors"] == 0 and setting["cut_at_budget"] == 0
        assert sum(setting["finish_reasons"].values()) == 8
        assert setting["output_tokens"] > 0 and setting["output_tokens_per_s"] > 0
        assert setting["ttft_s"]["p50"] > 0 and setting["tpot_ms"]["p50"] > 0
        assert setting["engine_memory_mb"]["rss"] > 0 and not setting["mtp"]
    assert "no MTP head" in result["mtp"] or "does not serve" in result["mtp"]
    choice = result["choice"]
    best = max(result["settings"], key=lambda s: s["output_tokens_per_s"])
    assert choice["concurrency"] == best["concurrency"] and choice["why"] == "the best throughput within the bounds"

    # plan: the measured rate, named, before any generate shard exists.
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.stages.plan",
            "--configfile",
            str(workflow.root / "config.yaml"),
            "--gpus",
            "1",
            "--json",
        ],
        cwd=workflow.root,
        capture_output=True,
        text=True,
        check=True,
    )
    rate = json.loads(plan.stdout)["generation"]["tokens_per_s_per_gpu"]
    assert rate["value"] == choice["tokens_per_s_per_gpu"]
    assert (
        rate["source"].startswith(f"measured by tune: {engine}")
        and f"concurrency {choice['concurrency']}" in rate["source"]
    )

    # generate: the tuned concurrency; tune is not measured again.
    measured_at = (workflow.root / TUNE_RESULT).stat().st_mtime_ns
    workflow.snakemake(GENERATED)
    log = (workflow.root / RUN / "logs/generate/00000.log").read_text()
    assert f"concurrency {choice['concurrency']} (measured by tune: {engine}" in log, log[-3000:]
    assert (workflow.root / TUNE_RESULT).stat().st_mtime_ns == measured_at

    if engine == "transformers":
        # A changed tune key measures again; the finished shard stays (the result is an
        # ancient() input of generate). The same planning for every engine: checked once.
        workflow.write_config(tune={**tune, "concurrencies": [2]})
        assert workflow.planned_jobs("--", GENERATED, TUNE_RESULT) == {"tune": 1}
