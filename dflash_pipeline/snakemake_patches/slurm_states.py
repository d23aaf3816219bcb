"""The Slurm executor plugin sees a job cancelled with ``scancel`` as cancelled.

The plugin (2.8.0) compares the states of its status query exactly (``Executor.check_active_jobs``
against ``CANCELLED``, ``FAILED``, ...), and sacct reports a job cancelled with scancel as
``CANCELLED by <uid>``: neither ended nor failed to the plugin, so the driver waited for ever on
it (seen on Slurm 22.05). The patch wraps the plugin's status query (``query_job_status``, which
``check_active_jobs`` calls by its name in the plugin's module) so that every state reaches the
check without its qualifier (``dflash_pipeline.core.slurm.job_state``); the retry then starts as
for any failed job. Guarded by the fingerprints of the query and of the check that reads its
states (``dflash_pipeline.snakemake_patches``). A SLURM run's driver installs it
(rules/slurm.smk).
"""

from __future__ import annotations

from dflash_pipeline.core.slurm import job_state
from dflash_pipeline.snakemake_patches import Patch, install

PLUGIN = "snakemake_executor_plugin_slurm"
_MARK = "_dflash_state_fix"


def without_qualifiers(query):
    """``query`` (the plugin's async status query: ``(states by job id, seconds)``) with every
    state reduced to its first word."""

    async def query_job_status(command, logger):
        states, duration = await query(command, logger)
        if states is not None:
            states = {job: job_state(state) for job, state in states.items()}
        return states, duration

    query_job_status.__wrapped__ = query
    return query_job_status


def _apply() -> None:
    import snakemake_executor_plugin_slurm as plugin

    plugin.query_job_status = without_qualifiers(plugin.query_job_status)


PATCHES = [
    Patch(
        "scancelled job states without their qualifier",
        {
            f"{PLUGIN}:query_job_status": "e0a595a37ef239d2",
            f"{PLUGIN}:Executor.check_active_jobs": "a15ec905e07e1ef6",
        },
        _apply,
    )
]


def install_state_fix() -> list[str]:
    """Put the patch in place once per process; the patches in place. None without the plugin;
    a guarded function that changed leaves it out with a warning."""
    try:
        import snakemake_executor_plugin_slurm as plugin
    except ImportError:
        return []
    if not hasattr(plugin, _MARK):
        setattr(plugin, _MARK, install(PATCHES, "a job cancelled with scancel is waited on for ever"))
    return list(getattr(plugin, _MARK))
