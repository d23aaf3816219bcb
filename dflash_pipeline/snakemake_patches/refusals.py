"""A job that refused a damaged input is not retried.

A job whose input fails its checksum (dflash_pipeline.core.checksums.verify_inputs) writes a
refusal in the run root before it fails. Every retry would read the same damaged input and fail
alike, after Snakemake has waited for the job's resources again (a GPU, a Slurm allocation), so
the patch below makes the scheduler treat such a failure as the job's last attempt. A job has no
say in its retries: Snakemake's ``retries`` is a number per rule, and its scheduler decides from
it alone. The patch wraps ``JobScheduler._handle_error`` (it calls the original): a job with a
refusal gets the attempt number of its last try, so the original does not restart it.
"""

from __future__ import annotations

import logging

from dflash_pipeline.core.checksums import refused
from dflash_pipeline.core.storage import open_storage
from dflash_pipeline.snakemake_patches import Patch, install

log = logging.getLogger(__name__)

_RUN_URL: list[str] = []  # the run whose refusals are read (set by install_refusal_patch)


def _refusal_of(job) -> dict | None:
    if not _RUN_URL or not hasattr(job, "rule") or not hasattr(job, "wildcards_dict"):
        return None  # a group job: its members' failures are retried as Snakemake does
    try:
        return refused(open_storage(_RUN_URL[0]), job.rule.name, dict(job.wildcards_dict))
    except Exception as err:  # noqa: BLE001 (the retry decision must not crash the scheduler)
        log.warning("could not read the refusal of %s (%s): retried as usual", job, err)
        return None


def _wrap_handle_error(original):
    def _handle_error(self, job, postprocess_job: bool = True):
        refusal = _refusal_of(job)
        if refusal is not None and job.restart_times > job.attempt - 1:
            log.error(
                "%s refused its damaged input %s: not retried (every attempt would fail alike)",
                job,
                refusal.get("input"),
            )
            job.attempt = job.restart_times + 1
        return original(self, job, postprocess_job)

    _handle_error.__wrapped__ = original
    return _handle_error


def _apply() -> None:
    from snakemake.scheduling.job_scheduler import JobScheduler

    JobScheduler._handle_error = _wrap_handle_error(JobScheduler._handle_error)


PATCHES = [
    Patch(
        "no retry of a job that refused a damaged input",
        {
            "snakemake.scheduling.job_scheduler:JobScheduler._handle_error": "255b52a98a346275",
            "snakemake.jobs:Job.attempt": "8b59a157dd0845c0",
        },
        _apply,
    )
]


def install_refusal_patch(run_url: str) -> list[str]:
    """Read refusals from ``run_url``; put the patch in place once per process."""
    first = not _RUN_URL
    _RUN_URL[:] = [run_url]
    if not first:
        return [p.name for p in PATCHES]
    import snakemake.api  # noqa: F401 (it imports the scheduler's modules in the order they need)

    return install(PATCHES, "a job that refused a damaged input is retried like any other")
