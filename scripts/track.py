"""The 55-minute track of the README ("Teaching this in an hour"): which cells, and how long they take.

    .venv/bin/python scripts/track.py            # count every row, then run the notebooks and time the cells
    .venv/bin/python scripts/track.py --no-run   # count only

A presenter runs every cell of a notebook (the cells before a named one build its state) and talks through
the named cells only. Each row's minutes are estimated from what the audience reads, at a presenter's pace:
prose spoken at 130 words a minute, torch code read at 6 lines a minute, a Triton kernel at 3 lines a
minute (the lesson source that ``drawing.show_lesson`` prints counts as kernel lines), and a minute for each
figure (plotting code is run, not read). ``--run`` (the default) also executes each notebook with nbclient,
as a CPU laptop would, and adds the named cells' run time. ``tests/test_track.py`` holds every row's anchor
text and the total to 55 minutes.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEECH_WPM, TORCH_LPM, TRITON_LPM, FIGURE_MIN = 130, 6, 3, 1.0
BUDGET_MIN = 55
FIGURE_HELPERS = ("show_pools", "show_table")  # drawing helpers that show a figure themselves


@dataclass(frozen=True)
class Row:
    notebook: str
    cells: tuple[int, ...]
    anchor: str  # text the first named cell contains (so the indices cannot drift silently)
    sees: str  # what the audience sees


TRACK = (
    Row("00_overview", (6, 7), "## 1. The decode step as a picture",
        "the decode step as a picture: pools, scores, selection, page table, attention"),
    Row("02_retrieval_contract", (7, 8, 9, 11, 12, 15), "### What a req_to_token row holds past its length",
        "a stale row: past its length a row names another request's pages; the first SGLang error, its fix"),
    Row("03_quest", (11,), "## 2. The upper bound",
        "Quest's bound as a 3-line function (the next cell checks it on random pages: say its result)"),
    Row("04_dsa_indexer", (0, 26, 27), "# 04 · The DeepSeek DSA lightning indexer",
        "the DSA moment: what the indexer computes, and the causal scores and top-k of a prompt"),
    Row("04_dsa_indexer", (36, 38, 39), "## The second seed error",
        "the second SGLang error, now that the indexer is known: DSA's retrieval needs it and its inputs; the fix"),
    Row("05_triton_topk", (4, 5, 27, 28, 30, 31, 32, 33, 34), "## 0. One Triton program: a primer",
        "the top-k moment: one Triton program (a primer), then a radix select in full with the helpers it calls "
        "(keys, the histogram walk, the ordered compaction), equal to the reference on ties, NaN, -inf and short "
        "rows"),
    Row("07_end_to_end", (0, 9, 10, 13, 36), "# 07",
        "the engine's hooks (their table), walked by hand; why the Quest layer's error is 1.07; the step as one "
        "picture"),
    Row("09_decode_kernels", (12, 14), "## 2. Paged flash-decode attention",
        "the decode kernels' picture: a row split into slices, merged by log-sum-exp"),
    Row("10_offload", (0, 6), "# 10",
        "the close: the hot buffer, then memory against bandwidth, the whole trade of offload in one picture"),
)


def load(notebook: str):
    import nbformat

    return nbformat.read(ROOT / "notebooks" / f"{notebook}.ipynb", as_version=4)


def lesson_lines(source: str) -> int:
    """Lines of lesson source a ``drawing.show_lesson(...)`` call in ``source`` prints."""
    sys.path[:0] = [str(ROOT / "kernels")]
    lines = 0
    tree = ast.parse("\n".join(s for s in source.splitlines() if not s.startswith(("%", "!"))))
    imported = {a.asname or a.name: node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "drawing.show_lesson":
            for arg in node.args:
                fn = getattr(importlib.import_module(imported[arg.id]), arg.id)
                while hasattr(fn, "fn"):
                    fn = fn.fn
                lines += len(inspect.getsourcelines(fn)[0])
    return lines


def estimate(cell) -> dict:
    """Words, code lines (torch / Triton), figures and the presenting minutes of one cell."""
    text = cell.source
    if cell.cell_type == "markdown":
        words = len(text.split())
        return {"words": words, "torch": 0, "triton": 0, "figures": 0, "minutes": words / SPEECH_WPM}
    code = [line for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    figures = text.count("show_figure(") + sum(text.count(f"drawing.{name}(") for name in FIGURE_HELPERS)
    triton = lesson_lines(text) + (len(code) if "@triton.jit" in text else 0)
    plotting = ("fig", "ax.", "ax,", "plt.", "show_figure", "drawing.", '"', "f\"")  # run, not read
    torch_lines = 0 if "@triton.jit" in text else sum(not line.strip().startswith(plotting) for line in code)
    return {"words": 0, "torch": torch_lines, "triton": triton, "figures": figures,
            "minutes": torch_lines / TORCH_LPM + triton / TRITON_LPM + figures * FIGURE_MIN}


def row_counts(row: Row) -> dict:
    nb = load(row.notebook)
    total = {"words": 0, "torch": 0, "triton": 0, "figures": 0, "minutes": 0.0}
    for i in row.cells:
        for key, value in estimate(nb.cells[i]).items():
            total[key] += value
    return total


def run_times(notebook: str, cells: tuple[int, ...]) -> tuple[float, float]:
    """Seconds the named cells take, and all cells up to the last named one (what runs before the talk), when
    the notebook runs from the top on this machine (nbclient)."""
    import os
    import tempfile

    from nbclient import NotebookClient

    profile = Path(tempfile.mkdtemp()) / "profile_default"  # a quiet kernel: no start-up warning per notebook
    profile.mkdir()
    (profile / "ipython_kernel_config.py").write_text('c.IPKernelApp.log_level = "ERROR"\n')
    os.environ["IPYTHONDIR"] = str(profile.parent)
    nb = load(notebook)
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}})
    named = everything = 0.0
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells[: max(cells) + 1]):
            start = time.perf_counter()
            client.execute_cell(cell, i)
            everything += time.perf_counter() - start
            named += (time.perf_counter() - start) * (i in cells)
    return named, everything


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-run", action="store_true", help="count only; do not execute the notebooks")
    args = parser.parse_args(argv)
    print(f"{'min':>9}  {'notebook':<22} {'cells':<28} {'words':>5} {'torch':>5} {'triton':>6} {'figs':>4} "
          f"{'run s':>5} {'prep s':>6}")
    clock = prep = 0.0
    for row in TRACK:
        counts = row_counts(row)
        run_s, all_s = (0.0, 0.0) if args.no_run else run_times(row.notebook, row.cells)
        minutes = counts["minutes"] + run_s / 60
        cells = ", ".join(f"c{i}" for i in row.cells)
        print(f"{clock:4.0f}-{clock + minutes:<4.0f}  {row.notebook:<22} {cells:<28} {counts['words']:>5} "
              f"{counts['torch']:>5} {counts['triton']:>6} {counts['figures']:>4} {run_s:>5.1f} {all_s:>6.1f}",
              flush=True)
        clock, prep = clock + minutes, prep + all_s
    print(f"total {clock:.1f} minutes (budget {BUDGET_MIN})" + (" (counted, not run)" if args.no_run else
          f"; running every cell up to the last named one, before the talk: {prep:.0f} s"))
    return clock


if __name__ == "__main__":
    main()
