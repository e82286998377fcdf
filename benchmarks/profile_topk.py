"""Where the time goes, and which launch settings win: run on the GPU, ``python3 benchmarks/profile_topk.py``.

1. Per-launch GPU time of the radix chain (zero histograms, 4 passes, compaction, sort), read
   from a torch.profiler trace, for the benchmark shapes.
2. L2-cold graph-replay timings (as in ``sparse_ref.bench``) of launch variants: programs per
   SM (row splitting), tile size, warps. Prints one line per variant.
"""

import json
import statistics
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import sparse_ref  # noqa: F401
from sparse_ref.bench import Timer, make_distribution
from sparse_ref.config import SparseConfig
from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels.page_select import select_pages_triton
from sparse_ref.kernels.topk import topk

CASES = [("64x64K k2048", 64, 65536, 2048), ("64x128K k2048", 64, 131072, 2048), ("1x128K k2048", 1, 131072, 2048)]


def per_launch(name, fn, iters=10):
    """Median GPU µs of each kernel launch of one call, in launch order."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    kernels = sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_call = len(kernels) // iters
    slots = defaultdict(list)
    for i, e in enumerate(kernels[: per_call * iters]):
        slots[i % per_call].append((e["name"][:40], e["dur"]))
    parts = [f"{v[0][0]}={statistics.median(d for _, d in v):.1f}" for _, v in sorted(slots.items())]
    total = sum(statistics.median(d for _, d in v) for v in slots.values())
    print(f"{name:<28} sum {total:7.1f} us | " + "  ".join(parts), flush=True)


def main():
    timer = Timer(torch.device("cuda"), reps=50)
    print("== per-launch breakdown (L2 warm-ish, eager)")
    for name, R, N, k in CASES:
        x = make_distribution("randn", R, N, "cuda")
        per_launch(f"{name} score", lambda x=x, k=k: topk(x, k))
        per_launch(f"{name} index", lambda x=x, k=k: topk(x, k, order="index"))
    x = make_distribution("randn", 32, 8192, "cuda")
    seq = torch.full((32,), 8192 * 16, device="cuda")
    mask = torch.ones(32, dtype=torch.bool, device="cuda")
    cfg = SparseConfig(page_budget=128, num_recent_pages=4)
    per_launch("select 32x8192 k128", lambda: select_pages_triton(x, seq, mask, 16, cfg))
    for splits in (2, 4, 8):
        per_launch(f"select splits={splits}", lambda s=splits: select_pages_triton(x, seq, mask, 16, cfg, splits=s))

    print("== variants, L2 cold, graph replay, median us (index order)")
    base = dict(topk_module.TUNING)
    variants = [dict(), dict(programs_per_sm=4), dict(programs_per_sm=16), dict(block=1024),
                dict(block=2048, num_warps=8), dict(programs_per_sm=4, block=1024, num_warps=8)]
    for name, R, N, k in CASES:
        copies = [make_distribution("randn", R, N, "cuda", seed=s) for s in range(4)]
        for v in variants:
            topk_module.TUNING.clear()
            topk_module.TUNING.update(base, **v)
            t = timer.cold([lambda x=x, k=k: topk(x, k, order="index") for x in copies])
            print(f"{name:<16} {str(v):<45} {t:8.1f} us", flush=True)
    topk_module.TUNING.clear()
    topk_module.TUNING.update(base)
    for name, R, N, k in CASES[:1]:
        copies = [make_distribution("randn", R, N, "cuda", seed=s) for s in range(4)]
        for w in (0, 4, 8, 32):
            topk_module.TUNING.update(base, sort_num_warps=w)
            t = timer.cold([lambda x=x, k=k: topk(x, k, order="score") for x in copies])
            print(f"{name:<16} score order, sort_num_warps={w or 'auto'}  {t:8.1f} us", flush=True)
    for v in (dict(), dict(short_row=16384), dict(short_row=16384, fused_num_warps=4), dict(programs_per_sm=4),
              dict(block=1024)):
        topk_module.TUNING.clear()
        topk_module.TUNING.update(base, **v)
        t = timer.cold([lambda: select_pages_triton(x, seq, mask, 16, cfg)])
        print(f"select 32x8192 k128 {str(v):<45} {t:8.1f} us", flush=True)
    topk_module.TUNING.clear()
    topk_module.TUNING.update(base)


if __name__ == "__main__":
    sys.exit(main())
