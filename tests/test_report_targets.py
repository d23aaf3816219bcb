"""What a run builds for its report, as keys of the run root (dflash_pipeline.report.targets): the
items of the stages up to `until`, the tune table where the run tunes, the headline's inputs of
the stages built, and the storage figure last."""

from __future__ import annotations

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.report import targets


def config(tunes: bool = False, **changes) -> dict:
    return validate_config({"num_shards": 2, "tune": {"enabled": tunes}, **changes})


def test_a_run_up_to_tokenize_asks_for_its_shards_and_the_items_of_three_stages():
    keys = targets.final_keys(config(until="tokenize"))
    assert keys[0] == layout.INGEST_SUMMARY and keys[-1] == layout.report_key(targets.STORAGE_ITEM)
    assert [layout.shard_key("tokenize", 0), layout.shard_key("tokenize", 1)] == keys[1:3]
    items = [k for k in keys if k.startswith(layout.report_key(""))]
    expected = targets.ITEMS["prepare"] + targets.ITEMS["generate"] + targets.ITEMS["tokenize"]
    expected += [targets.HEADLINE_ITEM, targets.STORAGE_ITEM]
    assert items == [layout.report_key(name) for name in expected]
    assert not any(k.startswith(layout.DRAFTER_DIR) for k in keys)


def test_a_full_run_asks_for_the_drafter_the_evaluation_and_the_tune_table_where_it_tunes():
    keys = targets.storage_figure_inputs(config(tunes=True, until="evaluate"))
    assert {layout.DRAFTER_CONFIG, layout.DRAFTER_WEIGHTS, layout.EVAL_METRICS} <= set(keys)
    assert layout.report_key(targets.TUNE_ITEM) in keys
    assert layout.report_key(targets.STORAGE_ITEM) not in keys  # made once all of these exist
    assert not any(k.startswith(f"{layout.OUTPUTS_DIR}/tokenize-") for k in keys)
    assert layout.report_key(targets.TUNE_ITEM) not in targets.storage_figure_inputs(config())


def test_the_headline_reads_the_stages_built_and_the_gpu_jobs_benchmarks():
    offline = config(tunes=True, until="evaluate", train={"mode": "offline", "segments": 2})
    found = targets.headline_inputs(offline)
    assert found["metrics"] == layout.EVAL_METRICS
    assert found["generated"] == [layout.shard_key("generate", 0), layout.shard_key("generate", 1)]
    assert found["benchmarks"] == [
        layout.benchmark_key("tune"),
        layout.benchmark_key("generate", 0),
        layout.benchmark_key("generate", 1),
        layout.benchmark_key("extract", 0),
        layout.benchmark_key("extract", 1),
        layout.benchmark_key("train", "0000"),
        layout.benchmark_key("train", "0001"),
        # Each segment's τ in the loop takes one of training's GPUs too (rule segment_tau).
        layout.benchmark_key("segment_tau", "0000"),
        layout.benchmark_key("segment_tau", "0001"),
        layout.benchmark_key("evaluate"),
    ]
    assert targets.headline_inputs(config(tunes=True, until="prepare")) == {"benchmarks": []}
