"""What a run builds for its report, as keys of the run root: the figures and tables of the stages
it builds, what the headline reads, and what the storage figure (made last) waits for. The rules
(rules/report.smk) and the default target ask for these; each key is mapped to the run's storage
there.
"""

from __future__ import annotations

from dflash_pipeline.core import layout

# The report's figures and tables per stage (rules/report.smk).
ITEMS = {
    "prepare": ["prompts.svg", "prompts.html"],
    "generate": ["generation-throughput.svg", "generation-lengths.svg", "generation-finish.svg"],
    "tokenize": ["tokenization-supervised.svg", "tokenization-degenerate.svg", "tokenization.html"],
    "train": ["training.svg"],
    "evaluate": ["acceptance.svg"],
}
# Made once everything else exists: the run's objects by category.
STORAGE_ITEM = "storage.svg"
# The table of tune's measurements, where the run tunes (its input is the tune result).
TUNE_ITEM = "tune.html"
# The run's headline figures, whatever `until` is.
HEADLINE_ITEM = "headline.html"


def _builds(config: dict, stage: str) -> bool:
    return layout.STAGES.index(config["until"]) >= layout.STAGES.index(stage)


def storage_figure_inputs(config: dict, tunes: bool) -> list[str]:
    """Everything ``until`` asks for (its stage's shards, or the drafter, or the evaluation), with
    the report items of the stages the run builds: the storage figure is made once all of it
    exists. ``tunes``: whether the run measures its engine (engines.tuning.tune_runs)."""
    shards = range(config["num_shards"])
    keys = [layout.INGEST_SUMMARY]
    if config["until"] in ("prepare", "generate", "tokenize"):
        keys += [layout.shard_key(config["until"], shard) for shard in shards]
    if _builds(config, "train"):
        keys += [layout.DRAFTER_CONFIG, layout.DRAFTER_WEIGHTS]
    if _builds(config, "evaluate"):
        keys.append(layout.EVAL_METRICS)
    for stage in layout.STAGES[: layout.STAGES.index(config["until"]) + 1]:
        keys += [layout.report_key(name) for name in ITEMS[stage]]
    if tunes:
        keys.append(layout.report_key(TUNE_ITEM))
    keys.append(layout.report_key(HEADLINE_ITEM))
    return keys


def final_keys(config: dict, tunes: bool) -> list[str]:
    """What the default target asks of the run root: the storage figure and what it waits for."""
    return [*storage_figure_inputs(config, tunes), layout.report_key(STORAGE_ITEM)]


def headline_benchmarks(config: dict, tunes: bool) -> list[str]:
    """The benchmark files of the GPU jobs the run builds, for the headline's GPU-hours (the GPUs
    each job held are read from the config by the job: an operational key, no rerun)."""
    shards = range(config["num_shards"])
    keys = [layout.benchmark_key("tune")] if tunes else []
    if _builds(config, "generate"):
        keys += [layout.benchmark_key("generate", shard) for shard in shards]
    if _builds(config, "train"):
        if config["train"]["mode"] == "offline":
            keys += [layout.benchmark_key("extract", shard) for shard in shards]
        keys += [layout.benchmark_key("train", layout.segment_name(k)) for k in range(config["train"]["segments"])]
    if _builds(config, "evaluate"):
        keys.append(layout.benchmark_key("evaluate"))
    return keys


def headline_inputs(config: dict, tunes: bool) -> dict[str, list[str] | str]:
    """What the headline reads of the stages the run builds (none past ``until``): lists of
    keys, and the evaluation's metrics as one key."""
    inputs = {"benchmarks": headline_benchmarks(config, tunes)}
    if _builds(config, "generate"):
        inputs["generated"] = [layout.shard_key("generate", shard) for shard in range(config["num_shards"])]
    if _builds(config, "evaluate"):
        inputs["metrics"] = layout.EVAL_METRICS
    return inputs
