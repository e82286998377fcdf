"""The reading set stays readable in an afternoon: its line budget, counted as the docs count it.

The reading set is the table of ``docs/structures.md`` under "The reading set" (17 modules, ``device.py`` and
``engine_graph.py`` among them: no module leaves the count); each module splits at its
``# ------------------------------ argument checks`` line into code (above) and checks (below), raw lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKS_LINE = "# ------------------------------ argument checks"
CODE_BUDGET, CHECKS_BUDGET, ENGINE_CODE_BUDGET = 2400, 1000, 300
TUTORIAL_HELPERS = {"sparse_ref.workloads", "sparse_ref.metrics", "sparse_ref.offload", "sparse_ref.figures",
                    "sparse_ref.demo", "sparse_ref.bench"}


def reading_set() -> list[Path]:
    """The modules ``docs/structures.md`` names in its reading-set table (first column, under ``sparse_ref/``)."""
    text = (REPO / "docs" / "structures.md").read_text()
    table = text.split("## The reading set")[1].split("\n## ")[0]
    names = re.findall(r"^\| `([\w/]+\.py)` \|", table, flags=re.M)
    assert len(names) >= 10, f"no reading-set table found in docs/structures.md: {names}"
    return [REPO / "sparse_ref" / name for name in names]


def code_and_checks(path: Path) -> tuple[int, int]:
    lines = path.read_text().splitlines()
    cut = next((i for i, line in enumerate(lines) if line.startswith(CHECKS_LINE)), len(lines))
    return cut, len(lines) - cut


READING_SET = {"errors.py", "config.py", "memory.py", "batch.py", "selection.py", "algorithms/__init__.py",
               "algorithms/base.py", "algorithms/quest.py", "algorithms/dsa.py", "rope.py", "hadamard.py", "fp8.py",
               "adaptor.py", "attention.py", "engine.py", "engine_graph.py", "device.py"}


def test_every_module_of_the_table_exists_and_counts():
    names = {p.relative_to(REPO / "sparse_ref").as_posix() for p in reading_set()}
    assert names == READING_SET, names ^ READING_SET  # (no module leaves the count to fit, none joins unsaid)
    for path in reading_set():
        assert path.is_file(), f"docs/structures.md names {path.relative_to(REPO)}, which does not exist"
        code, checks = code_and_checks(path)
        assert code > 0 and checks >= 0


def test_the_reading_set_is_within_its_budget():
    counts = {p.relative_to(REPO / "sparse_ref").as_posix(): code_and_checks(p) for p in reading_set()}
    code, checks = sum(c for c, _ in counts.values()), sum(k for _, k in counts.values())
    assert code <= CODE_BUDGET, f"reading set: {code} lines of code above the checks, budget {CODE_BUDGET}: {counts}"
    assert checks <= CHECKS_BUDGET, f"reading set: {checks} lines of checks, budget {CHECKS_BUDGET}: {counts}"
    assert counts["engine.py"][0] <= ENGINE_CODE_BUDGET, f"engine.py: {counts['engine.py'][0]} lines of code"


def test_the_budget_counter_sees_a_checks_line():
    path = REPO / "sparse_ref" / "engine.py"
    code, checks = code_and_checks(path)
    assert checks > 0 and path.read_text().splitlines()[code].startswith(CHECKS_LINE)


def test_the_engine_imports_no_tutorial_helper_at_module_level():
    """Workloads, metrics, offload, figures: imported inside the functions that need them, never when the engine
    is imported (a reader of the engine meets the lifecycle, not the helpers)."""
    tree = ast.parse((REPO / "sparse_ref" / "engine.py").read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            top |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            top |= {a.name for a in node.names}
    assert not top & TUTORIAL_HELPERS, sorted(top & TUTORIAL_HELPERS)


def test_the_docs_fit_a_screen():
    """The map one sentence a module, the performance page in the present tense, the README a quickstart."""
    for path, most in (("docs/structures.md", 80), ("docs/performance.md", 300), ("README.md", 220)):
        lines = len((REPO / path).read_text().splitlines())
        assert lines <= most, f"{path}: {lines} lines, budget {most} (details belong in docs/)"


TOPK_WING, TOPK_WING_BUDGET = REPO / "sparse_ref" / "kernels" / "topk", 1300


def test_the_topk_wing_is_within_its_budget():
    """The exact top-k (``sparse_ref/kernels/topk/``: every line of its files, docstrings and checks included) stays
    readable: a design that adds lines takes as many out elsewhere."""
    counts = {p.name: len(p.read_text().splitlines()) for p in sorted(TOPK_WING.glob("*.py"))}
    assert len(counts) >= 8, counts
    assert sum(counts.values()) <= TOPK_WING_BUDGET, f"top-k wing: {sum(counts.values())} lines: {counts}"
