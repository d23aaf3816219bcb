# The config, validated, and every path, input function and resource of the rules (run control:
# rules/run_control.smk).
import functools
import os
import sys

# Import the package from this checkout even where it is not pip-installed (e.g. conda envs).
sys.path.insert(0, workflow.basedir)

from dflash_pipeline.core import layout
from dflash_pipeline.core.config import ConfigError, rule_params, validate_config
from dflash_pipeline.core.gpu_slots import pool_from_config
from dflash_pipeline.core.resources import job_memory_mb
from dflash_pipeline.model import speculators_format
from dflash_pipeline.core.storage import is_s3_url, open_storage
from dflash_pipeline.engines.tuning import generate_waits_for_tune, tune_defining
from dflash_pipeline.snakemake_patches.refusals import install_refusal_patch
from dflash_pipeline.snakemake_patches.slurm_states import install_state_fix
from dflash_pipeline.core.credentials import protect_storage_credentials

# The driver and each job's Snakemake process hold the storage credentials in their environment:
# non-dumpable, so that no engine (same user) reads them from their /proc files; it also means no
# core dump and no debugger attach (py-spy) for them except as root (dflash_pipeline.core.credentials).
protect_storage_credentials()


def refuse(message):
    """Stop the workflow with ``message`` and the config it was read from, nothing else: an
    exception raised while the workflow is parsed comes wrapped in Snakemake's frame (file,
    line, stack) under an "in file rules/...smk" headline that hides the file to fix.
    """
    files = [
        os.path.relpath(p) if not os.path.relpath(p).startswith("..") else str(p)
        for p in workflow.overwrite_configfiles
    ] or ["config.yaml"]
    given = " and ".join(files) + (
        " and --config" if workflow.config_settings.config else ""
    )
    print(f"{message}\n(check {given})", file=sys.stderr)
    sys.exit(1)


try:
    config.update(validate_config(config))
except ConfigError as err:
    refuse(str(err))


RUN_ROOT = layout.run_root(config["results_dir"], config["run"])
SHARDS = [layout.shard_name(i) for i in range(config["num_shards"])]
DEFAULT_STORAGE = workflow.storage_settings.default_storage_provider
# Where jobs write objects that Snakemake does not track (_progress/, checkpoints, big shards):
# the same place Snakemake puts the run's outputs, local or S3. Jobs get it as a parameter.
RUN_URL = layout.run_url(
    RUN_ROOT, DEFAULT_STORAGE, workflow.storage_settings.default_storage_prefix
)
# A job that refused a damaged input is not retried: every attempt would fail alike
# (dflash_pipeline.snakemake_patches.refusals).
install_refusal_patch(RUN_URL)


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


def runs_locally(executor):
    """Whether this run's jobs run on this machine. A dry-run's executor is Snakemake's
    `dryrun` whatever the profile names; only for a remote executor (SLURM) does Snakemake turn
    on its threads for the run (snakemake.api's execute_workflow), which tells the two apart.
    """
    if executor.name == "dryrun":
        return not workflow.execution_settings.use_threads
    return executor.common_settings.local_exec


def warn_gpu_pool(executor):
    """`--resources gpu=N` above the pool the slot wrapper hands out makes a local run's GPU
    jobs wait; under SLURM the cluster gives each job its GPUs (no such wait): said locally only.
    """
    from dflash_pipeline.core.slurm import gpu_pool_warning

    # Absent `--resources gpu`: Snakemake ignores the gpu resource altogether.
    limit = getattr(workflow.global_resources.get("gpu"), "value", None)
    warning = gpu_pool_warning(limit, GPU_POOL, runs_locally(executor))
    if warning:
        logger.warning(warning)


# Host memory per job from the target's and the drafter's sizes (dflash_pipeline.core.resources);
# a SLURM run's driver caps each at the memory of the smallest node of the run's partitions.
JOB_MEMORY_MB = job_memory_mb(
    config,
    speculators_export=speculators_format.refusal(config["train"]["layer_types"])
    is None,
)


def job_memory(rule_name, gpus=0):
    """A job's mem_mb: its rule's figure, for a GPU job at least gpus x slurm.mem_per_gpu_mb,
    capped in a SLURM run's driver to the smallest node (dflash_pipeline.core.slurm.job_memory).
    """
    mb = JOB_MEMORY_MB[rule_name]
    return lambda wildcards: slurm_memory(mb, gpus)


def slurm_partition(gpus):
    return config["slurm"]["gpu_partition" if gpus else "cpu_partition"]


def slurm_partitions_used():
    """The partitions this run's jobs go to, each with the most GPUs one of its jobs asks for."""
    used = {slurm_partition(0): 0}
    train_gpus = config["train"]["gpus_per_job"]
    for gpus in (config["generation"]["gpus_per_job"], train_gpus, min(1, train_gpus)):
        if gpus:
            used[slurm_partition(gpus)] = max(used.get(slurm_partition(gpus), 0), gpus)
    return used


_SLURM_PLAN = []


def slurm_plan():
    """A SLURM run's driver asks the cluster what the executor plugin needs (accounting, the
    account, QoS, partitions, GPUs, the GPU constraint) once, when the first job's resources are
    evaluated, so before the first sbatch: a problem stops the run, the rest is said in one line
    (dflash_pipeline.core.slurm). None for any other executor, a dry-run, or a job's own process.
    """
    if _SLURM_PLAN:
        return _SLURM_PLAN[0]
    executor = workflow.executor_plugin
    if executor is None:  # still parsing: the executor is not known yet
        return None
    if workflow.is_main_process:
        # The first point where the executor is known (it is not while the Snakefile is parsed).
        warn_gpu_pool(executor)
    plan = None
    if workflow.is_main_process and executor.name == "slurm":
        from dflash_pipeline.core import slurm as slurm_checks

        try:
            plan = slurm_checks.check_cluster(
                config["slurm"],
                slurm_checks.read_cluster(),
                slurm_partitions_used(),
                getattr(workflow.executor_settings, "status_command", None) or "sacct",
            )
        except slurm_checks.SlurmClusterError as err:
            raise ValueError(f"SLURM: {err}") from None
        if plan.problems:
            raise ValueError(
                "\n".join(plan.problems)
                + "\n(check the config's `slurm` section, or the cluster)"
            )
        logger.info(plan.line)
        # A scancelled job ends for the plugin (dflash_pipeline.snakemake_patches.slurm_states).
        install_state_fix()
    _SLURM_PLAN.append(plan)
    return plan


