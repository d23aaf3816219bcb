# Each job's resources: its memory, and for a SLURM run (profiles/slurm; other executors ignore
# them) its partition, CPUs, account, QoS and GPU node constraint. The driver of a SLURM run asks
# the cluster what these need once, before its first sbatch. The logic lives in
# dflash_pipeline.core.slurm and dflash_pipeline.core.resources; this file wires it to the rules.
from dflash_pipeline.core import slurm as slurm_checks
from dflash_pipeline.core.gpu_slots import pool_from_config
from dflash_pipeline.core.resources import job_memory_mb
from dflash_pipeline.model import speculators_format
from dflash_pipeline.snakemake_patches.slurm_states import install_state_fix

# Host memory per job from the target's and the drafter's sizes; a SLURM run's driver caps each
# at the memory of the smallest node of the run's partitions.
JOB_MEMORY_MB = job_memory_mb(
    config,
    speculators_export=speculators_format.refusal(config["train"]["layer_types"])
    is None,
)


def warn_gpu_pool(executor):
    """`--resources gpu=N` above the pool the slot wrapper hands out (dflash_pipeline.core.gpu_slots)
    makes a local run's GPU jobs wait; under SLURM the cluster gives each job its GPUs.
    """
    local = slurm_checks.runs_locally(
        executor.name,
        executor.common_settings.local_exec,
        workflow.execution_settings.use_threads,
    )
    # Absent `--resources gpu`: Snakemake ignores the gpu resource altogether.
    limit = getattr(workflow.global_resources.get("gpu"), "value", None)
    # The pool is counted here, in the driver, only where it schedules devices.
    pool = pool_from_config(config)[0] if local and limit is not None else 0
    warning = slurm_checks.gpu_pool_warning(limit, pool, local)
    if warning:
        logger.warning(warning)


_SLURM_PLAN = []


def slurm_plan():
    """A SLURM run's driver asks the cluster what the executor plugin needs (accounting, the
    account, QoS, partitions, GPUs, the GPU constraint) once, when the first job's resources are
    evaluated, so before the first sbatch: a problem stops the run, the rest is said in one line.
    None for any other executor, a dry-run, or a job's own process."""
    if _SLURM_PLAN:
        return _SLURM_PLAN[0]
    executor = workflow.executor_plugin
    if executor is None:  # still parsing: the executor is not known yet
        return None
    plan = None
    if workflow.is_main_process:
        # The first point where the executor is known (it is not while the Snakefile is parsed).
        warn_gpu_pool(executor)
    if workflow.is_main_process and executor.name == "slurm":
        status_command = getattr(workflow.executor_settings, "status_command", None)
        plan = slurm_checks.plan_run(config, status_command)
        logger.info(plan.line)
        # A scancelled job ends for the plugin (dflash_pipeline.snakemake_patches.slurm_states).
        install_state_fix()
    _SLURM_PLAN.append(plan)
    return plan


def job_memory(rule_name, gpus=0):
    """A job's mem_mb: its rule's figure, for a GPU job at least gpus x slurm.mem_per_gpu_mb,
    capped in a SLURM run's driver to the smallest node (dflash_pipeline.core.slurm.job_memory).
    """
    mb = JOB_MEMORY_MB[rule_name]
    return lambda wildcards: slurm_checks.job_memory(
        mb, gpus, config["slurm"], slurm_checks.smallest_node_mb(slurm_plan())
    )


def slurm_cpus(partition, gpus):
    """A job's CPUs (sbatch --cpus-per-task; dflash_pipeline.core.slurm.requested_cpus): capped
    in the driver to its partition's nodes, and inside a job to the allocation (the job-step
    plugin's srun asks for them again)."""

    def cpus(wildcards, threads):
        allocation = (
            None if workflow.is_main_process else slurm_checks.cpus_in_this_job()
        )
        return slurm_checks.requested_cpus(
            threads, gpus, config["slurm"], partition, slurm_plan(), allocation
        )

    return cpus


def slurm_account(wildcards):
    """slurm.account, else (accounting on) the user's default account from sacctmgr: the
    plugin's own guess fails on Slurm 22.05 and submits without one."""
    plan = slurm_plan()
    return config["slurm"]["account"] or (plan.account if plan else None)


def slurm(gpus):
    """The SLURM resources of a job that takes `gpus` GPUs: its partition, QoS and GPU node
    constraint from the config, its CPUs and the account from the cluster."""
    fixed = slurm_checks.fixed_resources(config["slurm"], gpus)
    partition = fixed.pop("slurm_partition")
    return {
        "slurm_partition": partition,
        "cpus_per_task": slurm_cpus(partition, gpus),
        "slurm_account": slurm_account,
        **fixed,
    }
