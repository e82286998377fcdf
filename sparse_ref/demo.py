"""``python -m sparse_ref.demo``: the decode engine on a planted workload, sparse against dense.

Runs ``sparse_ref.engine.DecodeEngine`` with Quest (GQA ``mean`` and ``per_kv_head``) and DeepSeek
DSA at a few token budgets, all on the same seeded workload, and prints one row per run:
recall of the true top pages (Quest) or tokens (DSA), attention mass kept, output error against
dense attention, and, on a GPU, the time of a decode step sparse and dense. A plot of the three
accuracy measures against the budget is saved (``--out``, default ``build/demo.png``).

    python -m sparse_ref.demo            # the default run (well under a minute on a laptop CPU)
    python -m sparse_ref.demo --quick    # the smoke test CI runs
    torchrun --standalone --nproc-per-node 2 -m sparse_ref.demo --tp 2   # heads over 2 ranks (demo_tp)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparse_ref.cli import cli_environment, cli_image_file, cli_output_file, cli_parser, cli_positive_int
from sparse_ref.config import SparseConfig
from sparse_ref.device import default_device, describe_run
from sparse_ref.engine import DecodeEngine
from sparse_ref.workloads import PlantedEngineWorkload

# (label, algorithm, Quest GQA mode)
METHODS = (("quest (mean)", "quest", "mean"), ("quest (per_kv_head)", "quest", "per_kv_head"),
           ("dsa", "deepseek_dsa", "mean"))


@dataclass
class Row:
    method: str
    budget: int  # tokens: Quest keeps budget / page_size pages (sink + history + recent), DSA budget tokens
    recall: float
    needles_found: float  # share of the planted needles (both kinds) whose page / token was kept
    mass_kept: float
    output_error: float
    sparse_ms: float  # per decode step, all layers; meaningful on a GPU only
    dense_ms: float


def run_one(workload: PlantedEngineWorkload, algorithm: str, gqa_mode: str, budget: int, *, context: int,
            batch: int, steps: int, page_size: int = 16, device="cpu", backend: str = "auto") -> Row:
    """Decode ``steps`` tokens for ``batch`` requests of ``context`` tokens; average over steps, layers, rows."""
    recent = 2
    config = SparseConfig(page_budget=max(budget // page_size - recent, 1), num_recent_pages=recent,
                          gqa_mode=gqa_mode)
    engine = DecodeEngine(workload, [algorithm] * workload.num_layers, config,
                          dsa_topk=min(budget, context + steps + 1),  # (a budget past the context keeps everything)
                          page_size=page_size, max_requests=batch, max_context_len=context + steps + 1,
                          backend=backend, device=device)
    for i in range(batch):
        engine.add_request(context - 7 * i, key=i)  # slightly different lengths, each with its own needles
    engine.step()  # warm-up (first-call costs), not counted
    totals = torch.zeros(6, dtype=torch.float64)
    for _ in range(steps):
        result = engine.step()
        for t in result.layers:
            measures = [t.recall.mean(), needles_found(engine, result, t), t.mass_kept.mean(), t.output_error.mean()]
            totals[:4] += torch.tensor([float(m) for m in measures], dtype=torch.float64)
        totals[4:] += torch.tensor([result.sparse_time_s, result.dense_time_s], dtype=torch.float64) / steps * 1e3
    metrics = (totals[:4] / (steps * workload.num_layers)).tolist()
    label = next(m for m, a, g in METHODS if a == algorithm and (a != "quest" or g == gqa_mode))
    return Row(label, budget, *metrics, float(totals[4]), float(totals[5]))


def needles_found(engine: DecodeEngine, result, trace) -> torch.Tensor:
    """Share of the planted needles (of every request in the step) that the layer's selection kept."""
    hits, total = 0, 0
    for row, rid in enumerate(result.rids):
        plan, md = engine.plans[rid], trace.metadata
        positions = plan.needles + [pos for pos, _ in plan.head_needles]
        total += len(positions)
        if md.selected is None or int(md.lengths[row]) == 0:
            hits += len(positions)  # a dense row reads everything
            continue
        kept = set(md.selected[row, : int(md.lengths[row])].tolist())
        hits += sum(pos // md.page_size in kept for pos in positions)
    return torch.tensor(hits / max(total, 1))


def sweep(budgets, *, context: int, batch: int, steps: int, seed: int = 0, device="cpu", progress=print,
          workload: PlantedEngineWorkload | None = None) -> list[Row]:
    """Every method at every budget on the same seeded workload."""
    workload = workload or default_workload(seed)
    rows, runs = [], [(m, b) for m in METHODS for b in budgets]
    start = time.perf_counter()
    for i, ((label, algorithm, gqa), budget) in enumerate(runs):
        spent = time.perf_counter() - start
        left = f", about {spent / i * (len(runs) - i) / 60:.0f} min left" if i and spent > 60 else ""
        progress(f"[{i + 1}/{len(runs)}] {label:<20} budget {budget:>5}  ({spent:5.1f} s{left})")
        rows.append(run_one(workload, algorithm, gqa, budget, context=context, batch=batch, steps=steps, device=device))
    return rows


def default_workload(seed: int = 0) -> PlantedEngineWorkload:
    """Two layers, GQA 4:1, 12 needles per request, 4 of them seen by a single query head only."""
    return PlantedEngineWorkload(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64, num_needles=8,
                                 num_head_needles=4, needle_strength=2.0, seed=seed)


def format_table(rows: list[Row], timed: bool) -> str:
    head = f"{'method':<20} {'budget':>6} {'recall':>7} {'needles':>7} {'mass kept':>9} {'out err':>8}"
    head += f" {'sparse ms':>9} {'dense ms':>9}" if timed else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r.method:<20} {r.budget:>6} {r.recall:>7.3f} {r.needles_found:>7.3f} {r.mass_kept:>9.3f} "
                f"{r.output_error:>8.3f}")
        lines.append(line + (f" {r.sparse_ms:>9.3f} {r.dense_ms:>9.3f}" if timed else ""))
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    fields = ("recall", "needles_found", "mass_kept", "output_error")
    styles = {"quest (mean)": ("o-", None), "quest (per_kv_head)": ("s--", "none"), "dsa": ("^:", None)}
    for label, *_ in METHODS:
        mine, (fmt, face) = [r for r in rows if r.method == label], styles[label]
        for ax, field in zip(axes, fields, strict=True):
            ax.plot([r.budget for r in mine], [getattr(r, field) for r in mine], fmt, label=label, mfc=face)
    budgets = sorted({r.budget for r in rows})
    for ax, name, ylabel in zip(axes, ("recall of the true top pages / tokens", "planted needles kept",
                                       "attention mass kept", "relative output error"),
                                ("share of the oracle's top set", "share of the needles", "attention probability",
                                 "||out - dense|| / ||dense||"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens read per request)")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, frameon=False)  # below: no line hidden
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = cli_parser("python -m sparse_ref.demo", __doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny run (CI smoke test)")
    parser.add_argument("--context", type=cli_positive_int, help="tokens per request (default 4096, or 32768 on a GPU)")
    parser.add_argument("--batch", type=cli_positive_int, default=3, help="requests per step (default 3)")
    parser.add_argument("--steps", type=cli_positive_int, help="decode steps per run (default 3)")
    parser.add_argument("--budgets", type=cli_positive_int, nargs="+", action="extend",
                        help="token budgets (default 128 256 512 1024; repeated flags add up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=cli_image_file, default=Path("build") / "demo.png",
                        help="where to save the plot: .png, .pdf, .svg, ... (its folder is created)")
    parser.add_argument("--tp", type=cli_positive_int, default=1,
                        help="tensor-parallel ranks: run under torchrun --standalone --nproc-per-node N (see demo_tp)")
    parser.add_argument("--json", type=cli_output_file, help="with --tp: write rank 0's results there as JSON")
    args = parser.parse_args(argv)
    cli_environment(parser)
    device = default_device()
    gpu = device.type == "cuda"
    context, batch, steps, budgets = check_demo_args(parser, args, gpu)  # every combination, before any work
    if args.tp > 1:
        from sparse_ref.demo_tp import main_tp

        return main_tp(args, default_workload(args.seed), context=context, steps=steps, budget=budgets[0])
    print(describe_run())
    print(f"planted workload: {batch} requests of ~{context} tokens, 2 layers, 8 query / 2 KV heads, D=64, "
          f"page 16; {steps} decode steps per run; seed {args.seed}")
    start = time.perf_counter()
    rows = sweep(budgets, context=context, batch=batch, steps=steps, seed=args.seed, device=device,
                 progress=lambda line: print(line, flush=True))
    print()
    print(format_table(rows, timed=gpu))
    if not gpu:
        print("(time per decode step needs a GPU: run this on one to see sparse against dense)")
    path = plot(rows, args.out, f"sparse decode vs dense, ~{context}-token requests (seed {args.seed})")
    print(f"\nplot saved to {path.resolve()}  ({time.perf_counter() - start:.1f} s)")
    return 0



MAX_CONTEXT, MAX_BATCH = 1 << 20, 256
# Memory of a run: every method's engine and the workload's prompts, per token of every request (measured about
# 10 KiB on CPU: the three methods' engines, the shared workload's prompts, the dense oracle), plus a fixed part.
BYTES_PER_TOKEN, BASE_BYTES = 12 << 10, 768 << 20


def free_memory_bytes(gpu: bool) -> int:
    """What a run may use: the host's available memory (``MemAvailable``), and on a GPU also the device's free
    memory, whichever is smaller."""
    try:
        with open("/proc/meminfo") as f:
            host = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(host, torch.cuda.mem_get_info()[0]) if gpu else host


def check_demo_args(parser: argparse.ArgumentParser, args, gpu: bool) -> tuple[int, int, int, list[int]]:
    """``(context, batch, steps, budgets)`` with the defaults filled in, every flag checked against the others
    before anything runs; a bad combination exits 2 with one line naming the flag (``parser.error``)."""
    if args.json is not None and args.tp == 1:
        parser.error("argument --json: expected --tp N (N > 1) with it: only the tensor-parallel run writes JSON")
    heads_kv = default_workload(args.seed).num_kv_heads
    if heads_kv % args.tp:
        parser.error(f"argument --tp: expected a number of ranks that divides the workload's {heads_kv} KV heads "
                     f"(1 or {heads_kv}), got {args.tp}")
    tp = args.tp > 1  # the tensor-parallel run: CPU sizes, one budget (demo_tp)
    context = args.context or (512 if args.quick else 32768 if gpu and not tp else 4096)
    batch = 2 if args.quick and args.batch == 3 and not tp else args.batch
    steps = args.steps or (2 if args.quick else 3)
    budgets = args.budgets or ([256] if tp else [64, 128] if args.quick else [128, 256, 512, 1024])
    if batch > MAX_BATCH:
        parser.error(f"argument --batch: expected at most {MAX_BATCH} requests, got {batch}")
    if context > MAX_CONTEXT:
        parser.error(f"argument --context: expected at most {MAX_CONTEXT} tokens, got {context}")
    if context < 8 * batch:
        parser.error(f"argument --context: expected at least {8 * batch} tokens for {batch} requests (each request "
                     f"is 7 tokens shorter than the one before), got {context}")
    if steps > 10_000:
        parser.error(f"argument --steps: expected at most 10000 decode steps, got {steps}")
    too_big = [b for b in budgets if b >= context]
    if too_big:
        parser.error(f"argument --budgets: expected budgets below the context of {context} tokens (a budget of the "
                     f"whole context reads every token: the run would be dense), got {too_big}")
    need, free = BASE_BYTES + BYTES_PER_TOKEN * batch * (context + steps + 1), free_memory_bytes(gpu)
    if need > free:
        fits = (free - BASE_BYTES) // (BYTES_PER_TOKEN * batch) - steps - 1
        fix = (f"--context {fits} or less at --batch {batch}" if fits >= 8 * batch else
               "fewer requests (--batch) and a shorter --context")
        parser.error(f"argument --context/--batch: expected a run that fits memory: {batch} requests of {context} "
                     f"tokens need about {need / 2**30:.1f} GiB ({BYTES_PER_TOKEN >> 10} KiB a token), "
                     f"{free / 2**30:.1f} GiB is free. Fix: {fix}")
    return context, batch, steps, budgets


if __name__ == "__main__":
    sys.exit(main())
