"""Where one top-k kernel spends its time, per line of the package's kernel code, from Nsight Compute.

    python benchmarks/ncu_lines.py --rows 1 --cols 131072 --kernel _select_kernel [--k 2048] [--dist randn] [--out DIR]

Runs one ``topk`` call under ``ncu`` after a warm-up call that compiles the kernels (warp-state samples at
the finest interval, per-instruction counters), exports the kernel's SASS with each instruction's stall
samples and execution count (``ncu --page source --print-source sass``), disassembles the same kernel's
cubin from Triton's cache with line info (``nvdisasm -g``), and joins the two by instruction offset.
It prints, per line of ``kernels/*.py``, the share of the warp-stall samples (where the warps waited)
and of the executed instructions (what they issued). Instructions of Triton's own helpers (``tl.cumsum``,
``tl.sum``: lines of ``triton/language/standard.py``) count under the last package line before them.

Needs a CUDA GPU on which ``ncu`` may read the counters (``--clock-control none`` leaves the clocks as they
are), and ``nvdisasm`` (CUDA toolkit). Without ``--out`` the files go to a temporary folder.

    python benchmarks/ncu_lines.py --join SASS_CSV LINES_TXT --kernel _select_kernel

joins files made elsewhere (the two exports above).
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict

PACKAGE_FILES = re.compile(r"(topk|topk_common|topk_fallback|topk_sort|page_select|dsa|quest|page_table|"
                           r"decode_attention)\.py$")


def run_target(rows: int, cols: int, dist: str, k: int) -> None:
    """The profiled program: two top-k calls (the first compiles; ncu skips its launches)."""
    import torch

    import sparse_ref  # noqa: F401  (interpreter set-up; a GPU is required here)
    from sparse_ref.bench import make_distribution
    from sparse_ref.kernels.topk import topk

    x = make_distribution(dist, rows, cols, torch.device("cuda"), seed=0)
    for _ in range(2):
        topk(x, k, order="index")
    torch.cuda.synchronize()


def cubin_of(kernel: str) -> str:
    """The newest cubin of ``kernel`` in Triton's cache."""
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    found = glob.glob(os.path.join(cache, "*", f"{kernel}.cubin"))
    if not found:
        sys.exit(f"no {kernel}.cubin under {cache}: did the profiled call compile it?")
    return max(found, key=os.path.getmtime)


def profile(args) -> tuple[str, str]:
    """Run ncu on this script's target mode, then export the SASS page and disassemble the cubin."""
    out = args.out or tempfile.mkdtemp(prefix="ncu_lines_")
    os.makedirs(out, exist_ok=True)
    rep = os.path.join(out, args.kernel)
    target = [sys.executable, os.path.abspath(__file__), "--target", str(args.rows), str(args.cols), args.dist,
              str(args.k)]
    subprocess.run(["ncu", "--clock-control", "none", "--section", "WarpStateStats", "--section", "SourceCounters",
                    "--warp-sampling-interval", "0", "-k", f"regex:^{args.kernel}$", "--launch-skip", "1",
                    "--launch-count", "1", "-f", "-o", rep, *target], check=True)
    sass = rep + "_sass.csv"
    with open(sass, "w") as f:
        subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                       stdout=f, check=True)
    lines = rep + "_lines.txt"
    with open(lines, "w") as f:
        subprocess.run(["nvdisasm", "-g", "-c", cubin_of(args.kernel)], stdout=f, stderr=subprocess.DEVNULL,
                       check=True)
    print(f"files in {out}")
    return sass, lines


def line_of_offset(lines_txt: str) -> dict[int, tuple[str, int]]:
    """Instruction offset -> (file, line) of the last package line at or before it, from ``nvdisasm -g``."""
    where, here = {}, ("?", 0)
    for text in open(lines_txt):
        m = re.match(r'\s*//## File "(.*)", line (\d+)', text)
        if m:
            if PACKAGE_FILES.search(m.group(1)):
                here = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", text)
        if m:
            where[int(m.group(1), 16)] = here
    return where


def sass_rows(sass_csv: str, kernel: str) -> list[dict]:
    """The kernel's SASS rows of ncu's source page (one per instruction, in address order)."""
    rows, name, header = [], None, None
    for r in csv.reader(open(sass_csv)):
        if r and r[0] == "Kernel Name":
            name = r[1]
        elif r and r[0] == "Address":
            header = r
        elif header and name == kernel and len(r) == len(header):
            rows.append(dict(zip(header, r, strict=True)))
    if not rows:
        sys.exit(f"no SASS rows of {kernel} in {sass_csv}")
    return rows


def join(sass_csv: str, lines_txt: str, kernel: str, min_share: float = 0.5) -> None:
    """Print the share of stall samples and executed instructions per package line."""
    rows = sass_rows(sass_csv, kernel)
    where = line_of_offset(lines_txt)
    base = int(rows[0]["Address"], 16)
    per_line = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        loc = where.get(int(r["Address"], 16) - base, ("?", 0))
        per_line[loc][0] += float(r["Warp Stall Sampling (All Samples)"] or 0)
        per_line[loc][1] += float(r["Instructions Executed"] or 0)
    samples = sum(v[0] for v in per_line.values()) or 1.0
    executed = sum(v[1] for v in per_line.values()) or 1.0
    print(f"{kernel}: {len(rows)} SASS instructions, {samples:.0f} stall samples, {executed:.0f} warp instructions "
          f"executed; lines with at least {min_share}% of either:")
    print(f"{'file:line':<24} {'stalls %':>8} {'instr %':>8}")
    for (file, line), (s, e) in sorted(per_line.items()):
        if 100 * s / samples >= min_share or 100 * e / executed >= min_share:
            print(f"{f'{file}:{line}':<24} {100 * s / samples:8.1f} {100 * e / executed:8.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--cols", type=int, default=131072)
    ap.add_argument("--dist", default="randn")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--kernel", default="_select_kernel")
    ap.add_argument("--out", default=None, help="folder for the ncu report and the exports")
    ap.add_argument("--join", nargs=2, metavar=("SASS_CSV", "LINES_TXT"), help="join exports made elsewhere")
    ap.add_argument("--target", nargs=4, help=argparse.SUPPRESS)  # the profiled program (internal)
    args = ap.parse_args(argv)
    if args.target:
        run_target(int(args.target[0]), int(args.target[1]), args.target[2], int(args.target[3]))
        return 0
    sass, lines = args.join if args.join else profile(args)
    join(sass, lines, args.kernel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
