"""Write the student copies of the notebooks: every exercise's solution replaced by a stub.

    python scripts/student_copy.py notebooks/*.ipynb --out build/exercises   (make exercises)

An exercise is a code cell tagged ``solution``: it defines one or more functions and ends with a checker
call (``checkers.check_name(name)``). In the student copy each function keeps its signature and docstring
and its body becomes ``raise NotImplementedError(...)``, so the checker fails until the student writes it;
the rest of the cell (the checker call) stays. The committed notebooks run the solutions under nbmake.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import nbformat

TAG = "solution"
STUB = 'raise NotImplementedError("exercise: write {name}, then run this cell")'


def is_solution(cell) -> bool:
    return cell.cell_type == "code" and TAG in cell.get("metadata", {}).get("tags", [])


def stub_source(source: str) -> str:
    """``source`` with the body of every top-level function (decorated ones too) replaced by a stub."""
    lines = source.splitlines()
    tree = ast.parse(source)
    out, cursor = [], 0
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        first = node.body[0]
        if first.lineno == node.lineno:  # a one-line def (``def f(x): return x``): keep its header, stub below it
            header = lines[node.lineno - 1][: first.col_offset].rstrip()
            out += lines[cursor:node.lineno - 1] + [header, " " * (node.col_offset + 4) + STUB.format(name=node.name)]
            cursor = node.end_lineno
            continue
        keep_to = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str) else first.lineno - 1  # the docstring stays
        indent = " " * first.col_offset
        out += lines[cursor:keep_to] + [indent + STUB.format(name=node.name)]
        cursor = node.end_lineno
    out += lines[cursor:]
    return "\n".join(line for line in out if line.strip() != "# solution")


def student_notebook(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if is_solution(cell):
            cell.source = stub_source(cell.source)
            cell.metadata["tags"] = [t for t in cell.metadata["tags"] if t != TAG] + ["exercise"]
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("build") / "exercises")
    args = parser.parse_args(argv)
    sources = {path.resolve().parent for path in args.notebooks}
    if args.out.resolve() in sources:
        parser.error(f"argument --out: expected a folder other than the notebooks' own ({args.out}): the student "
                     "copies would overwrite the solutions. Fix: --out build/exercises")
    for path in args.notebooks:
        if path.suffix != ".ipynb" or not path.is_file():
            parser.error(f"argument notebooks: expected .ipynb files, got {str(path)!r} ("
                         f"{'not a notebook' if path.is_file() else 'no such file'}). Fix: make exercises")
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.notebooks:
        nb = student_notebook(path)
        count = sum("exercise" in c.get("metadata", {}).get("tags", []) for c in nb.cells)
        nbformat.write(nb, args.out / path.name)
        print(f"{args.out / path.name}: {count} exercises")
    for helper in ("checkers.py", "drawing.py"):  # what the notebooks import from their folder
        source = args.notebooks[0].parent / helper
        if source.exists():
            (args.out / helper).write_text(source.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
