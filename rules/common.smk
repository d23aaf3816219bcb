# The config, validated, and every path, input function and resource of the rules (run control:
# rules/run_control.smk).
import sys

# Import the package from this checkout even where it is not pip-installed (e.g. conda envs).
sys.path.insert(0, workflow.basedir)

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import ConfigError, rule_params, validate_config
from dflash_pipeline.core.gpu_slots import pool_from_config
from dflash_pipeline.core.resources import job_memory_mb
from dflash_pipeline.core.storage import is_s3_url

try:
    config.update(validate_config(config))
except ConfigError as err:
    raise ValueError(
        f"{err}\n(check config.yaml or the file given with --configfile)"
    ) from None


RUN_ROOT = layout.run_root(config["results_dir"], config["run"])
SHARDS = [layout.shard_name(i) for i in range(config["num_shards"])]
DEFAULT_STORAGE = workflow.storage_settings.default_storage_provider
# Where jobs write objects that Snakemake does not track (_progress/, checkpoints, big shards):
# the same place Snakemake puts the run's outputs, local or S3. Jobs get it as a parameter.
RUN_URL = layout.run_url(
    RUN_ROOT, DEFAULT_STORAGE, workflow.storage_settings.default_storage_prefix
)


wildcard_constraints:
    shard=r"\d{5}",
    segment=r"\d{4}",


def run_path(key):
    """Path of an artifact of this run (mapped to S3 by the s3 profile)."""
    return f"{RUN_ROOT}/{key}"


def shard_output(stage, ext=None):
    return run_path(layout.shard_key(stage, "{shard}", ext))


def segment_manifest(segment):
    return run_path(layout.segment_manifest_key(segment))


def log_path(rule_name, per_shard=True):
    name = f"{rule_name}/{{shard}}.log" if per_shard else f"{rule_name}.log"
    return run_path(f"{layout.LOGS_DIR}/{name}")


def benchmark_path(rule_name, per_shard=True):
    # In the outputs folder: Snakemake checks benchmark files during a dry-run, and only that
    # folder is covered by the S3 plugin's one listing (dflash_pipeline.core.layout).
    return run_path(layout.benchmark_key(rule_name, "{shard}" if per_shard else None))


def local_dataset_files():
    """Local dataset files, as inputs that stay local even in S3 runs (so edits trigger a new
    ingest). s3:// dataset URLs are read by the job itself through the storage layer."""
    return [local(path) for path in config["dataset"]["paths"] if not is_s3_url(path)]


# GPU slots: Snakemake counts `gpu`; the wrapper picks the devices (see dflash_pipeline.core.gpu_slots).
# Jobs find the pool the same way from the config: it is no param (no rerun trigger).
GPU_POOL, GPU_LOCK_DIR = pool_from_config(config)
# `--resources gpu=N` (absent: Snakemake ignores the gpu resource altogether).
_gpu_limit = getattr(workflow.global_resources.get("gpu"), "value", None)
if _gpu_limit is not None and int(_gpu_limit) > GPU_POOL:
    logger.warning(
        f"--resources gpu={_gpu_limit} exceeds the GPU pool ({GPU_POOL}, config key `gpus`): "
        "GPU jobs will wait for free devices"
    )


# Host memory per job from the target's and the drafter's sizes (dflash_pipeline.core.resources).
JOB_MEMORY_MB = job_memory_mb(config)


def slurm(gpus):
    """The SLURM resources of a job that takes `gpus` GPUs (profiles/slurm; other executors
    ignore them): its partition, and the account, QoS and GPU node constraint of the config.
    """
    settings = config["slurm"]
    found = {"slurm_partition": settings["gpu_partition" if gpus else "cpu_partition"]}
    if settings["account"]:
        found["slurm_account"] = settings["account"]
    if settings["qos"]:
        found["qos"] = settings["qos"]
    if gpus and settings["gpu_constraint"]:
        found["constraint"] = settings["gpu_constraint"]
    return found


def target_model_input(wildcards):
    """The demo target is built by a rule; a real target is a folder the user provides."""
    return (
        {"model": local(config["target"]["model"])}
        if config["target"]["build_demo"]
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


# The report's figures and tables per stage (rules/report.smk); the storage figure comes last,
# once everything else exists.
REPORT_ITEMS = {
    "prepare": ["prompts.svg", "prompts.html"],
    "generate": [
        "generation-throughput.svg",
        "generation-lengths.svg",
        "generation-finish.svg",
    ],
    "tokenize": [
        "tokenization-supervised.svg",
        "tokenization-degenerate.svg",
        "tokenization.html",
    ],
    "train": ["training.svg"],
    "evaluate": ["acceptance.svg"],
}
REPORT_STORAGE_ITEM = "storage.svg"


def report_storage_inputs():
    """Everything `until` asks for, with the report figures of the stages it builds: the
    storage figure is made once all of it exists."""
    stages = layout.STAGES
    until = stages.index(config["until"])
    outputs = [run_path(layout.INGEST_SUMMARY)]
    for index, stage in enumerate(stages[: stages.index("train")]):
        if until == index:
            outputs += expand(shard_output(stage), shard=SHARDS)
    if until >= stages.index("train"):
        outputs += [run_path(layout.DRAFTER_CONFIG), run_path(layout.DRAFTER_WEIGHTS)]
    if until >= stages.index("evaluate"):
        outputs.append(run_path(layout.EVAL_METRICS))
    for stage in stages[: until + 1]:
        outputs += [run_path(layout.report_key(name)) for name in REPORT_ITEMS[stage]]
    return outputs


def get_final_output():
    # Every tracked output lives in one folder, so the S3 plugin's single listing covers the
    # whole run (dflash_pipeline.core.layout). `until` names the last stage built by default.
    outputs = report_storage_inputs()
    outputs.append(run_path(layout.report_key(REPORT_STORAGE_ITEM)))
    if config["target"]["build_demo"]:
        outputs.append(local(config["target"]["model"]))
    return outputs
