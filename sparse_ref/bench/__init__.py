"""Side-by-side GPU timings: ``python -m sparse_ref.bench SUITE [SUITE ...] [--quick] [--out PATH]``.

SUITE is ``topk``, ``sweep``, ``select``, ``quest``, ``retrieve``, ``decode``, ``dsa``, ``engine``, ``offload`` (or one
of its parts: ``offload_capacity``, ``offload_swap``, ``offload_step``, ``offload_hits``) or ``all``; several
may be given (``python -m sparse_ref.bench quest retrieve``). One module per suite (its docstring says what it
measures), all timed by ``timing.py``: CUDA events around CUDA-graph replays, median of many calls,
L2 cold (a 1 GiB buffer zeroed before each call) or warm, against the copy bandwidth measured in the
same run, and always beside the baseline under the same output contract.

Without ``--out`` the JSON goes to ``build/bench/<suites>-<gpu|cpu>.json`` (ignored by git); the
committed GPU results in ``benchmarks/results/`` are written only with an explicit ``--out``, and
never by a CPU run. ``docs/performance.md`` gives the targets, where the time goes and what was tried.

On CPU (Triton's interpreter) it refuses to run unless ``--allow-cpu`` is given; such results
are labelled as CPU results and are not GPU numbers.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

import torch

import sparse_ref
from sparse_ref.bench.decode import bench_decode
from sparse_ref.bench.dsa import bench_dsa
from sparse_ref.bench.engine import bench_engine
from sparse_ref.bench.offload import PARTS as OFFLOAD_PARTS
from sparse_ref.bench.offload import bench_offload
from sparse_ref.bench.quest import bench_quest, bench_retrieve
from sparse_ref.bench.timing import COPY_DETAIL, Timer, copy_bandwidth
from sparse_ref.bench.topk import bench_select, bench_topk, bench_topk_sweep
from sparse_ref.cli import cli_environment, cli_output_file, cli_parser, json_safe

SUITES = {"topk": bench_topk, "sweep": bench_topk_sweep, "select": bench_select, "quest": bench_quest,
          "retrieve": bench_retrieve, "decode": bench_decode, "dsa": bench_dsa, "engine": bench_engine,
          "offload": bench_offload, **OFFLOAD_PARTS}



def main(argv=None) -> dict:
    parser = cli_parser("python -m sparse_ref.bench", __doc__.split("\n")[0])
    parser.add_argument("suite", nargs="+", choices=[*SUITES, "all"], help="one or more suites, or all")
    parser.add_argument("--quick", action="store_true", help="fewer distributions and repetitions")
    parser.add_argument("--out", default=None, type=cli_output_file,
                        help=f"where to write the JSON (default: {DEFAULT_OUT}, e.g. build/bench/topk-gpu.json; "
                             f"committed GPU results go to {RESULTS_DIR}/ only with an explicit --out)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on CPU through Triton's interpreter (tiny sizes; not GPU numbers; never written "
                             f"into {RESULTS_DIR}/)")
    args = parser.parse_args(argv)
    cli_environment(parser)
    device = sparse_ref.default_device()
    on_cpu = device.type != "cuda"
    if on_cpu and not args.allow_cpu:
        parser.error("argument --allow-cpu: expected on a machine with no CUDA GPU (or TRITON_INTERPRET on): "
                     "interpreter timings say nothing about the kernels. Run it on a GPU, or pass --allow-cpu for "
                     "a smoke run whose results are labelled as CPU results (never commit them as GPU numbers)")
    out = args.out or default_out(args.suite, on_cpu)
    if on_cpu and _in_results_dir(out):
        parser.error(f"argument --out: expected a file outside {RESULTS_DIR}/ (the committed GPU results) on a CPU "
                     f"run, got {out}. Drop --out (it defaults to {default_out(args.suite, on_cpu)}) or write "
                     "somewhere else")
    import triton

    timer = Timer(device, reps=2 if on_cpu else (30 if args.quick else 100))
    gpu = torch.cuda.get_device_name() if not on_cpu else "CPU (Triton interpreter) - NOT GPU numbers"
    print(f"sparse_ref.bench on {gpu}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    copy_bw = copy_bandwidth(device, timer)
    print(f"device-to-device copy bandwidth: {'n/a on CPU' if on_cpu else f'{copy_bw:.2f} TB/s'}", flush=True)
    suites = [s for s in SUITES if s not in OFFLOAD_PARTS] if "all" in args.suite else list(dict.fromkeys(args.suite))
    rows = []
    for i, name in enumerate(suites):
        print(f"== {name}", flush=True)
        rows += SUITES[name](device, timer, copy_bw, args.quick, on_cpu)
        # Written after every suite, so a run cut short still leaves the suites it finished.
        result = dict(
            command="python -m sparse_ref.bench " + " ".join(sys.argv[1:] if argv is None else argv),
            gpu=gpu, cpu_only=on_cpu, torch=torch.__version__, triton=triton.__version__,
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            suites_done=suites[: i + 1], complete=i == len(suites) - 1,
            copy_bandwidth_tbps=None if on_cpu else round(copy_bw, 3),
            copy_bandwidth_detail=dict(COPY_DETAIL, note="1 GiB fp32, read + write bytes, eager, median of 20"),
            timing=("CUDA events around a CUDA-graph replay of one call, median of many; L2 cold = 1 GiB buffer "
                    "zeroed before each call, inputs rotated over 4 copies; L2 warm = replay of a graph of 20 calls "
                    "on one input, divided by 20. Rows say how each side was timed (torch_timing, ours_timing: "
                    "graph, eager or wall clock)."),
            rows=rows,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(json_safe(result), indent=1, allow_nan=False))  # NaN -> null: valid JSON
    print("\n" + summary_table(rows))
    if on_cpu:
        print("(a CPU run through Triton's interpreter: bandwidth is n/a on CPU, and these are not GPU numbers)")
    print(f"wrote {out}")
    return result



def summary_table(rows: list[dict]) -> str:
    """The run's rows as a table whose columns are as wide as their longest cell (a name never runs into the next
    column); a number that is missing or not finite prints as ``-``."""
    def cell(value, digits):
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)

    columns = (("op", "op", None), ("shape", "shape", None), ("k", "k", None), ("dist", "distribution", None),
               ("L2", "l2", None), ("torch us", "torch_us", 1), ("ours us", "ours_us", 1), ("x", "speedup", 2),
               ("TB/s", "tbps", 2), ("%copy", "pct_copy_bw", 1))
    table = [[head for head, _, _ in columns]]
    table += [[cell(r.get(key), digits or 0) for _, key, digits in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(text.ljust(w) if i < 5 else text.rjust(w)  # names flush left, numbers flush right
                       for i, (text, w) in enumerate(zip(line, widths, strict=True))) for line in table]
    return "\n".join(line.rstrip() for line in lines)



RESULTS_DIR = "benchmarks/results"  # committed GPU results; never written by a CPU run

DEFAULT_OUT = "build/bench/<suites>-<gpu|cpu>.json"



def default_out(suites: list[str], on_cpu: bool) -> Path:
    """Where a run writes its JSON without ``--out``: an ignored build folder, never the committed results."""
    return Path("build", "bench", f"{'+'.join(dict.fromkeys(suites))}-{'cpu' if on_cpu else 'gpu'}.json")



def _in_results_dir(path: Path) -> bool:
    """True when ``path`` lies in a ``benchmarks/results`` folder (relative to anywhere)."""
    parts = path.resolve().parts
    return any(parts[i:i + 2] == ("benchmarks", "results") for i in range(len(parts) - 1))

