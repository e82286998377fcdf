"""Suites ``topk``, ``sweep`` and ``select``: the exact top-k and the fused page selection against torch.

* **topk**: ``sparse_ref.kernels.topk.topk`` against ``torch.topk`` on the same inputs and the same
  output contract (``sorted=False`` against ``order="index"``, ``sorted=True`` against
  ``order="score"``), for five score distributions (``sparse_ref.workloads.make_distribution``):
  ``randn``, ``indexer`` (many near-ties), ``clustered``, ``sorted`` and ``plateau`` (the last three
  send rows to the exact fallback). On a GPU the randn rows also give each launch's share of the call.
* **sweep**: ``bench_topk_sweep``, the context sweep (bs=1 and 64, 2K-128K, k=2048, four distributions).
* **select**: the fused page selection (``select_pages_triton``) against the torch batched
  selection (``select_pages``) and ``torch.topk`` alone.

In index order, ``topk`` and ``sweep`` rows also hold the production peers (SGLang's ``fast_topk``, FlashInfer's
``top_k``) timed on the same inputs when present, each checked exact, else ``null`` with the reason (``peers.py``).
"""

from __future__ import annotations

from functools import partial

import torch

from sparse_ref.bench.peers import time_peers
from sparse_ref.bench.timing import row
from sparse_ref.config import SparseConfig
from sparse_ref.workloads import make_distribution


def bench_topk(device, timer, copy_bw, quick, on_cpu):
    """torch.topk(sorted=False) vs order="index" and torch.topk(sorted=True) vs order="score"."""
    from sparse_ref.kernels.topk import topk

    if on_cpu:
        shapes = [(2, 512, 16)]
    else:
        shapes = [(64, 65536, 2048), (64, 131072, 2048), (128, 131072, 2048), (1, 131072, 2048), (32, 8192, 128)]
    dists = ["randn"] if quick else ["randn", "indexer", "clustered", "sorted", "plateau"]
    rows = []
    for R, N, k in shapes:
        for dist in dists:
            copies = [make_distribution(dist, R, N, device, seed=s) for s in range(1 if on_cpu else 4)]
            nbytes = R * N * 4 + R * k * 4
            for order, torch_sorted in (("index", False), ("score", True)):
                t_torch = timer.cold([partial(torch.topk, x, k, dim=1, sorted=torch_sorted) for x in copies])
                m_torch = timer.mode
                out = torch.empty(R, k, dtype=torch.int32, device=device)
                t_ours = timer.cold([partial(topk, x, k, order=order, out=out) for x in copies])
                m_ours = timer.mode
                parts = launch_breakdown(copies, k, timer) if (dist, order) == ("randn", "index") and not on_cpu else {}
                peers = time_peers(timer, copies, k) if order == "index" else {}  # the production kernels, same run
                rows.append(row(f"{R}x{N} fp32", k, dist, "cold", t_torch, t_ours, nbytes, copy_bw,
                                f"topk({order})", baseline=f"torch.topk(sorted={torch_sorted})",
                                torch_timing=m_torch, ours_timing=m_ours, **({"parts_us": parts} if parts else {}),
                                **({"peers": peers} if peers else {})))
            if dist == "randn" and not quick and not on_cpu:
                x = copies[0]
                out = torch.empty(R, k, dtype=torch.int32, device=device)
                t_torch_w = timer.warm(partial(torch.topk, x, k, dim=1, sorted=False))
                t_ours_w = timer.warm(partial(topk, x, k, order="index", out=out))
                rows.append(row(f"{R}x{N} fp32", k, dist, "warm", t_torch_w, t_ours_w, nbytes, copy_bw,
                                "topk(index)", baseline="torch.topk(sorted=False)"))
    return rows


SWEEP_CONTEXTS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
SWEEP_DISTRIBUTIONS = ("randn", "indexer", "clustered", "integers")


def bench_topk_sweep(device, timer, copy_bw, quick, on_cpu):
    """The context sweep where DSA decode batches live: bs=1 and bs=64, 2K-128K scores, k=2048, index order,
    four distributions (``integers``: long runs of ties), torch.topk(sorted=False) in the same run. ``--quick``:
    randn and integers only."""
    from sparse_ref.kernels.topk import topk

    batches, contexts, k = ((2,), (256, 512), 64) if on_cpu else ((1, 64), SWEEP_CONTEXTS, 2048)
    dists = ("randn", "integers") if quick or on_cpu else SWEEP_DISTRIBUTIONS
    rows = []
    for R in batches:
        for N in contexts:
            for dist in dists:
                copies = [make_distribution(dist, R, N, device, seed=s) for s in range(1 if on_cpu else 4)]
                kk = min(k, N)
                t_torch = timer.cold([partial(torch.topk, x, kk, dim=1, sorted=False) for x in copies])
                m_torch = timer.mode
                out = torch.empty(R, kk, dtype=torch.int32, device=device)
                t_ours = timer.cold([partial(topk, x, kk, order="index", out=out) for x in copies])
                m_ours, peers = timer.mode, time_peers(timer, copies, kk)
                rows.append(row(f"{R}x{N} fp32", kk, dist, "cold", t_torch, t_ours, R * N * 4 + R * kk * 4, copy_bw,
                                "topk(index)", baseline="torch.topk(sorted=False)", peers=peers, torch_timing=m_torch,
                                ours_timing=m_ours, sweep=True))
                del copies
    return rows


