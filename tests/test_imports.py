"""The package's import graph has no cycle, counting the imports inside functions too.

Dependencies point one way: notebooks -> the reading set -> ``sparse_ref.kernels`` -> torch and triton.
Each module's argument checks live with the module (``checks.py`` keeps only the shared helpers), so no
check has to import a module above it. These tests read the sources (no import runs), so a lazy import
that closes a loop is caught as surely as an eager one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sparse_ref"
LEAVES = {"sparse_ref.errors", "sparse_ref.checks", "sparse_ref.device"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str, known: dict[str, Path]) -> str:
    """The package module that an import of ``name`` loads (the longest known prefix)."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """Every sparse_ref module ``path`` imports, at module level or inside a function (not under TYPE_CHECKING)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {resolve(n, known) for n in names if n.split(".")[0] == "sparse_ref"}
    return found - {me}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(p, known) for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    """The package root counts as a module: ``from sparse_ref import ForwardBatch`` inside a module that the root
    imports would loop through ``__init__``."""
    found = cycles(graph())
    assert found == [], f"import cycles (lazy imports counted): {found}"


def test_cycle_finder_finds_a_planted_cycle():
    """The finder itself: a lazy import of engine from checks (the cycle this layout removed) is reported."""
    edges = graph()
    edges["sparse_ref.checks"] = edges["sparse_ref.checks"] | {"sparse_ref.engine"}
    found = cycles(edges)
    assert any("sparse_ref.checks" in g and "sparse_ref.engine" in g for g in found)


def test_lazy_imports_are_seen():
    """A function-level import counts: the backend reaches the page-select kernel only inside a function."""
    assert "sparse_ref.kernels.page_select" in graph()["sparse_ref.backend"]


def test_the_reading_set_reaches_the_kernels_only_through_the_backend():
    """Below the engine, no module imports a kernel: the backend's table is the one door (its torch twins register
    themselves there, so the backend imports nothing above it)."""
    edges = graph()
    for m, deps in edges.items():
        if m.startswith(("sparse_ref.kernels", "sparse_ref.bench")) or m == "sparse_ref.backend":
            continue
        assert not {d for d in deps if d.startswith("sparse_ref.kernels")}, f"{m} imports a kernel module"
    assert edges["sparse_ref.backend"] <= LEAVES | {m for m in edges if m.startswith("sparse_ref.kernels")}


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaves_import_only_leaves(leaf):
    assert graph()[leaf] <= LEAVES, f"{leaf} imports {graph()[leaf] - LEAVES}"


def test_kernels_import_only_leaves_and_kernels():
    """A kernel module imports errors, checks, device and other kernel modules; configs and pools arrive as
    arguments (a kernel that imported the reading set would point the dependency the wrong way)."""
    for m, deps in graph().items():
        if m.startswith("sparse_ref.kernels"):
            wrong = {d for d in deps if d not in LEAVES and not d.startswith("sparse_ref.kernels")}
            assert not wrong, f"{m} imports {wrong}"


def test_checks_helpers_stay_small():
    """``checks.py`` holds only the helpers shared by several modules; each module owns its entry-point checks."""
    assert len((PACKAGE / "checks.py").read_text().splitlines()) < 400


def test_no_kernel_module_imports_a_private_name_of_another():
    """The fast tier's modules share device helpers by public names (``common.py``'s ``keys_of``, ``narrow_window``,
    ...): a reader who meets a name in one kernel file finds it defined, public, in the one it comes from."""
    private = []
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparse_ref"):
                private += [f"{path.relative_to(PACKAGE)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not private, private
