"""The package's layers: every import points down, never up and never sideways.

Each package of ``dflash_pipeline`` has a rank; a module may import from its own package and from
packages of a lower rank only. Packages of one rank are siblings that never import each other, so
each can be read (and tested) without the others. ``stages/`` is the top: nothing in the package
imports it. Imports inside functions count as much as those at the top of a module.

Above the package sit the workflow's own files, which only wire it, each to its own part of it
(``WIRING``): the rules plan (config, paths, resources, the plan-time checks and Snakemake's
patches, which nothing else installs), the scripts run one stage's job (its entry point and the
job glue). Neither imports another file of the workflow, and every module they name exists.
"""

from __future__ import annotations

import ast
import re
import shutil
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
# Snakemake's internals are patched in the process that plans a run: by the rules alone.
RULES_ONLY = "snakemake_patches"

REPO = PACKAGE.parent
# The packages each part of the workflow may import. The rules: the config, paths and resources
# (core, model), what a plan decides (engines.tuning: whether generate waits for tune;
# report.targets: what the run builds), the plan-time checks (training.offline's budget,
# stages.preflight) and the patches. The scripts: a stage's entry point (stages; the demo
# target's build, demo; the report's figures, report) and the job glue (core). Neither asks the
# status page (a process of its own), the data or the evaluation code directly.
WIRING: dict[str, set[str]] = {
    "rules": {"core", "model", "engines", "report", "training", "stages", RULES_ONLY},
    "scripts": {"core", "stages", "demo", "report"},
}


def package_of(module: str) -> str | None:
    """``dflash_pipeline.data.chat`` -> ``data``; None outside the package."""
    parts = module.split(".")
    if parts[0] != "dflash_pipeline":
        return None
    return parts[1] if len(parts) > 1 else ""


def import_statements(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, the names a ``from`` import takes from it) of every import in a
    file, relative imports resolved."""
    module = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name, [alias.name for alias in node.names]))
    return found


def imports_of(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file, relative imports resolved."""
    found = []
    for line, name, names in import_statements(path, package_dir):
        if name == "dflash_pipeline" and names:
            # `from dflash_pipeline import layout` names the subpackage in the alias
            found += [(line, f"{name}.{alias}") for alias in names]
        else:
            found.append((line, name))
    return found


def violations(package_dir: Path = PACKAGE) -> list[str]:
    """Every import that points up or sideways, as 'file:line: a imports b (why)'."""
    problems = []
    for path in sorted(package_dir.rglob("*.py")):
        own = package_of(".".join(path.relative_to(package_dir.parent).with_suffix("").parts))
        if own == "__main__":  # `python -m dflash_pipeline`: the top layer's command, nothing else
            wrong = [m for _, m in imports_of(path, package_dir) if package_of(m) not in (None, LAYERS[-1][0])]
            problems += [f"{path}: __main__ imports {m} (only {LAYERS[-1][0]}: the command)" for m in wrong]
            continue
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
            elif other == RULES_ONLY:
                problems.append(f"{where}: {own} imports {imported}: only the rules install Snakemake's patches")
            elif RANK[other] > RANK[own]:
                problems.append(f"{where}: {own} imports {imported} from a layer above it")
            elif RANK[other] == RANK[own]:
                problems.append(f"{where}: {own} imports its sibling layer {imported}")
    return problems


def copy_package(folder: Path) -> Path:
    """A copy of the package's code in ``folder``, for a test to add one bad import to."""
    copy = folder / "dflash_pipeline"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    return copy


def test_every_import_points_down():
    assert violations() == []


def module_name(path: Path, package_dir: Path = PACKAGE) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports; ``from a import b`` is
    module ``a.b`` where ``b`` is one (``from dflash_pipeline.core import layout``)."""
    files = {module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for _, name, names in import_statements(path, package_dir):
            submodules = {f"{name}.{alias}" for alias in names} & files.keys()
            targets |= submodules
            if len(submodules) < len(names) or not names:  # some names are the module's own
                targets.add(name)
        graph[module] = (targets & files.keys()) - {module}
    return graph


def import_cycles(package_dir: Path = PACKAGE) -> list[list[str]]:
    """The package's import circles: each set of modules that import one another, directly or
    round a loop (a strongly connected component of ``import_graph``), sorted."""
    graph = import_graph(package_dir)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_import_circle_inside_the_package():
    """Within a layer too, no two modules import each other, however indirectly: each module
    can be read knowing only the ones below it."""
    assert import_cycles() == []


@pytest.mark.parametrize(
    "module, source, circle",
    [
        ("core/layout.py", "def f():\n    from dflash_pipeline.core import checksums\n", "checksums"),
        ("core/storage_api.py", "from dflash_pipeline.core.storage import open_storage\n", "storage"),
        ("data/chat.py", "from . import tokenized\n", "tokenized"),
    ],
)
def test_an_import_circle_fails(tmp_path, module, source, circle):
    """The check catches what it is for: a copy of the package with one import that closes a
    circle (inside a function, through a relative import too)."""
    copy = copy_package(tmp_path)
    with open(copy / module, "a") as fh:
        fh.write(source)
    (found,) = import_cycles(copy)
    own = "dflash_pipeline." + module.removesuffix(".py").replace("/", ".")
    assert own in found and any(m.endswith("." + circle) for m in found), found


# `from x import y` or `import x` at the start of a line of a .smk file (Snakemake's Python lines).
SMK_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w, ()]+)|import\s+([\w.]+))", re.M)


def wiring_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a rule file or a script; ``from dflash_pipeline.x import
    y`` is ``dflash_pipeline.x.y`` where y is a module."""
    if path.suffix == ".py":
        found = imports_of(path, path.parent)
    else:
        text = path.read_text()
        found = []
        for match in SMK_IMPORT.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            module = match.group(1) or match.group(3)
            names = [n.strip() for n in (match.group(2) or "").replace("(", "").split(",") if n.strip()]
            found += (
                [(line, f"{module}.{n.split()[0]}") for n in names] if module == "dflash_pipeline" else [(line, module)]
            )
    return found