def launch_breakdown(copies, k, timer) -> dict:
    """Each launch's share of one index-order call (µs): the call cut after each launch, each cut replayed with
    L2 flushed, and the differences between cuts. A launch replayed alone would run on the state earlier
    replays left (the rows' slot counters far past the slots), so the cut after the candidates launch ends
    by zeroing the counters, as the select launch does; that reset's own time is taken off again."""
    from sparse_ref.kernels import topk as topk_module
    from sparse_ref.kernels.topk.common import CNT

    runs = [topk_module.launch_topk(x, k, None, None, torch.empty(x.shape[0], k, dtype=torch.int32,
                                                                   device=x.device)) for x in copies]
    counters = runs[0].sync[:, CNT.value] if runs[0].sync is not None else None

    def cut(n, reset=False):
        def call(run):
            for step in run.launches[:n]:
                step()
            if reset:
                counters.zero_()
        return timer.cold([partial(call, run) for run in runs])

    names = list(runs[0].names)
    if len(names) == 1:
        return {names[0]: round(cut(1), 2)}
    first = cut(1)
    reset_share = cut(1, reset=True) - first
    cuts = [first, cut(2, reset=True) - reset_share] + [cut(n) for n in range(3, len(names) + 1)]
    return {name: round(cuts[i] - (cuts[i - 1] if i else 0.0), 2) for i, name in enumerate(names)}


def quest_like_scores(bs, pages, device, seed, coarse=False):
    """Page scores packed like Quest's (fp32 sums over heads and dims: ~5700 +- 2%); ``coarse``: rounded to
    bf16 (only ~30 distinct values: a tie-heavy stress row that takes the exact fallbacks)."""
    g = torch.Generator().manual_seed(seed)
    x = 5700.0 * (1 + 0.02 * torch.randn(bs, pages, generator=g))
    return (x.to(torch.bfloat16).float() if coarse else x).to(device)


def bench_select(device, timer, copy_bw, quick, on_cpu):
    """The fused page selection: 32 x 8192 pages k=128 + 4 recent (issue target) on random and on
    Quest-like packed scores, and the bs=1 decode-step rows (2048 / 8192 pages, k=123 + 1 sink + 4 recent)."""
    from sparse_ref.kernels.page_select import select_pages_triton
    from sparse_ref.selection import select_pages

    page_size = 4 if on_cpu else 16
    if on_cpu:
        cases = [(2, 64, 8, 0, "randn"), (1, 64, 8, 1, "quest")]
    else:
        cases = [(32, 8192, 128, 0, d) for d in (["randn"] if quick else ["randn", "indexer", "clustered"])]
        cases += [(32, 8192, 128, 0, "quest"), (1, 2048, 123, 1, "quest"), (1, 8192, 123, 1, "quest")]
        cases += [] if quick else [(32, 8192, 128, 0, "quest_ties"), (1, 8192, 123, 1, "quest_ties")]
    rows = []
    for bs, pages, k, sink, dist in cases:
        config = SparseConfig(page_budget=k, num_recent_pages=4, num_sink_pages=sink)
        g = torch.Generator().manual_seed(0)
        seq_lens = torch.randint(pages * page_size * 3 // 4, pages * page_size + 1, (bs,), generator=g).to(device)
        seq_lens[0] = pages * page_size
        mask = torch.ones(bs, dtype=torch.bool, device=device)
        copies = [quest_like_scores(bs, pages, device, s, dist == "quest_ties") if dist.startswith("quest") else
                  make_distribution(dist, bs, pages, device, seed=s) for s in range(1 if on_cpu else 4)]
        W = select_pages_triton(copies[0], seq_lens, mask, page_size, config)[0].shape[1]
        nbytes = bs * pages * 4 + bs * 8 + bs * 1 + bs * W * 4 + bs * 4
        t_ours = timer.cold([partial(select_pages_triton, x, seq_lens, mask, page_size, config) for x in copies])
        m_ours = timer.mode
        t_sel = timer.cold([partial(select_pages, x, seq_lens, mask, page_size, config) for x in copies])
        m_sel = timer.mode
        t_topk = timer.cold([partial(torch.topk, x, k, dim=1, sorted=False) for x in copies])
        shape = f"{bs}x{pages} pages"
        rows.append(row(shape, k, dist, "cold", t_sel, t_ours, nbytes, copy_bw, "select",
                        baseline="torch select_pages (batched torch: ranks + finalize)", torch_timing=m_sel,
                        ours_timing=m_ours))
        rows.append(row(shape, k, dist, "cold", t_topk, t_ours, nbytes, copy_bw, "select_vs_topk",
                        baseline="torch.topk(sorted=False) alone (no recent/sink, no finalize)",
                        torch_timing=timer.mode,
                        ours_timing=m_ours))
        if dist == "randn" and not on_cpu:
            x = copies[0]
            t_ours_w = timer.warm(partial(select_pages_triton, x, seq_lens, mask, page_size, config))
            t_sel_w = timer.warm(partial(select_pages, x, seq_lens, mask, page_size, config))
            rows.append(row(shape, k, dist, "warm", t_sel_w, t_ours_w, nbytes, copy_bw, "select",
                            baseline="torch select_pages, CUDA graph replay"))
    return rows
