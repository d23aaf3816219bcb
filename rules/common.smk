# The one place that validates the config, names every path and wires the GPU slot wrapper.
import sys

# Import the package from this checkout even where it is not pip-installed (e.g. conda envs).
sys.path.insert(0, workflow.basedir)

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import ConfigError, rule_params, validate_config
from dflash_pipeline.core.gpu_slots import pool_from_config
from dflash_pipeline.core.jobstate import describe_halt, read_halt
from dflash_pipeline.core.lease import LeaseHeld, LeaseLost, RunLease
from dflash_pipeline.core.resources import job_memory_mb
from dflash_pipeline.core.planning import (
    collect_as_usual,
    collect_rarely,
    install_planning_patches,
)
from dflash_pipeline.core.s3_inventory import install_folder_inventory
from dflash_pipeline.core.storage import S3Storage, is_s3_url, open_storage

# Planning against S3 reads absence from folder listings (one request per 1,000 objects, not
# three per missing object); see dflash_pipeline/core/s3_inventory.py.
install_folder_inventory()
# Planning 10,000s of jobs: Snakemake's per-job checks without repeats, and the garbage collector
# held back until the plan is built (dflash_pipeline.core.planning).
install_planning_patches()
collect_rarely()

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


def check_offline_budget():
    """Offline mode above train.offline_max_bytes stops the plan (dflash_pipeline.training.offline);
    it is checked again when a training job starts."""
    from dflash_pipeline.training.offline import OfflineBudgetError, check_run

    if config["train"]["mode"] != "offline" or config["until"] not in (
        "train",
        "evaluate",
    ):
        return
    try:
        check_run(config, open_storage(RUN_URL))
    except OfflineBudgetError as err:
        raise ValueError(
            f"{err}\n(check config.yaml or the file given with --configfile)"
        ) from None


check_offline_budget()


def preflight():
    """What would fail the run days in, refused now, one line per problem: the target folder,
    the dataset files, the storage, the engines (dflash_pipeline.stages.preflight)."""
    from dflash_pipeline.stages.preflight import run_problems

    problems, ready = run_problems(config, RUN_URL)
    if problems:
        raise ValueError(
            "\n".join(problems)
            + "\n(check config.yaml or the file given with --configfile)"
        )
    for line in ready:
        logger.info(line)


preflight()


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
    stages = ["prepare", "generate", "tokenize", "train", "evaluate"]
    until = stages.index(config["until"])
    outputs = [run_path(layout.INGEST_SUMMARY)]
    for index, stage in enumerate(["prepare", "generate", "tokenize"]):
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


def start_status_page():
    """The live status page in the background (config key status.serve); it keeps serving
    after the run ends, and does nothing if one already serves this port."""
    import os
    import subprocess

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (workflow.basedir, env.get("PYTHONPATH")) if p
    )
    status = config["status"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.status",
            "start",
            "--run-url",
            RUN_URL,
            "--num-shards",
            str(config["num_shards"]),
            "--num-segments",
            str(config["train"]["segments"]),
            "--until",
            config["until"],
            "--host",
            status["host"],
            "--port",
            str(status["port"]),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    message = (proc.stdout + proc.stderr).strip()
    (logger.info if proc.returncode == 0 else logger.warning)(message)


def log_halt(prefix):
    """Say why generate/extract/train jobs refuse: the run's halt (a tokenize shard failed the
    data-quality gate; dflash_pipeline.core.jobstate). The jobs enforce it, keep-going or not.
    """
    run_storage = open_storage(RUN_URL)
    halt = read_halt(run_storage)
    if halt is not None:
        logger.error(f"{prefix}: {describe_halt(halt, run_storage)}")


# This driver's run lease (dflash_pipeline.core.lease), taken in onstart: only real executions
# run onstart (not dry-runs, --lint, reports, nor the jobs' own Snakemake processes).
RUN_LEASE = []


def lease_trouble(err):
    """The heartbeat failed. Lost (another driver took the run over): stop this driver, as
    Ctrl-C would (Snakemake's SIGTERM handler cancels the running jobs)."""
    import os
    import signal

    if isinstance(err, LeaseLost):
        logger.error(f"{err}: this driver stops so that only one drives the run")
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        logger.warning(f"run lease heartbeat failed (retried at the next beat): {err}")


def take_run_lease():
    if not config["lease"]["enabled"]:
        return
    try:
        lease = RunLease(
            open_storage(RUN_URL), ttl_s=config["lease"]["ttl_s"]
        ).acquire()
    except LeaseHeld as err:
        logger.error(str(err))
        raise SystemExit(1) from None
    if lease.took_over is not None:
        logger.warning(f"took over a stale run lease: {lease.took_over.get('owner')}")
    lease.start_heartbeat(lease_trouble)
    RUN_LEASE.append(lease)


def release_run_lease():
    while RUN_LEASE:
        RUN_LEASE.pop().release()


onstart:
    # The plan is built: the driver collects garbage as usual for the days of the run.
    collect_as_usual()
    if DEFAULT_STORAGE == "s3":
        # The S3 plugin deletes a bucket once it is empty; keep one object in it for good.
        S3Storage(RUN_URL).ensure_bucket()
    take_run_lease()
    log_halt("generate, extract and train jobs will refuse to start")
    if config["status"]["serve"]:
        start_status_page()


onsuccess:
    release_run_lease()


onerror:
    release_run_lease()
    log_halt("the run stopped")