def module_exists(module: str, root: Path = REPO) -> bool:
    """Whether ``dflash_pipeline.a.b`` is a module or a package of the checkout."""
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def wiring_violations(root: Path = REPO) -> list[str]:
    """Every import of a rule file or a script outside its part of the package, of another file
    of the workflow, or of a module that does not exist."""
    problems = []
    files = {"rules": sorted((root / "rules").glob("*.smk")), "scripts": sorted((root / "scripts").glob("*.py"))}
    files["rules"].insert(0, root / "Snakefile")
    for part, paths in files.items():
        for path in paths:
            for line, imported in wiring_imports(path):
                where = f"{path.relative_to(root)}:{line}"
                top = imported.split(".")[0]
                if top in ("rules", "scripts", "tests"):
                    problems.append(
                        f"{where}: imports {imported}, a file of the workflow (the package holds shared code)"
                    )
                if top != "dflash_pipeline":
                    continue
                package = package_of(imported)
                if package not in WIRING[part]:
                    problems.append(f"{where}: {part} import {imported} (allowed: {', '.join(sorted(WIRING[part]))})")
                elif not module_exists(imported, root):
                    problems.append(f"{where}: imports {imported}, which does not exist")
    return problems


def test_the_rules_and_the_scripts_import_only_their_part_of_the_package():
    assert wiring_violations() == []


@pytest.mark.parametrize(
    "path, source, message",
    [
        ("rules/extra.smk", "from dflash_pipeline.status.server import serve\n", "rules import"),
        ("rules/extra.smk", "def f():\n    from dflash_pipeline.evaluation import loop\n", "rules import"),
        ("scripts/extra.py", "from dflash_pipeline.training.trainer import train\n", "scripts import"),
        ("scripts/extra.py", "from dflash_pipeline.snakemake_patches import install\n", "scripts import"),
        ("scripts/extra.py", "from dflash_pipeline.stages.nothing_here import run\n", "does not exist"),
        ("rules/extra.smk", "from scripts.generate import main\n", "a file of the workflow"),
    ],
)
def test_a_rule_or_script_import_outside_its_part_fails(tmp_path, path, source, message):
    """The check catches what it is for: a copy of the workflow's files with one bad import."""
    for name in ("rules", "scripts"):
        shutil.copytree(REPO / name, tmp_path / name)
    shutil.copy(REPO / "Snakefile", tmp_path / "Snakefile")
    copy_package(tmp_path)
    (tmp_path / path).write_text(source)
    found = wiring_violations(tmp_path)
    assert len(found) == 1 and message in found[0] and path in found[0], found


def test_only_the_rules_install_snakemakes_patches(tmp_path):
    copy = copy_package(tmp_path)
    (copy / "stages" / "extra.py").write_text("from dflash_pipeline.snakemake_patches.planning import PATCHES\n")
    found = violations(copy)
    assert len(found) == 1 and "only the rules install" in found[0], found


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(RANK)
    # __main__.py: `python -m dflash_pipeline`, which hands over to stages.command at once.
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")], (
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
        ("model/extra.py", "from dflash_pipeline.snakemake_patches import install\n", "only the rules install"),
    ],
)
def test_an_upward_or_sideways_import_fails(tmp_path, module, source, message):
    """The check catches what it is for: a copy of the package with one bad import added."""
    copy = copy_package(tmp_path)
    (copy / module).write_text(source)
    found = violations(copy)
    assert len(found) == 1 and message in found[0] and module in found[0], found


def test_the_scripts_folder_holds_only_the_rules_thin_entry_points():
    """scripts/ is what the rules run: each file a few lines of glue called by a rule's
    ``script:``; install tools live in tools/ and logic in the package."""
    called = set()
    for smk in [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]:
        called |= set(re.findall(r'scripts/(\w+\.py)"', smk.read_text()))
    scripts = {p.name: len(p.read_text().splitlines()) for p in (REPO / "scripts").glob("*.py")}
    assert sorted(scripts) == sorted(called), "scripts/ has files no rule runs, or a rule runs a missing one"
    assert {name: n for name, n in scripts.items() if n > 30} == {}
