"""The driver's planning work at 10,000s of jobs: Snakemake's checks without repeats.

Measured on this repository's 2-core machine with 10,000-shard plans (30,000-40,000 jobs;
``bench/dryrun_s3.py``). The rules call ``install_planning_patches`` at load.

The script check. After planning, Snakemake checks that the script of every job of the plan
exists (``snakemake.dag.ScriptProcessor``; the notebook check is its subclass): for each job it
formats the script path with the job's wildcards and params, opens and reads the script through
its source cache and asks the cache again whether it exists. Every per-shard rule here is a
``script:`` rule with a fixed path, so the same few files were read 30,000 times: 16.8 s of a
76.6 s planning under cProfile (local files). ``install_planning_patches`` keeps the check but
makes it once per (rule, script path) when the path holds no ``{`` (nothing to format, so every
job of the rule names the same file); a path with wildcards or params is still checked job by
job. A missing script is refused as before, by Snakemake's own check, at the first job of its
rule.

The log and benchmark check. ``Job.is_valid`` expands every job's log and benchmark paths again
to see that they expand, though building the job into the plan has already expanded (and
checked) them and kept them in ``Job.log`` and ``Job.benchmark``: 4.5 s of an 80 s planning
against S3 under cProfile (80,000 log and 30,000 benchmark paths, each a new storage object).
The same install makes ``is_valid`` read those two properties, which expand only what was not
expanded yet.

The function signatures. For every job, Snakemake reads the signature of each input function and
callable param (``inspect.signature``, several times per job): 150,000 reads, 3.1 s of a 62 s
planning of 40,000 jobs under cProfile, though a function's parameters never change. The same
install memoizes ``snakemake.common.get_function_params`` per function (a weak-keyed memo: a
function that goes away leaves it).

The conda environment. Before checking anything, Snakemake asks every job for its conda
environment, and ``Job.conda_env_spec`` expands the job's params to pass them along, even when
the rule's environment is a fixed file that Snakemake has already expanded once and kept for the
rule (every rule here): 5.6 s of the same planning, for params that a plan with ``mtime`` rerun
triggers (the S3 profile) never reads. The same install takes the rule's kept environment when
there is one, and asks Snakemake as before when there is none.

The nested-output check. ``DAG.check_directory_outputs`` builds a ``pathlib`` path of every
output of the plan, sorts them and compares neighbours (one path inside another's folder is an
error): 5.8 s of a 66 s planning of 40,000 jobs against S3 under cProfile, most of it building and
comparing ``pathlib`` objects. The same install makes the same comparison on tuples of path parts,
which is what POSIX ``pathlib`` paths sort and compare by, and raises the same error.

Each of the five is guarded by the fingerprints of the Snakemake functions it replaces or relies
on (``dflash_pipeline.snakemake_patches``): one whose function changed is left out with a warning,
the others still apply.

The collector was held back while planning too (frozen, collections ~300 times rarer): it saved
a quarter of the CPU before the patches above. With them it no longer pays: a local plan of
10,000 shards up to tokenize (30,000 jobs) took 29.1 and 29.3 s of CPU with it, 28.8 and 29.4 s
without (2026-12-05), so the collector runs as Python ships it.

``DFLASH_PLANNING_PATCHES=0`` turns all of this off: Snakemake plans as it ships.
"""

from __future__ import annotations

import os
import weakref

from dflash_pipeline.snakemake_patches import Patch, install

# Snakemake 9.27.1's functions, as each patch below was written against them.
DISABLE_ENV = "DFLASH_PLANNING_PATCHES"
_MARK = "_dflash_planning_patches"

# Snakemake's own ScriptProcessor.process_job, kept by install_planning_patches.
_snakemake_process_job = None
# Snakemake's marker of a rule whose conda environment is not expanded yet.
_snakemake_not_cached = None
# Snakemake's own get_function_params, kept by install_planning_patches, and its memo.
_snakemake_function_params = None
_FUNCTION_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _process_job_once_per_rule(self, job) -> None:
    entry = None
    if getattr(job, f"is_{self.script_type}"):
        entry = getattr(job.rule, self.script_type, None)
    if entry is None or "{" in str(entry):
        _snakemake_process_job(self, job)
        return
    checked = self.__dict__.setdefault("_dflash_checked_scripts", set())
    key = (job.rule.name, str(entry))
    if key not in checked:
        _snakemake_process_job(self, job)
        checked.add(key)


def _is_valid_from_kept_expansions(self) -> None:
    # What Job.is_valid checks: that the log and benchmark paths expand (the properties expand
    # and check them once and keep them).
    self.benchmark  # noqa: B018 (the property expands and checks it)
    self.log  # noqa: B018


