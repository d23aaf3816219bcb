"""What a run builds, as keys of the run root: every object its rules declare (``run_outputs``,
what verify expects of a finished run), the figures and tables of the stages it builds, what the
headline reads, and what the storage figure (made last) waits for. The rules (rules/report.smk)
and the default target ask for these; each key is mapped to the run's storage there.
"""

from __future__ import annotations

from dflash_pipeline.core import layout
from dflash_pipeline.model import speculators_format

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
# The rule that makes each stage's report items (rules/report.smk).
REPORT_RULES = {
    "prepare": "report_prompts",
    "tune": "report_tune",
    "generate": "report_generation",
    "tokenize": "report_tokenization",
    "train": "report_training",
    "evaluate": "report_evaluation",
}
# The objects of each tokenize shard besides the tokenized rows (rules/tokenize.smk).
TOKENIZE_EXTS = (layout.SHARD_STAGES["tokenize"], "stats.json", layout.TOKENIZE_HELDOUT_EXT)
# Made once everything else exists: the run's objects by category.
STORAGE_ITEM = "storage.svg"
# The run's headline figures, whatever `until` is.
HEADLINE_ITEM = "headline.html"


def segments_measured(config: dict) -> range:
    """The training segments whose checkpoint rule segment_tau measures (train.segment_eval):
    every one, or none where it is off."""
    train = config["train"]
    return range(train["segments"] if train["segment_eval"]["enabled"] else 0)


def segment_tau_keys(config: dict) -> list[str]:
    """The records of rule segment_tau, one per measured segment; the training figure reads them."""
    return [layout.segment_tau_key(k) for k in segments_measured(config)]


def storage_figure_inputs(config: dict) -> list[str]:
    """Everything ``until`` asks for (its stage's shards, or the drafter, or the evaluation), with
    the report items of the stages the run builds (``layout.stages_built``; the tune table where
    it tunes): the storage figure is made once all of it exists."""
    built = layout.stages_built(config)
    keys = [layout.INGEST_SUMMARY]
    if config["until"] in ("prepare", "generate", "tokenize"):
        keys += [layout.shard_key(config["until"], shard) for shard in range(config["num_shards"])]
    if "train" in built:
        keys += [layout.DRAFTER_CONFIG, layout.DRAFTER_WEIGHTS, *segment_tau_keys(config)]
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
            keys += [layout.benchmark_key("segment_tau", layout.segment_name(k)) for k in segments_measured(config)]
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


def run_outputs(config: dict) -> dict[str, list[str]]:
    """Every object a finished run of ``config`` (a validated config) holds, per rule, in the
    run root: the declared outputs of each job the run builds (``layout.stages_built``), shard by
    shard and segment by segment. Logs and benchmarks are not among them. The export holds the
    speculators format beside the z-lab one only for a drafter that format expresses
    (``speculators_format.run_outputs``). tests/test_run_outputs.py holds it to the rules' own
    outputs, as a dry run of the workflow lists them."""
    built = layout.stages_built(config)
    shards = range(config["num_shards"])
    outputs: dict[str, list[str]] = {
        "ingest": [layout.INGESTED_PROMPTS, layout.INGEST_SUMMARY, layout.QUARANTINE],
    }
    for stage in built:
        if stage in ("prepare", "generate", "extract"):
            outputs[stage] = [layout.shard_key(stage, shard) for shard in shards]
        elif stage == "tokenize":
            outputs[stage] = [layout.shard_key(stage, shard, ext) for shard in shards for ext in TOKENIZE_EXTS]
        elif stage == "tune":
            outputs[stage] = [layout.TUNE_RESULT]
        elif stage == "train":
            outputs[stage] = [layout.segment_manifest_key(k) for k in range(config["train"]["segments"])]
            if segment_tau_keys(config):
                outputs["segment_tau"] = segment_tau_keys(config)
            speculators = speculators_format.run_outputs(config["train"]["layer_types"])
            outputs["export"] = [*speculators.values(), layout.DRAFTER_CONFIG, layout.DRAFTER_WEIGHTS]
        elif stage == "evaluate":
            outputs[stage] = [layout.EVAL_METRICS]
        if ITEMS[stage]:
            outputs[REPORT_RULES[stage]] = [layout.report_key(name) for name in ITEMS[stage]]
    outputs["report_headline"] = [layout.report_key(HEADLINE_ITEM)]
    outputs["report_storage"] = [layout.report_key(STORAGE_ITEM)]
    return outputs
