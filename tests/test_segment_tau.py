"""τ while it trains (``dflash_pipeline.evaluation.segment_tau``): a segment's checkpoint measured in
evaluate's speculative-decoding loop without an export, its record checked and read back, drawn
beside the loss in the report and on the status page, and its cost counted by the plan. The
demo workflow's segments are measured in tests/test_status_browser.py."""

from __future__ import annotations

import json
import math
import time

import pytest
import yaml

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.core.storage import LocalStorage
from dflash_pipeline.evaluation import segment_tau
from dflash_pipeline.evaluation.segment_tau import SegmentTauError, check_record, read_segment_taus
from dflash_pipeline.report import figures, targets
from dflash_pipeline.status.summaries import training_summary
from tests.support.engine_envs import REPO


def record(tau, step=100, block_size=8, **extra) -> dict:
    return {"segment": 0, "step": step, "tau": tau, "block_size": block_size, "seconds": 2.0, **extra}


@pytest.mark.parametrize(
    "bad, reason",
    [
        (record(math.nan), "not a finite number"),
        (record(math.inf), "not a finite number"),
        (record(None), "not a finite number"),
        (record(True), "not a finite number"),
        (record(0.9), "outside [1, 8]"),
        (record(8.5), "outside [1, 8]"),
        ([1.5], "not a JSON object"),
    ],
)
def test_a_record_without_a_tau_the_loop_can_give_is_refused_naming_it(bad, reason):
    with pytest.raises(SegmentTauError) as err:
        check_record(bad, "outputs/segment_tau-0000.json")
    assert str(err.value).startswith("outputs/segment_tau-0000.json: ") and reason in str(err.value)
    assert check_record(record(1.0), "x")["tau"] == 1.0 and check_record(record(8), "x")["tau"] == 8


def test_records_are_read_back_per_segment_and_a_broken_one_is_named(tmp_path):
    run = LocalStorage(tmp_path)
    run.write_text(layout.segment_tau_key(0), json.dumps(record(2.5)))
    run.write_text(layout.segment_tau_key(2), json.dumps(record(3.0, step=300)))
    assert {k: r["tau"] for k, r in read_segment_taus(run, range(3)).items()} == {0: 2.5, 2: 3.0}
    assert segment_tau.measured_seconds(run, range(3)) == [2.0, 2.0]
    run.write_text(layout.segment_tau_key(1), "{not json")
    with pytest.raises(SegmentTauError, match=r"segment_tau-0001\.json: not JSON"):
        read_segment_taus(run, range(3))


def demo_config(**train) -> dict:
    config = yaml.safe_load((REPO / "config.yaml").read_text())
    config["train"].update(train)
    return validate_config(config)


def test_the_budget_has_defaults_and_bounds_in_the_schema():
    budget = validate_config({})["train"]["segment_eval"]
    assert budget == {"enabled": True, "prompts": 4, "max_new_tokens": 64}
    from dflash_pipeline.core.config import ConfigError

    with pytest.raises(ConfigError, match="train.segment_eval.prompts"):
        validate_config({"train": {"segment_eval": {"prompts": 0}}})
    with pytest.raises(ConfigError, match="train.segment_eval.max_new_tokens"):
        validate_config({"train": {"segment_eval": {"max_new_tokens": 100000}}})


def test_every_segment_is_measured_and_counted_unless_it_is_off():
    config = demo_config(segments=3)
    keys = [f"outputs/segment_tau-000{k}.json" for k in range(3)]
    assert targets.run_outputs(config)["segment_tau"] == keys
    assert set(keys) <= set(targets.final_keys(config))
    assert "outputs/benchmark.segment_tau-0002.tsv" in targets.headline_benchmarks(config)
    off = demo_config(segments=3, segment_eval={"enabled": False})
    assert "segment_tau" not in targets.run_outputs(off) and targets.segment_tau_keys(off) == []
    assert segment_tau.segment_tau_cost(off, 10**9)["jobs"] == 0


def test_the_plan_counts_the_cost_measured_or_assumed():
    config = demo_config(segments=3, segment_eval={"prompts": 2, "max_new_tokens": 50})
    # 2 GB of weights: loaded at 1 GB/s, then 100 forwards reading them at 2 TB/s.
    assumed = segment_tau.segment_tau_cost(config, 2 * 10**9)
    assert assumed["jobs"] == 3 and assumed["tokens_per_job"] == 100
    assert assumed["seconds_per_job"]["value"] == pytest.approx(2.0 + 100 * 2e9 / 2e12)
    assert assumed["seconds_per_job"]["source"].startswith("assumed")
    assert assumed["gpu_hours"] == pytest.approx(3 * 2.1 / 3600)
    measured = segment_tau.segment_tau_cost(config, 2 * 10**9, [10.0, 20.0])
    assert measured["seconds_per_job"] == {"value": 15.0, "source": "2 measured segment(s)"}
    assert segment_tau.segment_tau_cost(config, None)["gpu_hours"] is None


