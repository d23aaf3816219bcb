"""A job about to run again over outputs it made before is refused for a damaged input before
Snakemake removes those outputs.

Snakemake removes a job's existing outputs and logs before it runs the job again (``Job.prepare``
calls ``remove_existing_output``; for an S3 output, the object in the bucket), in the process that
runs the job: the driver with the local executor, the job's own Snakemake process on the node
under Slurm. A job that fails has its outputs removed once more (``Job.postprocess`` with
``error=True`` calls ``Job.cleanup``) by each Snakemake process that sees it fail: the job's own,
the Slurm allocation's and the driver. The job checks its inputs only once it runs
(``core.checksums.verify_inputs``): a rerun (an input newer than its output, ``--forcerun``, a
changed parameter) whose input was damaged had lost its earlier outputs by then.

So the driver checks such a job before any of this. The patch wraps ``JobScheduler.run``, which
the driver's scheduler calls with the jobs it has just selected (counted as running, their
resources taken), once their storage inputs have local copies and before it hands them to an
executor, local or Slurm. Of those jobs, the ones that read tracked objects and write tracked
objects (``core.checksums.is_checked_key``: the shard objects, segment manifests, the drafter...)
that are already there have those inputs checked (``core.checksums.refuse_damaged_reruns``: each
input read once, many at a time; the same inputs the job checks itself). A refused job
is not handed to the executor. Its refusal is written as the job's own check writes it, its error
is one line (Snakemake's "Error in rule" with it as the message), and the scheduler fails it as
it fails any job, without the postprocessing that would remove its outputs
(``JobScheduler._handle_error`` with ``postprocess_job=False``); the refusals patch makes it the
last attempt. The job never ran, so nothing is removed, its logs and Snakemake's metadata stay as
they were, and nothing is marked incomplete. A job without outputs yet removes nothing and is
not checked here: it checks its inputs itself, as every job does. Nor is a job whose outputs carry
no checksum record (a report figure, the evaluation's metrics): rebuilt from the shards by its
rerun, it would cost the driver a read of every shard it reads.

Only the driver checks (a run's main process, not a dry-run or ``--touch``): the Snakemake
processes under it run what it decided. Group jobs are passed on unchecked (the workflow declares
no groups). An input damaged after this check (or a damaged download on a node) is still caught
by the job's own check, after Snakemake removed its earlier outputs.
"""

from __future__ import annotations

import asyncio
import logging
import os

from dflash_pipeline.core.checksums import Rerun, is_checked_key, refuse_damaged_reruns
from dflash_pipeline.snakemake_patches import Patch, install

log = logging.getLogger(__name__)

_RUN: dict = {}  # "url": the run root, "config": the run's config (set by install_rerun_checks)


def _run_key(f) -> str | None:
    """The run-root key of one of Snakemake's files (``outputs/generate-00001.parquet``), or
    None for a file outside the run root (the target model, a local dataset file)."""
    root = _RUN["url"].rstrip("/")
    if f.is_storage:
        name = str(f.storage_object.query)
    else:
        name, root = os.path.normpath(str(f)), os.path.normpath(root)
    return name[len(root) + 1 :] if name.startswith(root + "/") else None


def _tracked(f) -> bool:
    key = _run_key(f)
    return key is not None and is_checked_key(key)


