"""Snakemake's command line for the tests on the test Slurm cluster (tests.support.slurm_cluster),
with the SLURM executor plugin's status checks at most ``STATUS_CHECK_CAP_S`` apart.

The plugin checks its jobs' states (sacct) first ``--slurm-init-seconds-before-status-checks``
after a submission, then backs off by 10 s a check while no job ends, up to 180 s, and starts
again from the first interval once one does: right for a real cluster's accounting database, but
on the test cluster a job that had ended waited up to ~45 s to be noticed, once for every job of
a run. Only the interval is capped; what the plugin checks and does is its own code.

    python -m tests.support.slurm_driver <snakemake arguments>
"""

from __future__ import annotations

from snakemake_executor_plugin_slurm import Executor
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

STATUS_CHECK_CAP_S = 5

_interval = RemoteExecutor.next_seconds_between_status_checks


def _capped(self, seconds) -> None:
    _interval.fset(self, None if seconds is None else min(seconds, STATUS_CHECK_CAP_S))


# The plugin sets the attribute (its backoff) through RemoteExecutor's property: capped here.
Executor.next_seconds_between_status_checks = property(_interval.fget, _capped)

if __name__ == "__main__":
    from snakemake.cli import main

    main()
