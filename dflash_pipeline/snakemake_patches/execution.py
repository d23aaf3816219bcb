"""Checks that read the world run when a run or a dry-run starts, not whenever the workflow is read.

Snakemake parses the Snakefile for every invocation: a run, a dry-run, ``--report``, ``--lint``,
``--list-rules``, and each job's own Snakemake process. The checks that read storage, the
dataset files and the engine environments (preflight, the offline budget) belong to the driver
of a run or a dry-run only: a report made on a laptop without the engines must not fail on them,
and a job on a cluster node has nothing to plan. Nothing known while the Snakefile is parsed
tells these invocations apart (the executor is chosen after it), so ``on_execution`` wraps
``Workflow.execute``, which Snakemake calls for runs and dry-runs (``DAGApi.execute_workflow``,
with the ``dryrun`` executor for ``-n``) and for nothing else, so that it calls the workflow's
hooks with the executor before it builds the plan. Guarded by the fingerprints of both
(``dflash_pipeline.snakemake_patches``): where either changed, ``on_execution`` says so and the
caller runs its hook while the Snakefile is parsed, as before.
"""

from __future__ import annotations

from collections.abc import Callable

from dflash_pipeline.snakemake_patches import Patch, install

_MARK = "_dflash_execution_hooks_patch"
_HOOKS = "_dflash_execution_hooks"


def _wrap_execute(original):
    def execute(self, executor_plugin, *args, **kwargs):
        for hook in vars(self).get(_HOOKS, ()):
            hook(executor_plugin)
        return original(self, executor_plugin, *args, **kwargs)

    execute.__wrapped__ = original
    return execute


def _apply() -> None:
    from snakemake.workflow import Workflow

    Workflow.execute = _wrap_execute(Workflow.execute)


PATCHES = [
    Patch(
        "hooks at the start of a run or dry-run",
        {
            "snakemake.workflow:Workflow.execute": "ab01c47606d43dd9",
            "snakemake.api:DAGApi.execute_workflow": "525655b9e7ffc18c",
        },
        _apply,
    )
]


def install_execution_hooks() -> list[str]:
    """Put the patch in place once per process; the patches in place."""
    import snakemake.api  # noqa: F401 (first: it imports the workflow's modules in the order they need)
    from snakemake.workflow import Workflow

    if not hasattr(Workflow, _MARK):
        setattr(Workflow, _MARK, install(PATCHES, "the run's checks run whenever the workflow is read"))
    return list(getattr(Workflow, _MARK))


def on_execution(workflow, hook: Callable[[object], None]) -> bool:
    """Call ``hook(executor_plugin)`` when ``workflow`` starts a run or a dry-run, before its plan
    is built. False where the patch is off: the hook will not be called (the caller runs it now)."""
    if not install_execution_hooks():
        return False
    vars(workflow).setdefault(_HOOKS, []).append(hook)
    return True
