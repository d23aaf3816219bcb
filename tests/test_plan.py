"""The run plan (python -m dflash_pipeline.stages.plan): figures from the config, the benchmark
results and what a run root already holds; the CLI on the seeds' example config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipeline.core import layout
from dflash_pipeline.core.jobstate import ShardProgress
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.stages.plan import (
    Measured,
    PlanError,
    load_run_config,
    make_plan,
    measure_run,
    merge_config,
    model_case,
    pick_train_benchmark,
)

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "config/examples/qwen3.6-27b.yaml"


def seeds_config(**plan):
    config = load_run_config(EXAMPLE)
    config["plan"].update(plan)
    return config


BENCH = [
    {"case": "qwen3.6-27b", "mode": "online", "seq_len": 4096, "tokens_per_s": 5657.4,
     "drafter_params": 1730213120, "file": "train_step-h200.json", "device": "NVIDIA H200"},
    {"case": "qwen3.6-27b", "mode": "online", "seq_len": 1024, "tokens_per_s": 9999.0, "file": "x", "device": "x"},
    {"case": "qwen3.6-27b", "mode": "drafter", "seq_len": 4096, "tokens_per_s": 14787.3, "file": "x", "device": "x"},
    {"case": "qwen3-8b", "mode": "online", "seq_len": 4096, "tokens_per_s": 11559.2, "file": "x", "device": "x"},
]


def test_benchmark_pick_matches_target_mode_and_context():
    assert model_case("/models/Qwen3.6-27B/") == "qwen3.6-27b"
    assert pick_train_benchmark(BENCH, "qwen3.6-27b", "online", 4096)["tokens_per_s"] == 5657.4
    assert pick_train_benchmark(BENCH, "qwen3.6-27b", "offline", 4096)["tokens_per_s"] == 14787.3
    assert pick_train_benchmark(BENCH, "llama", "online", 4096) is None  # never another model's


def test_benchmark_pick_takes_the_configs_algorithm_and_averages_files_of_one_context():
    dflash2 = {"case": "qwen3.6-27b", "mode": "online", "seq_len": 4096, "tokens_per_s": 5043.1,
               "algorithm": "dflash2", "file": "train_step-dflash2-h200.json", "device": "NVIDIA H200"}
    again = {**dflash2, "algorithm": "dflash", "tokens_per_s": 5576.6}  # DFlash, measured beside it
    records = [*BENCH, dflash2, again]
    picked = pick_train_benchmark(records, "qwen3.6-27b", "online", 4096, "dflash2")
    assert picked["tokens_per_s"] == 5043.1 and picked["file"] == "train_step-dflash2-h200.json"
    picked = pick_train_benchmark(records, "qwen3.6-27b", "online", 4096)
    assert picked["tokens_per_s"] == round((5657.4 + 5576.6) / 2, 1)
    assert picked["file"] == "train_step-dflash2-h200.json, train_step-h200.json"


def test_seeds_case_from_config_and_benchmark():
    config = seeds_config()
    plan = make_plan(config, Measured(bench_train=BENCH[0]), gpus=8)
    rows = round(902000 * (1 - config["dataset"]["heldout_fraction"]))
    assert plan["prompts"]["value"] == 902000 and plan["train_rows"] == rows
    assert plan["generated_tokens"] == 902000 * 3000
    seq = 200 + 3000
    assert plan["train"]["epoch_tokens"] == rows * seq
    # ~140 GPU-hours per epoch of online training at ~5.7k tok/s per H200.
    assert plan["train"]["gpu_hours_per_epoch"] == pytest.approx(rows * seq / 5657.4 / 3600)
    assert 130 < plan["train"]["gpu_hours_per_epoch"] < 150
    assert plan["generation"]["gpu_hours"] == pytest.approx(902000 * 3000 / 3000 / 3600)
    # Hidden states: 5 taps x 5120 x 2 bytes per token; online mode stores none.
    assert plan["hidden_bytes_per_token"] == 5 * 5120 * 2
    assert plan["bytes"]["extract"]["value"] == 0
    assert "offline would store" in plan["bytes"]["extract"]["source"]
    # 8 GPUs: 8 one-GPU generate jobs at once; training on its 8-GPU job.
    assert plan["wall"]["generate_h"] == pytest.approx(plan["generation"]["gpu_hours"] / 8)
    assert plan["wall"]["train_h"] == pytest.approx(plan["train"]["gpu_hours"] / 8)
    assert plan["train"]["steps"] == 20 * 2000 and plan["train"]["sequences"] == 40000 * 8
    assert make_plan(config, Measured(bench_train=BENCH[0]), gpus=16)["wall"]["generate_h"] == pytest.approx(
        plan["wall"]["generate_h"] / 2)


def test_offline_mode_counts_the_hidden_state_bytes():
    config = seeds_config()
    config["train"]["mode"] = "offline"
    plan = make_plan(config, Measured(), gpus=8)
    assert plan["bytes"]["extract"]["value"] == plan["train"]["epoch_tokens"] * 5 * 5120 * 2
    assert plan["train"]["gpu_hours"] is None  # no drafter benchmark given: unknown, not guessed


def test_measured_figures_replace_the_assumptions(tmp_path):
    config = seeds_config()
    run = open_storage(tmp_path / "run")
    run.write_text(layout.INGEST_SUMMARY, json.dumps({"samples": 1000, "heldout_samples": 10}))
    for shard, size in ((0, 300), (1, 500)):
        run.write_bytes(layout.shard_key("generate", shard), b"g" * size)
        ShardProgress(run, "generate", shard).write_telemetry(
            {"state": "done", "samples_done": 100, "samples_resumed": 0, "tokens_generated": 250_000,
             "elapsed_s": 100.0})
    ShardProgress(run, "generate", 2).write_telemetry(  # still running: not a measurement
        {"state": "running", "samples_done": 5, "tokens_generated": 9, "elapsed_s": 1.0})
    run.write_text(layout.train_progress_prefix(0) + "telemetry.json", json.dumps({"tokens_per_s": 40000.0}))
    measured = measure_run(str(tmp_path / "run"), config)
    plan = make_plan(config, measured, gpus=8)
    assert plan["prompts"] == {"value": 1000, "source": "the run's ingest summary"}
    assert plan["train_rows"] == 990
    assert plan["mean_response_tokens"]["value"] == 2500  # 500k tokens / 200 samples
    assert plan["generation"]["tokens_per_s_per_gpu"]["value"] == 2500  # per GPU-second
    assert plan["train"]["tokens_per_s_per_gpu"]["value"] == 5000  # 40k over the job's 8 GPUs
    assert plan["bytes"]["generate"]["value"] == 400 * config["num_shards"]
    assert "2 finished shards" in plan["bytes"]["generate"]["source"]


def test_missing_prompt_count_is_a_clear_error():
    config = seeds_config(prompts=None)
    with pytest.raises(PlanError, match="plan.prompts"):
        make_plan(config, Measured(), gpus=8)


def test_merge_config_is_snakemakes_layering():
    assert merge_config({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": 3}}) == {"a": {"b": 3, "c": 2}, "d": 1}


def test_cli_prints_the_seeds_case():
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.stages.plan", "--configfile", str(EXAMPLE), "--gpus", "8",
         "--run-url", str(REPO / "no-such-run"), "--json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    plan = json.loads(proc.stdout)
    assert plan["shards"] == 400 and plan["prompts"]["value"] == 902000
    assert 130 < plan["train"]["gpu_hours_per_epoch"] < 150
    assert "bench/results/train_step-h200.json" in plan["train"]["tokens_per_s_per_gpu"]["source"]
    text = subprocess.run(
        [sys.executable, "-m", "dflash_pipeline.stages.plan", "--configfile", str(EXAMPLE), "--gpus", "8"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    assert "GPU-hours" in text and "per epoch" in text and "Wall time on 8 GPUs" in text


def test_cli_names_a_missing_config_file():
    proc = subprocess.run([sys.executable, "-m", "dflash_pipeline.stages.plan", "--configfile", "nope.yaml"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr
