"""Where the time goes: per-kernel GPU time of the radix top-k chain, from torch.profiler.

Run on the GPU: ``python3 benchmarks/profile_topk.py``. Prints one table per shape.
"""

import torch
from sparse_ref.kernels.page_select import select_pages_triton
from sparse_ref.kernels.topk import topk
from torch.profiler import ProfilerActivity, profile

import sparse_ref  # noqa: F401
from sparse_ref.bench import make_distribution
from sparse_ref.config import SparseConfig

CASES = [("64x64K k2048", 64, 65536, 2048), ("64x128K k2048", 64, 131072, 2048), ("1x128K k2048", 1, 131072, 2048)]


def show(name, fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    print(f"== {name}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


for name, R, N, k in CASES:
    x = make_distribution("randn", R, N, "cuda")
    show(f"{name} score", lambda x=x, k=k: topk(x, k))
    show(f"{name} index", lambda x=x, k=k: topk(x, k, order="index"))
x = make_distribution("randn", 32, 8192, "cuda")
seq = torch.full((32,), 8192 * 16, device="cuda")
mask = torch.ones(32, dtype=torch.bool, device="cuda")
cfg = SparseConfig(page_budget=128, num_recent_pages=4)
show("select 32x8192 k128", lambda: select_pages_triton(x, seq, mask, 16, cfg))
