# The input functions of the rules whose inputs depend on the run (the config, or the run's
# storage for the order of tune and generate), and the run's default target: what it builds, as
# keys of the run root (dflash_pipeline.report.targets) mapped to its storage here.
import functools

from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.engines.tuning import generate_waits_for_tune
from dflash_pipeline.report import targets as report_targets


def tune_prompt_shards():
    """The prepare shards whose prompts tune replays (the first few)."""
    count = min(config["num_shards"], config["tune"]["prompt_shards"])
    return [shard_output("prepare").format(shard=shard) for shard in SHARDS[:count]]


@functools.cache
def stored_order():
    """The run's storage asked once per process (an object exists, one key listed)."""
    return generate_waits_for_tune(open_storage(RUN_URL))


def tune_orders_generate():
    """Whether generate waits for tune (dflash_pipeline.engines.tuning.generate_waits_for_tune).
    Only the driver of a run or a dry-run asks the run's storage, once: a job's own process has
    no order to keep, and a report reads the order of a run that tunes first."""
    if "tune" not in layout.stages_built(config) or not workflow.is_main_process:
        return False
    return workflow.executor_plugin is None or stored_order()


def tune_input(wildcards):
    return (
        {"tune": ancient(run_path(layout.TUNE_RESULT))}
        if tune_orders_generate()
        else {}
    )


def train_inputs(wildcards):
    segment = int(wildcards.segment)
    inputs = {"tokenized": expand(shard_output("tokenize"), shard=SHARDS)}
    if segment > 0:
        inputs["previous"] = segment_manifest(segment - 1)
    if config["train"]["mode"] == "offline":
        inputs["hidden"] = expand(shard_output("extract"), shard=SHARDS)
    inputs.update(target_model_input(wildcards))
    return inputs


def report_storage_inputs():
    """Everything the run builds but the storage figure, which is made once all of it exists."""
    keys = report_targets.storage_figure_inputs(config)
    return [run_path(key) for key in keys]


def headline_inputs(wildcards):
    """What the headline reads of the stages the run builds (none past `until`)."""
    found = report_targets.headline_inputs(config)
    return {
        name: run_path(keys) if isinstance(keys, str) else [run_path(k) for k in keys]
        for name, keys in found.items()
    }


def get_final_output():
    # Every tracked output lives in one folder, so the S3 plugin's single listing covers the
    # whole run (dflash_pipeline.core.layout). `until` names the last stage built by default.
    outputs = [run_path(key) for key in report_targets.final_keys(config)]
    if config["target"]["build_demo"]:
        outputs.append(local(config["target"]["model"]))
    return outputs