async def _reruns(jobs) -> list[tuple[object, Rerun]]:
    """The jobs that read tracked objects and write tracked objects already there, each as a
    ``Rerun``; their inputs' local copies fetched where the driver has none (a remote executor
    without a shared file system). An output missing when the plan was made is not asked for
    again (a first run costs no request here). A job whose copies cannot be had is left to check
    itself."""
    candidates = []
    for job in jobs:
        if job.is_group() or job.is_norun or not any(_tracked(f) for f in job.output):
            continue  # reports and metrics carry no record: a rerun rebuilds them from the shards
        inputs = [f for f in job.input if _tracked(f)]
        missing = job.dag.reason(job).missing_output
        present = [f for f in job.output if f not in missing]
        if inputs and present:
            candidates.append((job, inputs, present))
    if not candidates:
        return []
    found = await asyncio.gather(*(f.exists() for _, _, files in candidates for f in files))
    exists = iter(found)
    reruns = []
    for job, inputs, files in candidates:
        kept = [f for f in files if next(exists)]
        if not kept:
            continue  # a first run: nothing to remove
        try:
            for f in inputs:
                if f.is_storage and not await f.exists_local():
                    await f.retrieve_from_storage()
        except Exception as err:  # noqa: BLE001 (the job then checks its inputs itself)
            log.warning("could not fetch the inputs of %s to check them before it runs (%s)", job, err)
            continue
        if not all(os.path.exists(str(f)) for f in inputs):
            continue
        rerun = Rerun(
            job.rule.name,
            {str(k): str(v) for k, v in dict(job.wildcards_dict).items()},
            tuple(str(f) for f in inputs),
            tuple(_run_key(f) or str(f) for f in kept),
        )
        reruns.append((job, rerun))
    return reruns


def _refusals(scheduler, jobs) -> list[tuple[object, str]]:
    """The jobs about to run again that are refused, each with its one-line error."""
    reruns = scheduler.workflow.async_run(_reruns(jobs))
    if not reruns:
        return []
    job_of = {id(rerun): job for job, rerun in reruns}
    refused = refuse_damaged_reruns(_RUN["url"], _RUN["config"], [rerun for _, rerun in reruns])
    return [(job_of[id(rerun)], line) for rerun, line in refused]


def _fail(scheduler, job, line: str) -> None:
    """Fail a refused job as the scheduler fails one, without the postprocessing that removes
    its outputs."""
    job.log_error(msg=line)
    with scheduler._lock:
        scheduler._handle_error(job, postprocess_job=False)
    scheduler._open_jobs.release()  # the next scheduling round sees the failure


def _checks_here(scheduler) -> bool:
    from snakemake_interface_executor_plugins.settings import ExecMode

    workflow = scheduler.workflow
    return bool(_RUN) and not scheduler.dryrun and not scheduler.touch and workflow.exec_mode == ExecMode.DEFAULT


def _wrap_run(original):
    def run(self, jobs, executor=None):
        if _checks_here(self):
            try:
                refusals = _refusals(self, jobs)
            except Exception as err:  # noqa: BLE001 (the check must not stop the scheduler)
                log.warning("could not check the inputs of the jobs about to run again (%s): they check them", err)
                refusals = []
            for job, line in refusals:
                _fail(self, job, line)
            if refusals:
                refused = {job for job, _ in refusals}
                jobs = [job for job in jobs if job not in refused]
                if not jobs:
                    return None
        return original(self, jobs, executor)

    run.__wrapped__ = original
    return run


def _apply() -> None:
    from snakemake.scheduling.job_scheduler import JobScheduler

    JobScheduler.run = _wrap_run(JobScheduler.run)


PATCHES = [
    Patch(
        "a rerun refused for a damaged input before its outputs are removed",
        {
            # run is wrapped; schedule calls it as the docstring says (after the jobs' selection
            # and their inputs' retrieval, without the lock); a refused job is failed as
            # _handle_error fails one, woken up as error_callback wakes the scheduler.
            "snakemake.scheduling.job_scheduler:JobScheduler.run": "5c7aec0df93cd01a",
            "snakemake.scheduling.job_scheduler:JobScheduler.schedule": "9f32db93a39bd96f",
            "snakemake.scheduling.job_scheduler:JobScheduler._handle_error": "255b52a98a346275",
            "snakemake.scheduling.job_scheduler:JobScheduler.error_callback": "f82ebb2d99741abf",
        },
        _apply,
    )
]


def install_rerun_checks(run_url: str, config: dict) -> list[str]:
    """Check the reruns of the run at ``run_url`` (``config``: its config, for the repair command
    of a refusal); put the patch in place once per process."""
    first = not _RUN
    _RUN.update(url=run_url, config=dict(config))
    if not first:
        return [p.name for p in PATCHES]
    import snakemake.api  # noqa: F401 (it imports the scheduler's modules in the order they need)

    return install(PATCHES, "a rerun whose input is damaged loses its earlier outputs before it fails")