def slurm_memory(mb, gpus=0):
    from dflash_pipeline.core.slurm import job_memory as memory_of_job

    plan = slurm_plan()
    node = min(plan.memory_caps.values(), default=0) if plan else 0
    return memory_of_job(mb, gpus, config["slurm"], node)


def slurm_cpus(partition, gpus):
    """A job's CPUs (sbatch --cpus-per-task): a CPU job's rule threads, a GPU job's
    gpus x slurm.cpus_per_gpu (null: the node's share), capped in the driver to the fewest CPUs
    of a node of its partition (or slurm.max_cpus_per_job), and inside a job to the allocation
    (the job-step plugin's srun asks for them again); dflash_pipeline.core.slurm.requested_cpus.
    Other executors ignore the resource (a local job's threads stay its rule's)."""
    from dflash_pipeline.core.slurm import cpus_in_this_job, requested_cpus

    def cpus(wildcards, threads):
        allocation = None if workflow.is_main_process else cpus_in_this_job()
        return requested_cpus(
            threads, gpus, config["slurm"], partition, slurm_plan(), allocation
        )

    return cpus


def slurm_account(wildcards):
    """slurm.account, else (accounting on) the user's default account from sacctmgr: the
    plugin's own guess fails on Slurm 22.05 and submits without one."""
    plan = slurm_plan()
    return config["slurm"]["account"] or (plan.account if plan else None)


def slurm(gpus):
    """The SLURM resources of a job that takes `gpus` GPUs (profiles/slurm; other executors
    ignore them): its partition, its CPUs, and the account, QoS and GPU node constraint.
    """
    settings = config["slurm"]
    partition = slurm_partition(gpus)
    found = {
        "slurm_partition": partition,
        "cpus_per_task": slurm_cpus(partition, gpus),
        "slurm_account": slurm_account,
    }
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


def tune_runs():
    """Whether the run measures its engine before generating (config tune.enabled; a server the
    run launches; a run that generates)."""
    return (
        config["tune"]["enabled"]
        and config["generation"]["engine"] != "endpoint"
        and layout.STAGES.index(config["until"]) >= layout.STAGES.index("generate")
    )


def tune_gpus():
    """A tune job's GPUs: one server's tensor parallelism (none on a CPU run)."""
    return (
        config["generation"]["server"]["tp"]
        if config["generation"]["gpus_per_job"]
        else 0
    )


def tune_prompt_shards():
    count = min(config["num_shards"], config["tune"]["prompt_shards"])
    return [shard_output("prepare").format(shard=shard) for shard in SHARDS[:count]]


@functools.cache
def tune_orders_generate():
    """Whether generate waits for tune (dflash_pipeline.engines.tuning.generate_waits_for_tune),
    decided once per parse."""
    return tune_runs() and generate_waits_for_tune(open_storage(RUN_URL))


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
# The table of tune's measurements, where the run tunes (its input is the tune result).
REPORT_TUNE_ITEM = "tune.html"
# The run's headline figures (rule report_headline), whatever `until` is.
REPORT_HEADLINE_ITEM = "headline.html"


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
    if tune_runs():
        outputs.append(run_path(layout.report_key(REPORT_TUNE_ITEM)))
    outputs.append(run_path(layout.report_key(REPORT_HEADLINE_ITEM)))
    return outputs


def headline_benchmarks():
    """The benchmark files of the GPU jobs the run builds, for the headline's GPU-hours (the
    GPUs each job held are read from the config by the job: an operational key, no rerun).
    """
    until = layout.STAGES.index(config["until"])
    found = [benchmark_path("tune", per_shard=False)] if tune_runs() else []
    if until >= layout.STAGES.index("generate"):
        found += expand(benchmark_path("generate"), shard=SHARDS)
    if until >= layout.STAGES.index("train"):
        if config["train"]["mode"] == "offline":
            found += expand(benchmark_path("extract"), shard=SHARDS)
        found += [
            run_path(layout.benchmark_key("train", layout.segment_name(k)))
            for k in range(config["train"]["segments"])
        ]
    if until >= layout.STAGES.index("evaluate"):
        found.append(benchmark_path("evaluate", per_shard=False))
    return found


def headline_inputs(wildcards):
    """What the headline reads of the stages the run builds (none past `until`)."""
    until = layout.STAGES.index(config["until"])
    inputs = {"benchmarks": headline_benchmarks()}
    if until >= layout.STAGES.index("generate"):
        inputs["generated"] = expand(shard_output("generate"), shard=SHARDS)
    if until >= layout.STAGES.index("evaluate"):
        inputs["metrics"] = run_path(layout.EVAL_METRICS)
    return inputs


def get_final_output():
    # Every tracked output lives in one folder, so the S3 plugin's single listing covers the
    # whole run (dflash_pipeline.core.layout). `until` names the last stage built by default.
    outputs = report_storage_inputs()
    outputs.append(run_path(layout.report_key(REPORT_STORAGE_ITEM)))
    if config["target"]["build_demo"]:
        outputs.append(local(config["target"]["model"]))
    return outputs