def test_the_plan_prints_the_line(tmp_path):
    from dflash_pipeline.stages import plan as plan_stage

    config = demo_config(segments=2)
    config["plan"]["prompts"] = 100
    made = plan_stage.make_plan(config, plan_stage.Measured(), 1)
    assert made["segment_tau"]["jobs"] == 2
    text = plan_stage.format_plan(made)
    assert "segment τ          2 jobs of 4 prompts x 64 tokens" in text, text


def test_the_training_figure_draws_each_segments_tau_beside_the_loss(tmp_path):
    run = LocalStorage(tmp_path)
    for segment in (0, 1):
        steps = range(segment * 10 + 1, segment * 10 + 11)
        run.write_text(
            layout.train_progress_prefix(segment) + layout.TRAIN_METRICS,
            "".join(json.dumps({"step": s, "loss": 5.0 / s, "accept_len": 1.5}) + "\n" for s in steps),
        )
    taus = [tmp_path / "tau-0.json", tmp_path / "tau-1.json"]
    taus[0].write_text(json.dumps(record(1.84, step=10)))
    taus[1].write_text(json.dumps(record(2.37, step=20)))
    out = tmp_path / "training.svg"
    figures.write_training_report(str(tmp_path), range(2), out, taus)
    svg = out.read_text()
    assert "τ 1.84" in svg and "τ 2.37" in svg and "τ per segment (loop)" in svg
    taus[1].write_text(json.dumps(record(math.nan, step=20)))
    with pytest.raises(SegmentTauError, match="tau-1.json: tau nan"):
        figures.write_training_report(str(tmp_path), range(2), out, taus)


def test_the_status_page_shows_a_segments_tau_only_once_it_is_this_segments():
    now = time.time()
    segments = {0: {"done": True, "manifest_at": now - 100}, 1: {"done": True, "manifest_at": now}}
    found = {0: (record(1.9, step=10), now - 50), 1: (record(2.4, step=20), now - 10)}
    summary = training_summary(segments, found)
    # Segment 1's record is older than its manifest: from before that segment was retrained.
    assert [row["tau"] for row in summary["segments"]] == [1.9, None]
    assert summary["segment_taus"] == [{"segment": "0000", "step": 10, "tau": 1.9}]
    # A broken record shows nothing rather than a wrong number.
    assert training_summary(segments, {0: ({"tau": "x"}, now)})["segment_taus"] == []
    assert training_summary(segments)["segment_taus"] == []


def test_a_checkpoint_measures_what_evaluates_loop_measures_on_its_export(demo_model, tmp_path):
    """Built from the checkpoint's weights (no export), the segment's drafter decodes the held-out
    prompts as evaluate's loop decodes them with the exported drafter: the same τ per prompt,
    greedy and sampled (the same seed per prompt)."""
    import torch

    from dflash_pipeline.evaluation.transformers_loop import EvalOptions
    from dflash_pipeline.stages.evaluate import run_evaluation
    from dflash_pipeline.stages.export import export_drafter
    from tests.test_speculators_export import drafter_config, write_run

    torch.set_num_threads(1)
    manifest = write_run(tmp_path, drafter_config(demo_model, "full"))
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "steps": [0, 40]}))
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"id": f"q{i}", "split": split, "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]}
        for i, split in enumerate(["train", "heldout", "heldout", "heldout"])
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / layout.segment_tau_key(0)
    settings = {"prompts": 2, "max_new_tokens": 24, "temperature": 0.0}
    found = segment_tau.run_segment_tau(
        str(tmp_path), 0, str(manifest), str(demo_model), str(prompts), out, settings, thinking=False
    )
    assert json.loads(out.read_text()) == found
    assert found["segment"] == 0 and found["step"] == 39 and found["prompts"] == 2
    assert [p["id"] for p in found["per_prompt"]] == ["q1", "q2"]
    assert math.isfinite(found["tau"]) and 1.0 <= found["tau"] <= 8
    drafter = tmp_path / "drafter"
    export_drafter(
        str(tmp_path), str(manifest), str(drafter / "config.json"), str(drafter / "model.safetensors"), "float32"
    )
    options = EvalOptions(max_new_tokens=24, thinking=False, limit=2, split="heldout", warmup=False)
    evaluated = run_evaluation(demo_model, drafter, prompts, tmp_path / "metrics.json", options)
    assert [p["tau"] for p in found["per_prompt"]] == [p["tau"] for p in evaluated["per_prompt"]]
    assert found["tau"] == evaluated["overall"]["tau"]
    # Sampled, the same too: each prompt drawn with evaluate's seed for it (evaluate.seed + index).
    sampled = segment_tau.run_segment_tau(
        str(tmp_path), 0, str(manifest), str(demo_model), str(prompts), out, {**settings, "temperature": 0.9},
        thinking=False,
    )  # fmt: skip
    options.temperature = 0.9
    evaluated = run_evaluation(demo_model, drafter, prompts, tmp_path / "metrics.json", options)
    assert [p["tau"] for p in sampled["per_prompt"]] == [p["tau"] for p in evaluated["per_prompt"]]
