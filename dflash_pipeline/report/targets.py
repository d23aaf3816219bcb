"""What a run builds for its report, as keys of the run root: the figures and tables of the stages
it builds, what the headline reads, and what the storage figure (made last) waits for. The rules
(rules/report.smk) and the default target ask for these; each key is mapped to the run's storage
there.
"""

from __future__ import annotations

from dflash_pipeline.core import layout

# The table of tune's measurements, where the run tunes (its input is the tune result).
TUNE_ITEM = "tune.html"
# The report's figures and tables per stage (rules/report.smk); extract has none of its own.
ITEMS = {
    "prepare": ["prompts.svg", "prompts.html"],
    "tune": [TUNE_ITEM],
    "generate": ["generation-throughput.svg", "generation-lengths.svg", "generation-finish.svg"],
    "tokenize": ["tokenization-supervised.svg", "tokenization-degenerate.svg", "tokenization.html"],
    "extract": [],
    "train": ["training.svg"],
    "evaluate": ["acceptance.svg"],
}
# Made once everything else exists: the run's objects by category.
STORAGE_ITEM = "storage.svg"
# The run's headline figures, whatever `until` is.
HEADLINE_ITEM = "headline.html"


def storage_figure_inputs(config: dict) -> list[str]:
    """Everything ``until`` asks for (its stage's shards, or the drafter, or the evaluation), with
    the report items of the stages the run builds (``layout.stages_built``; the tune table where
    it tunes): the storage figure is made once all of it exists."""
    built = layout.stages_built(config)
    keys = [layout.INGEST_SUMMARY]
    if config["until"] in ("prepare", "generate", "tokenize"):
        keys += [layout.shard_key(config["until"], shard) for shard in range(config["num_shards"])]
    if "train" in built:
        keys += [layout.DRAFTER_CONFIG, layout.DRAFTER_WEIGHTS]
    if "evaluate" in built:
        keys.append(layout.EVAL_METRICS)
    for stage in built:
        keys += [layout.report_key(name) for name in ITEMS[stage]]
    keys.append(layout.report_key(HEADLINE_ITEM))
    return keys


def final_keys(config: dict) -> list[str]:
    """What the default target asks of the run root: the storage figure and what it waits for."""
    return [*storage_figure_inputs(config), layout.report_key(STORAGE_ITEM)]


def headline_benchmarks(config: dict) -> list[str]:
    """The benchmark files of the GPU jobs the run builds, for the headline's GPU-hours (the GPUs
    each job held are read from the config by the job: an operational key, no rerun)."""
    shards = range(config["num_shards"])
    keys = []
    for stage in layout.stages_built(config):
        if stage == "tune" or stage == "evaluate":
            keys.append(layout.benchmark_key(stage))
        elif stage in ("generate", "extract"):
            keys += [layout.benchmark_key(stage, shard) for shard in shards]
        elif stage == "train":
            segments = range(config["train"]["segments"])
            keys += [layout.benchmark_key("train", layout.segment_name(k)) for k in segments]
    return keys


def headline_inputs(config: dict) -> dict[str, list[str] | str]:
    """What the headline reads of the stages the run builds (none past ``until``): lists of
    keys, and the evaluation's metrics as one key."""
    built = layout.stages_built(config)
    inputs = {"benchmarks": headline_benchmarks(config)}
    if "generate" in built:
        inputs["generated"] = [layout.shard_key("generate", shard) for shard in range(config["num_shards"])]
    if "evaluate" in built:
        inputs["metrics"] = layout.EVAL_METRICS
    return inputs
