"""A/B on the GPU: rows held in registers (one read) against the split chain, for short rows.

``python3 benchmarks/ab_register_rows.py``: L2-cold graph-replay medians, as in ``sparse_ref.bench``.
"""

import torch

import sparse_ref  # noqa: F401
from sparse_ref.bench import Timer, make_distribution
from sparse_ref.config import SparseConfig
from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels.page_select import select_pages_triton
from sparse_ref.kernels.topk import topk

timer = Timer(torch.device("cuda"), reps=50)
cfg = SparseConfig(page_budget=128, num_recent_pages=4)
base = dict(topk_module.TUNING)
for name, settings in (("registers", {}), ("chain", {"register_row": 0, "short_row": 4096})):
    topk_module.TUNING.update(base, **settings)
    for R, N, k in ((32, 8192, 128), (64, 16384, 512), (128, 4096, 64)):
        xs = [make_distribution("randn", R, N, "cuda", seed=s) for s in range(4)]
        seq = torch.full((R,), N * 16, device="cuda")
        mask = torch.ones(R, dtype=torch.bool, device="cuda")
        t_sel = timer.cold([lambda x=x, s=seq, m=mask: select_pages_triton(x, s, m, 16, cfg) for x in xs])
        t_idx = timer.cold([lambda x=x, k=k: topk(x, k, order="index") for x in xs])
        t_torch = timer.cold([lambda x=x, k=k: torch.topk(x, k, dim=1) for x in xs])
        print(f"{name:<10} {R}x{N} k={k}: select {t_sel:6.1f} us | topk(index) {t_idx:6.1f} us | "
              f"torch.topk {t_torch:6.1f} us", flush=True)
topk_module.TUNING.update(base)
