"""The package's layers: every import points down, never up and never sideways.

Each package of ``dflash_pipeline`` has a rank; a module may import from its own package and from
packages of a lower rank only. Packages of one rank are siblings that never import each other, so
each can be read (and tested) without the others. ``stages/`` is the top: nothing in the package
imports it. Imports inside functions count as much as those at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_pipeline"

# Lowest first. Read as: stages -> status -> report -> evaluation -> training | engines
#                        -> data | demo -> model | snakemake_patches (which only the rules
#                        import) -> core. The status page shows the report's headline figures
#                        (report.headline), so it sits above the report.
LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("model", "snakemake_patches"),
    ("data", "demo"),
    ("training", "engines"),
    ("evaluation",),
    ("report",),
    ("status",),
    ("stages",),
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def package_of(module: str) -> str | None:
    """``dflash_pipeline.data.chat`` -> ``data``; None outside the package."""
    parts = module.split(".")
    if parts[0] != "dflash_pipeline":
        return None
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file, relative imports resolved."""
    module = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "dflash_pipeline":
                # `from dflash_pipeline import layout` names the subpackage in the alias
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, name))
    return found


def violations(package_dir: Path = PACKAGE) -> list[str]:
    """Every import that points up or sideways, as 'file:line: a imports b (why)'."""
    problems = []
    for path in sorted(package_dir.rglob("*.py")):
        own = package_of(".".join(path.relative_to(package_dir.parent).with_suffix("").parts))
        if own not in RANK:
            if own not in ("__init__", ""):
                problems.append(f"{path}: package {own!r} has no layer (add it to LAYERS)")
            continue
        for line, imported in imports_of(path, package_dir):
            other = package_of(imported)
            if other is None or other == own:
                continue
            where = f"{path.relative_to(package_dir.parent)}:{line}"
            if other not in RANK:
                problems.append(f"{where}: {own} imports {imported}, which is in no layer")
            elif RANK[other] > RANK[own]:
                problems.append(f"{where}: {own} imports {imported} from a layer above it")
            elif RANK[other] == RANK[own]:
                problems.append(f"{where}: {own} imports its sibling layer {imported}")
    return problems


def test_every_import_points_down():
    assert violations() == []


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(RANK)
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"], (
        "modules live in a layer's package, not at the top of dflash_pipeline"
    )


@pytest.mark.parametrize(
    "module, source, message",
    [
        ("core/extra.py", "from dflash_pipeline.model.config import DrafterConfig\n", "above"),
        ("model/extra.py", "def f():\n    from dflash_pipeline.stages import train\n", "above"),
        ("training/extra.py", "from dflash_pipeline.engines import client\n", "sibling"),
        ("data/extra.py", "from ..evaluation import loop\n", "above"),
        ("report/extra.py", "from dflash_pipeline import status\n", "above"),
        ("model/extra.py", "from dflash_pipeline.snakemake_patches import install\n", "sibling"),
    ],
)
def test_an_upward_or_sideways_import_fails(tmp_path, module, source, message):
    """The check catches what it is for: a copy of the package with one bad import added."""
    import shutil

    copy = tmp_path / "dflash_pipeline"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    (copy / module).write_text(source)
    found = violations(copy)
    assert len(found) == 1 and message in found[0] and module in found[0], found
