"""The workflow on local storage: plan, run, re-plan only what is missing, refuse bad data."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.workflow


def use_built_demo_model(demo_model):
    return {"target": {"model": str(demo_model), "build_demo": False}, "until": "tokenize"}


def test_dry_run_lists_the_jobs_of_every_stage(workflow, demo_model):
    workflow.write_config(num_shards=3, target={"model": str(demo_model), "build_demo": False})
    assert workflow.planned_jobs() == {
        "ingest": 1,
        "prepare": 3,
        "generate": 3,
        "tokenize": 3,
        "report_prompts": 1,
        "report_generation": 1,
        "report_tokenization": 1,
        "train": 2,
        "segment_tau": 2,
        "export": 1,
        "evaluate": 1,
        "report_training": 1,
        "report_evaluation": 1,
        "report_headline": 1,
        "report_storage": 1,
        "all": 1,
    }
    workflow.write_config(train={"mode": "offline", "segments": 3})
    assert workflow.planned_jobs()["extract"] == 3 and workflow.planned_jobs()["train"] == 3


def test_demo_trains_a_drafter_that_the_real_loop_accepts(workflow, demo_model):
    """The demo, prepare -> evaluate: training's simulated acceptance length reaches 2, the
    exported drafter's real-loop tau on held-out prompts too, losslessly, within the parity gap."""
    workflow.write_config(**{**use_built_demo_model(demo_model), "until": "evaluate"})
    workflow.snakemake()
    root = workflow.root / "results/demo"
    metrics = [json.loads(x) for x in (root / "_progress/train/segment-0001/metrics.jsonl").read_text().splitlines()]
    late = [r["accept_len"] for r in metrics[-20:]]
    assert sum(late) / len(late) >= 2.0, late
    evaluation = json.loads((root / "outputs/evaluate-metrics.json").read_text())
    assert evaluation["overall"]["tau"] >= 2.0
    assert evaluation["lossless"]["passed"] and evaluation["lossless"]["exact"] == evaluation["lossless"]["prompts"]
    assert evaluation["parity"]["passed"]
    assert {p["prompt_set"] for p in evaluation["per_prompt"]} and evaluation["overall"]["verify_steps"] > 0
    assert (root / "drafter/model.safetensors").exists()
    # τ while it trained: each segment's checkpoint in the loop, a finite τ the loop can give.
    taus = [json.loads((root / f"outputs/segment_tau-000{k}.json").read_text()) for k in (0, 1)]
    assert [r["step"] for r in taus] == [99, 199] and all(1 <= r["tau"] <= 8 for r in taus), taus
    print("demo τ per segment:", [r["tau"] for r in taus], "evaluate:", evaluation["overall"]["tau"])
    engine_log = (root / "logs/evaluate-engine.log").read_text()
    assert engine_log.startswith("no serving engine was launched (evaluate.engine: transformers)")
    assert workflow.planned_jobs() == {}
    # A crash in the last segment: it is retrained from the one before it, and what depends on
    # it follows (a lost manifest alone is not rebuilt while its products exist).
    for key in (
        "outputs/train-segment-0001.json",
        "drafter/config.json",
        "drafter/model.safetensors",
        "outputs/evaluate-metrics.json",
    ):
        (root / key).unlink()
    assert workflow.planned_jobs() == {
        "train": 1,
        "segment_tau": 1,
        "export": 1,
        "evaluate": 1,
        "report_training": 1,
        "report_evaluation": 1,
        "report_headline": 1,
        "report_storage": 1,
        "all": 1,
    }


def test_demo_config_plans_the_demo_model(workflow):
    assert workflow.planned_jobs()["build_demo_model"] == 1