def _conda_env_spec_from_the_rule(self):
    if self._conda_env_spec is None:
        kept = self.rule._expanded_conda_env
        if kept is _snakemake_not_cached:
            # Snakemake's own: the rule's environment may be a function of params or input.
            kept = self.rule.expand_conda_env(self.wildcards_dict, self.params, self.input)
        self._conda_env_spec = kept
    return self._conda_env_spec


def _absolute_parts(path: str, cwd: str) -> tuple[str, ...]:
    """``pathlib.PurePosixPath(path).absolute()``'s parts (root first), from the string alone."""
    if not path.startswith("/"):
        path = f"{cwd}/{path}"
    # POSIX keeps exactly two leading slashes as a root of its own.
    root = "//" if path.startswith("//") and not path.startswith("///") else "/"
    return (root, *(part for part in path.split("/") if part and part != "."))


def _check_nested_outputs_by_parts(self) -> None:
    # DAG.check_directory_outputs, comparing tuples of parts where it compares pathlib paths.
    from pathlib import Path

    from snakemake.exceptions import ChildIOException

    cwd = os.getcwd()
    outputs = sorted({(_absolute_parts(f, cwd), job) for job in self.jobs for f in job.output})
    for (a, job_a), (b, job_b) in zip(outputs, outputs[1:]):
        if a != b and b[: len(a)] == a and job_a != job_b:
            raise ChildIOException(parent=(Path(*a), job_a), child=(Path(*b), job_b))


def _memoized_function_params(func):
    try:
        return _FUNCTION_PARAMS[func]
    except KeyError:
        params = _FUNCTION_PARAMS[func] = _snakemake_function_params(func)
        return params
    except TypeError:  # neither hashable nor weakly referenceable: ask each time
        return _snakemake_function_params(func)


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def _keep_and_replace_script_check() -> None:
    global _snakemake_process_job
    from snakemake.dag import ScriptProcessor

    _snakemake_process_job = ScriptProcessor.process_job
    ScriptProcessor.process_job = _process_job_once_per_rule


def _replace_log_check() -> None:
    from snakemake.jobs import Job

    Job.is_valid = _is_valid_from_kept_expansions


def _replace_conda_env_spec() -> None:
    global _snakemake_not_cached
    import snakemake.rules
    from snakemake.jobs import Job

    _snakemake_not_cached = snakemake.rules._NOT_CACHED
    Job.conda_env_spec = property(_conda_env_spec_from_the_rule)


def _replace_nested_output_check() -> None:
    from snakemake.dag import DAG

    DAG.check_directory_outputs = _check_nested_outputs_by_parts


def _memoize_function_params() -> None:
    global _snakemake_function_params
    import snakemake.common
    import snakemake.rules

    _snakemake_function_params = snakemake.common.get_function_params
    # The module that defines it and the one that calls it by its imported name.
    for module in (snakemake.common, snakemake.rules):
        module.get_function_params = _memoized_function_params


PATCHES = [
    Patch(
        "script check once per rule",
        {"snakemake.dag:ScriptProcessor.process_job": "168fffa9284a4cdf"},
        _keep_and_replace_script_check,
    ),
    Patch(
        "log and benchmark check from kept expansions",
        {"snakemake.jobs:Job.is_valid": "74609fe120193ef6"},
        _replace_log_check,
    ),
    Patch(
        "conda environment from the rule",
        {
            "snakemake.jobs:Job.conda_env_spec": "4a98328beadaf1b9",
            "snakemake.rules:Rule.expand_conda_env": "ca6b0b6e11a47804",
        },
        _replace_conda_env_spec,
    ),
    Patch(
        "nested-output check by path parts",
        {"snakemake.dag:DAG.check_directory_outputs": "d5a17c047b46b717"},
        _replace_nested_output_check,
    ),
    Patch(
        "function parameters read once",
        {"snakemake.common:get_function_params": "ffd80f63645293c3"},
        _memoize_function_params,
    ),
]


def install_planning_patches() -> list[str]:
    """Check each rule's fixed script path once, not once per job, each job's log and benchmark
    paths once, not twice, read each function's parameters once, take a rule's kept conda
    environment without expanding params, and compare outputs for nesting without pathlib
    (module docstring). Returns the patches in place. Idempotent; each patch whose Snakemake
    function changed is left out with a warning; none with ``DFLASH_PLANNING_PATCHES=0``."""
    if not enabled():
        return []
    import snakemake.api  # noqa: F401 (first: it imports the modules below in the order they need)
    from snakemake.dag import ScriptProcessor

    if not hasattr(ScriptProcessor, _MARK):
        applied = install(PATCHES, "Snakemake does that work as it ships")
        setattr(ScriptProcessor, _MARK, applied)
    return list(getattr(ScriptProcessor, _MARK))
