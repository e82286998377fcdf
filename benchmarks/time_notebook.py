"""Where a notebook spends its time: run its code cells in order (as nbmake would) and time each one.

    SPARSE_REF_FAST=0 python benchmarks/time_notebook.py notebooks/07_end_to_end.ipynb

Runs from the notebook's folder (relative paths resolve as under nbmake), with matplotlib's Agg
backend; prints each code cell's seconds and first line, slowest first, and the total. Exit code
1 if a cell raises (after printing the table so far).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import matplotlib
import nbformat

matplotlib.use("Agg")


def main(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    os.chdir(Path(path).resolve().parent)
    namespace: dict = {"__name__": "__main__"}
    times, status, start = [], 0, time.perf_counter()
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        t0 = time.perf_counter()
        try:
            exec(compile(cell.source, f"<cell {i}>", "exec"), namespace)
        except Exception:
            traceback.print_exc()
            status = 1
        first = next((line for line in cell.source.splitlines() if line.strip() and not line.startswith("#")), "")
        times.append((time.perf_counter() - t0, i, first[:70]))
        print(f"cell {i:>2}: {times[-1][0]:7.1f} s  {first[:70]}", flush=True)
        if status:
            break
        import matplotlib.pyplot as plt

        plt.close("all")
    print(f"\n{'seconds':>8}  cell  first line (slowest first); total {time.perf_counter() - start:.1f} s")
    for seconds, i, first in sorted(times, reverse=True):
        print(f"{seconds:>8.1f}  {i:>4}  {first}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
