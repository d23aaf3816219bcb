"""Nothing is skipped silently in CI: a test skips only through ``tests.support.ci.skip_unless_ci``
(which fails under ``CI=true``, where ``.ci/run`` installs what it guards), a ``skipif`` that holds
only outside CI, or a ``skipif`` on a test marked ``cuda``; and every ``cuda`` test is named in
docs/internals.md, the list of the skips CI keeps."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
INTERNALS = TESTS.parent / "docs" / "internals.md"


def _modules():
    for path in sorted(TESTS.rglob("*.py")):
        if path != TESTS / "support" / "ci.py":
            yield path, ast.parse(path.read_text(), str(path))


def _dotted(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _markers(function) -> list:
    return [d for d in function.decorator_list if _dotted(d).startswith("pytest.mark.")]


def test_every_skip_fails_in_ci_unless_it_needs_a_cuda_device():
    found = []
    for path, tree in _modules():
        where = path.relative_to(TESTS.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _dotted(node) in ("pytest.skip", "pytest.importorskip"):
                found.append(f"{where}:{node.lineno}: {_dotted(node)}")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                marks = _markers(node)
                cuda = any(_dotted(m) == "pytest.mark.cuda" for m in marks)
                for mark in marks:
                    if _dotted(mark) != "pytest.mark.skipif" or cuda:
                        continue
                    condition = mark.args[0] if mark.args else None
                    only_outside_ci = any(
                        isinstance(n, ast.Call) and _dotted(n) == "in_ci" for n in ast.walk(condition or mark)
                    )
                    if not only_outside_ci:
                        found.append(f"{where}:{node.lineno}: skipif on {node.name}, neither cuda nor CI-aware")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                # A module-level skipif marker kept in a name (needs_plugin = pytest.mark.skipif(...)).
                if _dotted(node.value) == "pytest.mark.skipif":
                    calls = [n for n in ast.walk(node.value) if isinstance(n, ast.Call) and _dotted(n) == "in_ci"]
                    if not calls:
                        found.append(f"{where}:{node.lineno}: skipif marker without in_ci()")
    assert not found, "skips CI would keep silently:\n" + "\n".join(found)


def test_every_cuda_test_is_named_in_the_docs():
    text = INTERNALS.read_text()
    cuda = [
        node.name
        for _, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and any(_dotted(m) == "pytest.mark.cuda" for m in _markers(node))
    ]
    assert cuda, "no test is marked cuda: the docs' list of CI's skips is stale"
    assert [name for name in cuda if f"`{name}`" not in text] == []