def test_run_then_nothing_to_do_then_only_the_deleted_shard(workflow, demo_model, session_endpoint):
    # This test is about planning. The demo's greedy generation changes with CPU batching under
    # load and may hold a degenerate sample or two; whether a shard passes is the gate's business
    # (tests/test_tokenize.py), so the limit here leaves room for them. 36 prompts (about 11 a
    # shard) are enough to plan with; the demo's 160 took a loaded CPU minutes more to generate.
    workflow.write_config(
        num_shards=3,
        dataset={"paths": [workflow.few_prompts(36)]},
        tokenize={"max_degenerate_fraction": 0.5},
        **use_built_demo_model(demo_model),
    )
    workflow.write_config(**session_endpoint)  # planning is the subject, not the engine's launch
    workflow.snakemake()
    shards = workflow.root / "results/demo/outputs"
    names = sorted(p.name for p in shards.glob("prepare-*"))
    assert names == [f"prepare-0000{i}.parquet" for i in range(3)]
    summary = json.loads((workflow.root / "results/demo/outputs/ingest-summary.json").read_text())
    total = sum(pq.read_table(shards / n).num_rows for n in names)
    assert total == summary["samples"] > 0
    generated = [pq.read_table(shards / f"generate-0000{i}.parquet").num_rows for i in range(3)]
    assert sum(generated) == total
    for i in range(3):
        stats = json.loads((shards / f"tokenize-0000{i}.stats.json").read_text())
        tokenized = pq.read_table(shards / f"tokenize-0000{i}.parquet")
        # Every sample judged; every one kept gives at least one sequence, and the table holds them.
        assert stats["samples"] == generated[i] and stats["degenerate_samples"] <= 0.5 * generated[i]
        assert stats["sequences_out"] >= stats["samples"] - stats["degenerate_samples"]
        assert tokenized.num_rows == stats["sequences_out"]
    assert workflow.planned_jobs() == {}
    (shards / "tokenize-00001.parquet").unlink()
    # The report figures made from that shard follow it (this run stops at tokenize).
    assert workflow.planned_jobs() == {
        "tokenize": 1,
        "report_tokenization": 1,
        "report_storage": 1,
        "all": 1,
    }
    # A missing intermediate alone is not rebuilt (its product exists); all gone: the chain, with
    # the headline, which counts the generate shards' samples and tokens.
    for stage in ("prepare", "generate", "tokenize"):
        (shards / f"{stage}-00002.parquet").unlink()
    proc = workflow.snakemake("-n")
    assert workflow.planned_jobs() == {
        "prepare": 1,
        "generate": 1,
        "tokenize": 2,
        "report_generation": 1,
        "report_headline": 1,
        "report_tokenization": 1,
        "report_storage": 1,
        "all": 1,
    }
    assert "wildcards: shard=00002" in proc.stdout and "wildcards: shard=00000" not in proc.stdout


def test_bad_config_key_stops_the_workflow_with_its_name(workflow):
    workflow.write_config(dataset={"max_bad_fraction": 3})
    proc = workflow.snakemake("-n", check=False)
    assert proc.returncode != 0
    assert "config key 'dataset.max_bad_fraction'" in proc.stdout + proc.stderr


def test_mostly_bad_dataset_fails_ingest_naming_file_row_and_reason(workflow, demo_model):
    data = workflow.root / "data/bad.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{oops\n{oops\n')
    workflow.write_config(dataset={"paths": ["data/bad.jsonl"]}, **use_built_demo_model(demo_model))
    proc = workflow.snakemake(check=False)
    assert proc.returncode != 0
    log = (workflow.root / "results/demo/logs/ingest.log").read_text()
    for text in (log, proc.stderr):
        assert "2 of 3 rows (66.7%) are bad" in text
        assert "data/bad.jsonl row 2: malformed JSON" in text
    assert not (workflow.root / "results/demo/outputs").exists()
    # Snakemake deleted the failed job's outputs; the copies beside the log name every bad row.
    kept = workflow.root / "results/demo/logs/ingest.refused-quarantine.jsonl"
    assert [json.loads(line)["row"] for line in kept.read_text().splitlines()] == [2, 3]
    assert "ingest.refused-summary.json" in log


def test_the_readme_commands_find_the_logger_plugin_from_the_venv_alone(workflow, demo_model):
    """`source .venv/bin/activate; snakemake --logger dflash` in a copy of the workflow: the
    installed package alone (no PYTHONPATH, not run from the checkout) must be found by
    Snakemake's plugin discovery, and jobs must not need `python` or `transformers` on PATH."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    venv_bin = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv_bin}{os.pathsep}/usr/bin:/bin"
    workflow.write_config(**use_built_demo_model(demo_model))
    proc = subprocess.run(
        [str(venv_bin / "snakemake"), "--cores", "1", "--logger", "dflash", "-n"],
        cwd=workflow.root, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "invalid choice" not in proc.stderr
