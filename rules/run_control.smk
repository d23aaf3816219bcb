# Run control: what happens around the jobs rather than in them. The Snakemake patches that make
# planning 10,000s of jobs fast, the checks that refuse a run before its first job (preflight,
# the offline budget), the run lease (one driver per run), the halt's message, and the live
# status page. The logic lives in the package; this file wires it to Snakemake's hooks.
import os

from dflash_pipeline.core.jobstate import describe_halt, read_halt
from dflash_pipeline.core.lease import (
    DRIVER_TOKEN_ENV,
    LeaseHeld,
    LeaseLost,
    RunLease,
    describe_holder,
)
from dflash_pipeline.snakemake_patches.execution import on_execution
from dflash_pipeline.snakemake_patches.planning import install_planning_patches
from dflash_pipeline.snakemake_patches.s3_inventory import install_folder_inventory
from dflash_pipeline.snakemake_patches.storage_outage import ride_out_plugin_outages
from dflash_pipeline.core.outage import OUTAGE_TOLERANCE_ENV
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.core.s3 import S3Storage
from dflash_pipeline.report.run_summary import run_summary

# Planning against S3 reads absence from folder listings (one request per 1,000 objects, not
# three per missing object); see dflash_pipeline/snakemake_patches/s3_inventory.py.
install_folder_inventory()
# Planning 10,000s of jobs: Snakemake's per-job checks without repeats
# (dflash_pipeline.snakemake_patches.planning).
install_planning_patches()

# Storage outages up to storage.outage_tolerance_s are ridden out (dflash_pipeline.core.outage):
# by the S3 plugin of this process, and by the jobs, which inherit the tolerance (locally and
# through sbatch) and read the same config in their own Snakemake process.
os.environ[OUTAGE_TOLERANCE_ENV] = str(config["storage"]["outage_tolerance_s"])
ride_out_plugin_outages(workflow.storage_registry)


def preflight():
    """What would fail the run days in, refused now, one line per problem: the target folder,
    the dataset files, the storage, the engines (dflash_pipeline.stages.preflight)."""
    from dflash_pipeline.stages.preflight import run_problems

    problems, ready = run_problems(config, RUN_URL)
    if problems:
        refuse(*problems)
    for line in ready:
        logger.info(line)


def plan_checks(executor=None):
    """What refuses a run before its first job (the executor is not needed to know it): a run
    whose offline taps exceed train.offline_max_bytes (dflash_pipeline.training.offline; the
    training job checks again as it starts), then the preflight."""
    from dflash_pipeline.training.offline import OfflineBudgetError, check_offline_run

    try:
        check_offline_run(config, RUN_URL)
    except OfflineBudgetError as err:
        refuse(str(err))
    preflight()


# The checks read the run's storage, the dataset files and the engine environments, so they run
# where a plan is made: when the driver starts a run or a dry-run, not for --report, --lint or
# --list-rules (dflash_pipeline.snakemake_patches.execution), nor in a job's own process on a
# cluster node (which parses this file again; the training job checks the offline budget
# itself). Where the patch is off, they run now, as the workflow is read.
if workflow.is_main_process and not on_execution(workflow, plan_checks):
    plan_checks()


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
        logger.warning(
            f"took over the run lease of {describe_holder(lease.took_over)}: "
            f"{lease.takeover_reason}"
        )
    lease.start_heartbeat(lease_trouble)
    RUN_LEASE.append(lease)
    # Jobs inherit it: a job whose driver is gone stops after its current part.
    os.environ[DRIVER_TOKEN_ENV] = lease.owner["token"]


def release_run_lease():
    while RUN_LEASE:
        RUN_LEASE.pop().release()


onstart:
    if DEFAULT_STORAGE == "s3":
        # The S3 plugin deletes a bucket once it is empty; keep one object in it for good.
        S3Storage(RUN_URL).ensure_bucket()
    take_run_lease()
    log_halt("generate, extract and train jobs will refuse to start")
    if config["status"]["serve"]:
        start_status_page()


def print_run_summary():
    """The run's last lines: what it built, τ, lossless, speed-up, where the drafter and the
    report are (dflash_pipeline.report.run_summary). A failure to read says so in one line:
    the run itself succeeded."""
    try:
        lines = run_summary(config, RUN_URL, open_storage(RUN_URL), report_command())
    except Exception as err:  # the summary must never fail a finished run
        lines = [f"(no run summary: {type(err).__name__}: {err})"]
    logger.info("\n".join(["", *lines]))


def report_command():
    """How this run's report is made: the Makefile's target for the demo's config, Snakemake's
    command line otherwise."""
    files = [str(f) for f in workflow.overwrite_configfiles or []]
    if not files:
        return "make report"
    prefix = workflow.storage_settings.default_storage_prefix
    return f"snakemake --report report.html --configfile {' '.join(files)}" + (
        f" --profile profiles/s3 --default-storage-prefix {prefix}" if prefix else ""
    )


onsuccess:
    release_run_lease()
    print_run_summary()


onerror:
    release_run_lease()
    log_halt("the run stopped")
