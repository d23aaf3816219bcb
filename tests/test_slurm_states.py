"""The Slurm executor plugin's status query passes states on without their qualifier
(dflash_pipeline.snakemake_patches.slurm_states): a scancelled job (`CANCELLED by 0` in sacct)
reaches the plugin's check as `CANCELLED`. Guarded like every patch of another project's code:
written against the installed plugin, and off with one warning where its functions changed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from dflash_pipeline.snakemake_patches.slurm_states import PATCHES, without_qualifiers

REPO = Path(__file__).resolve().parent.parent


def test_the_query_passes_states_on_without_their_qualifier():
    async def query(command, logger):
        return {"7": "CANCELLED by 0", "8": "RUNNING"}, 0.01

    async def failed(command, logger):
        return None, None  # the plugin's answer when sacct could not be asked

    assert asyncio.run(without_qualifiers(query)("sacct ...", None)) == ({"7": "CANCELLED", "8": "RUNNING"}, 0.01)
    assert asyncio.run(without_qualifiers(failed)("sacct ...", None)) == (None, None)


def run(script: str) -> subprocess.CompletedProcess:
    """A fresh interpreter: this one's plugin may already be patched."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)


def test_the_patch_is_written_against_the_installed_plugin_and_goes_in_once():
    proc = run(
        "import snakemake_executor_plugin_slurm as plugin\n"
        "from dflash_pipeline.snakemake_patches.slurm_states import PATCHES, install_state_fix\n"
        "print([p.changed() for p in PATCHES])\n"
        "original = plugin.query_job_status\n"
        "print(install_state_fix() == install_state_fix() == [p.name for p in PATCHES])\n"
        "print(plugin.query_job_status.__wrapped__ is original)\n"
    )
    assert proc.stdout.splitlines() == ["[[]]", "True", "True"], proc.stdout + proc.stderr
    assert "is off" not in proc.stderr, proc.stderr


def test_a_changed_plugin_turns_the_patch_off_with_a_warning():
    """Simulated drift: another plugin release's status query. The patch stays off (the query is
    the plugin's own), named in one warning with the function that changed."""
    proc = run(
        "import logging\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "import snakemake_executor_plugin_slurm as plugin\n"
        "async def query_job_status(command, logger):\n"
        "    return {}, 0.0  # a release that does this differently\n"
        "plugin.query_job_status = query_job_status\n"
        "from dflash_pipeline.snakemake_patches.slurm_states import install_state_fix\n"
        "print(install_state_fix())\n"
        "print(plugin.query_job_status is query_job_status)\n"
    )
    assert proc.stdout.splitlines() == ["[]", "True"], proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "is off" in line]
    assert len(warnings) == 1, proc.stderr
    assert f"snakemake patch {PATCHES[0].name!r} is off" in warnings[0]
    assert "snakemake_executor_plugin_slurm:query_job_status" in warnings[0]
