"""Changes to Snakemake and its S3 and SLURM plugins, made in the process that plans a run, so that
a plan of 10,000s of jobs is built fast (``planning``) and against S3 from folder listings
(``s3_inventory``), a job that refused a damaged input is not retried (``refusals``), a job about
to run again over its earlier outputs is refused for a damaged input before they are removed
(``rerun_checks``), the run's checks start with a run or a dry-run (``execution``), and a
scancelled SLURM job ends (``slurm_states``). Nothing else in the package imports this one (tests/test_layers.py); the
rules install it.

Each patch replaces functions written by others, relying on what they do. So each is guarded by
the fingerprints of the functions it replaces or relies on: a hash of their source as the pinned
versions ship it (``pyproject.toml``). At install, a patch whose fingerprints all match is put in
place; one whose function changed (another Snakemake, interface package or plugin) is left out
with one warning naming it and the function, and the others still apply. Versions are named in
the warning only: a release that leaves a function as it was keeps its patch.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


def resolve(where: str):
    """``"package.module:Class.attribute"`` -> the object (a property's getter for a property)."""
    module_name, _, path = where.partition(":")
    obj = importlib.import_module(module_name)
    for name in path.split("."):
        owner = obj
        obj = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
        if isinstance(obj, property):
            obj = obj.fget
        elif isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
    return obj


def fingerprint(obj) -> str:
    """A short hash of a function's source text (what a patch was written against)."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return "no-source"
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class Patch:
    """One change: ``apply`` puts it in place once the functions of ``guards`` (``where`` ->
    the fingerprint of the pinned version) are those it was written against."""

    name: str
    guards: dict[str, str]
    apply: Callable[[], None]

    def changed(self) -> list[str]:
        """The guarded functions that differ from the pinned versions (or are gone)."""
        found = []
        for where, pinned in self.guards.items():
            try:
                actual = fingerprint(resolve(where))
            except (ImportError, AttributeError):
                actual = "missing"
            if actual != pinned:
                found.append(f"{where} ({actual}, pinned {pinned})")
        return found


def install(patches: list[Patch], what_happens: str) -> list[str]:
    """Apply every patch whose guards hold; the names of those applied. Each one left out is
    said in one warning (``what_happens`` without it)."""
    applied = []
    for patch in patches:
        changed = patch.changed()
        if changed:
            log.warning(
                "snakemake patch %r is off: %s changed since the pinned version; %s",
                patch.name,
                ", ".join(changed),
                what_happens,
            )
            continue
        patch.apply()
        applied.append(patch.name)
    return applied
