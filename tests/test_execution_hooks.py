"""The run's checks start with a run or a dry-run (dflash_pipeline.snakemake_patches.execution):
Snakemake's ``Workflow.execute`` calls the workflow's hooks with the executor before it plans, and
nothing else calls them (a report, --lint: tests/test_preflight.py). Guarded like every patch of
another project's code: off with one warning where Snakemake's functions changed, and then the
rules run the checks as the workflow is read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dflash_pipeline.snakemake_patches.execution import _HOOKS, PATCHES, _wrap_execute

REPO = Path(__file__).resolve().parent.parent


def test_the_hooks_get_the_executor_before_snakemake_plans():
    calls = []

    def execute(self, executor_plugin, executor_settings=None, **kwargs):
        calls.append(("execute", executor_plugin, executor_settings))
        return "planned"

    class Workflow:
        pass

    with_hooks, without = Workflow(), Workflow()
    vars(with_hooks)[_HOOKS] = [lambda executor: calls.append(("hook", executor))]
    patched = _wrap_execute(execute)
    assert patched(with_hooks, executor_plugin="dryrun", executor_settings=None) == "planned"
    assert calls == [("hook", "dryrun"), ("execute", "dryrun", None)]
    calls.clear()
    assert patched(without, "local", "settings") == "planned"
    assert calls == [("execute", "local", "settings")]


def run(script: str) -> subprocess.CompletedProcess:
    """A fresh interpreter: this one's Snakemake may already be patched."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)


def test_a_changed_snakemake_turns_the_hook_off_and_says_so():
    """Simulated drift: another Snakemake's ``Workflow.execute``. ``on_execution`` answers False
    (the rules then check as they read the workflow) with one warning naming the function."""
    proc = run(
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "import snakemake.api\n"
        "from snakemake.workflow import Workflow\n"
        "def execute(self, executor_plugin, *args, **kwargs):\n"
        "    pass  # a release that does this differently\n"
        "Workflow.execute = execute\n"
        "from dflash_pipeline.snakemake_patches.execution import on_execution\n"
        "class W: pass\n"
        "print(on_execution(W(), print), on_execution(W(), print))\n"
        "print(Workflow.execute is execute)\n"
    )
    assert proc.stdout.splitlines() == ["False False", "True"], proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "is off" in line]
    assert len(warnings) == 1, proc.stderr
    assert f"snakemake patch {PATCHES[0].name!r} is off" in warnings[0]
    assert "snakemake.workflow:Workflow.execute" in warnings[0]
