"""Side-by-side GPU timings: ``python -m sparse_ref.bench SUITE [SUITE ...] [--quick] [--out PATH]``.

SUITE is ``topk``, ``select``, ``quest``, ``retrieve``, ``decode``, ``dsa``, ``engine`` or ``all``; several may be given
(``python -m sparse_ref.bench quest retrieve``).

Without ``--out`` the JSON goes to ``build/bench/<suites>-<gpu|cpu>.json`` (ignored by git); the
committed GPU results in ``benchmarks/results/`` are written only with an explicit ``--out``, and
never by a CPU run. ``docs/design.md`` lists the targets each suite is held to.

What is measured, and how:

* **topk**: the delegate-threshold top-k (``sparse_ref.kernels.topk.topk``) against ``torch.topk``
  on the same inputs and the same output contract (``sorted=False`` against ``order="index"``,
  ``sorted=True`` against ``order="score"``), for five score distributions: ``randn``;
  ``indexer`` (ReLU-weighted sums of random dot products, rounded through bf16 like real indexer
  logits: many near-ties); ``clustered`` (a few distinct values plus tiny noise); ``sorted``
  (ascending rows) and ``plateau`` (a third of each row tied at the top value), which send rows
  to the exact fallback.
* **select**: the fused page selection (``select_pages_triton``) against the torch batched
  selection (``select_pages``: torch.topk-style ranking + finalize), and torch.topk alone.
* **quest**: Quest page scores, the Triton kernel (``sparse_ref.kernels.quest.quest_page_scores``)
  against the torch reference (``quest_page_scores_reference``: gather + bmm), at the target shape
  (bs=1, 32 KV heads, D=128, page 16, 128K context) and the retrieve shape (bs=64, 8 KV heads,
  32K context); bytes = the bounds of every scored page read once + the scores written. The
  bounds pool is fp32 (as ``QuestAlgorithm`` keeps it); a bf16-bounds row shows the kernel at
  half the bytes (the 31 µs byte floor at 4.3 TB/s assumes 2-byte bounds).
* **retrieve**: the batched ``retrieve_topk`` of Quest (Triton scoring and selection on CUDA)
  against the per-request ``retrieve_topk_loop``, bs=64, 32K context, page 16.
* **decode**: (a) the paged decode attention kernel (``sparse_ref.kernels.decode_attention``) at
  bs=64, 32 q / 8 KV heads, D=128, bf16 K/V, 32K context, page 16, and at bs=1 MHA (32 heads),
  against the copy bandwidth (bytes = K + V read once) and the torch reference; (b) the sparse
  decode step (Quest scores + selection + the one-launch page table + sparse attention, one CUDA
  graph) against the dense step (the same kernel over every page), at bs=1 MHA 32K and 128K and
  bs=64 GQA 32K, budget 2048 tokens, with fp32 and bf16 Quest bounds; each row gives the
  speedup, the byte-limit speedup (dense bytes / sparse bytes), the time of each part (and of
  the torch adaptor the page-table kernel replaces) and whether the Triton page table equals
  the torch adaptor's.
* **dsa**: paged FP8 indexer logits (``sparse_ref.kernels.dsa.paged_indexer_logits``; 64 heads,
  D=128, page 64, random page order) and logits + top-2048 against the batched torch reference
  (gather + fp32 bmm; + ``torch.topk``) at bs 1/8/64 x 4K..128K (quick: 1x64K, 8x64K, 64x16K,
  64x64K); a few other launch knobs at the target shapes (``dsa_logits_knobs``); prefill rows
  (8192 query tokens, a causal last chunk of 64K keys; default 4 and 1 queries per program); the
  batched ``LightningIndexer`` decode step (one CUDA graph) against its per-request loop
  (``index_scores_loop`` + ``select``, same inputs; bs=64, 32K), with the step's parts timed alone,
  its eager time, and whether the selections agree (loop vs batched torch path vs kernel path;
  differences allowed only at near-ties of the 2048th score). Bytes = keys + scales read once
  (132 B/token) + logits written.

Timing: CUDA events around each call, median of many calls. **L2 cold** rows zero a 1 GiB
buffer before every call (the H200's L2 is ~60 MB), which also keeps the GPU busy while Python
launches the next call, so launch overhead does not leak into the numbers; inputs rotate
among several copies. **L2 warm** rows replay a CUDA graph of the same call on the same input.
The device-to-device copy bandwidth is measured in the same run; effective TB/s is the bytes
the operation must move (read every score once, write the ids once) over the time.

On CPU (Triton's interpreter) it refuses to run unless ``--allow-cpu`` is given; such results
are labelled as CPU results and are not GPU numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

import sparse_ref
from sparse_ref.config import SparseConfig

FLUSH_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------
def make_distribution(name: str, R: int, N: int, device, seed: int = 0) -> torch.Tensor:
    """fp32 scores [R, N] of the named distribution."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if name == "randn":
        x = torch.randn(R, N, generator=g)
    elif name == "indexer":
        heads, dim = 8, 16
        q = torch.randn(R, heads, dim, generator=g)
        w = torch.rand(R, heads, generator=g)
        x = torch.zeros(R, N)
        for start in range(0, N, 16384):  # ReLU-weighted sum over heads of q.k, blockwise to bound memory
            k = torch.randn(min(16384, N - start), dim, generator=g)
            logits = torch.relu(torch.einsum("rhd,nd->rhn", q, k))
            x[:, start:start + k.shape[0]] = torch.einsum("rh,rhn->rn", w, logits)
        x = x.bfloat16().float()  # indexer logits are low precision: many exact and near ties
    elif name == "sorted":  # ascending rows: every winner sits at the end (defeats block-wise filters)
        x = torch.sort(torch.randn(R, N, generator=g), dim=1).values
    elif name == "plateau":  # a third of each row ties at the top value (defeats thresholds: long tie runs)
        x = torch.randn(R, N, generator=g).clamp(max=1.0)
        x[:, ::3] = 1.5
    elif name == "clustered":
        centers = torch.randn(8, generator=g) * 4
        x = centers[torch.randint(0, 8, (R, N), generator=g)] + 1e-4 * torch.randn(R, N, generator=g)
        x = x.bfloat16().float()
    else:
        raise ValueError(f"unknown distribution {name!r}")
    return x.to(device)


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------
class Timer:
    def __init__(self, device: torch.device, reps: int):
        self.device = device
        self.reps = reps
        self.on_gpu = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES // 4 if self.on_gpu else 1, dtype=torch.int32, device=device)
        self.mode = "graph" if self.on_gpu else "cpu"

    def cold(self, fns) -> float:
        """Median µs of one call, L2 flushed before each; ``fns`` rotates over input copies.

        On a GPU each call is captured once in a CUDA graph and the graph is replayed, so the
        time is the GPU's alone (no Python launch overhead); ``self.mode`` says "graph" or, when
        a call cannot be captured, "eager".
        """
        for fn in fns:  # warm-up / compile
            fn()
        if not self.on_gpu:
            self.mode = "cpu"
            times = []
            for i in range(self.reps):
                t0 = time.perf_counter()
                fns[i % len(fns)]()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize()
        try:
            calls = [capture_graph(fn).replay for fn in fns]
            self.mode = "graph"
        except Exception:  # not capturable (e.g. a host sync inside): time eager calls
            torch.cuda.synchronize()
            calls = list(fns)
            self.mode = "eager"
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for i in range(self.reps):
            self.flush.zero_()
            starts[i].record()
            calls[i % len(calls)]()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True))

    def warm(self, fn, calls: int = 20) -> float:
        """Median µs of one call replayed from a CUDA graph of ``calls`` calls on the same (L2-resident) input."""
        if not self.on_gpu:
            return self.cold([fn])
        fn()
        graph = capture_graph(fn, calls)
        times = []
        for _ in range(max(5, self.reps // 10)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / calls)
        return statistics.median(times)


def capture_graph(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


COPY_DETAIL: dict = {}


def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + bytes written), the best of two ways.

    Eager ``copy_`` (a copy kernel on the SMs) and an elementwise ``mul`` kernel, each timed with
    events around eager calls (a 1 GiB copy takes ~0.5 ms, so launch overhead does not matter).
    Not a graph replay: inside a CUDA graph a device-to-device copy becomes a memcpy node that
    may run on the copy engines, which move ~2.7 TB/s on an H200 (seen here), not ~4.3.
    """
    if device.type != "cuda":
        return float("nan")
    n = (1 << 30) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ways = {"copy_": partial(dst.copy_, src), "mul": partial(torch.mul, src, 1.0, out=dst)}
    for name, fn in ways.items():
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        COPY_DETAIL[name] = round(2 * n * 4 / statistics.median(times) / 1e12, 3)
    return max(COPY_DETAIL.values())


# ------------------------------------------------------------------------------------------
# Suites
# ------------------------------------------------------------------------------------------
def _row(shape, k, dist, l2, torch_us, ours_us, bytes_moved, copy_bw, op, **extra):
    """One result row (and its progress line)."""
    tbps = bytes_moved / (ours_us * 1e-6) / 1e12 if ours_us and ours_us > 0 else float("nan")
    row = dict(op=op, shape=shape, k=k, distribution=dist, l2=l2, torch_us=round(torch_us, 2),
               ours_us=round(ours_us, 2), speedup=round(torch_us / ours_us, 2), bytes=int(bytes_moved),
               tbps=round(tbps, 3), pct_copy_bw=round(100 * tbps / copy_bw, 1) if math.isfinite(copy_bw) else None)
    row.update(extra)
    k_txt = "-" if k is None else k
    print(f"  {op:<14} {shape:<22} k={k_txt:<5} {dist:<10} L2 {l2:<4} torch {torch_us:9.1f} us | ours "
          f"{ours_us:9.1f} us | x{torch_us / ours_us:6.2f} | {tbps:6.2f} TB/s "
          f"({row['pct_copy_bw']}% of copy)", flush=True)
    return row


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
                rows.append(_row(f"{R}x{N} fp32", k, dist, "cold", t_torch, t_ours, nbytes, copy_bw,
                                 f"topk({order})", baseline=f"torch.topk(sorted={torch_sorted})",
                                 torch_timing=m_torch, ours_timing=timer.mode))
            if dist == "randn" and not quick and not on_cpu:
                x = copies[0]
                out = torch.empty(R, k, dtype=torch.int32, device=device)
                t_torch_w = timer.warm(partial(torch.topk, x, k, dim=1, sorted=False))
                t_ours_w = timer.warm(partial(topk, x, k, order="index", out=out))
                rows.append(_row(f"{R}x{N} fp32", k, dist, "warm", t_torch_w, t_ours_w, nbytes, copy_bw,
                                 "topk(index)", baseline="torch.topk(sorted=False)"))
    return rows


def _quest_like_scores(bs, pages, device, seed, coarse=False):
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
        copies = [_quest_like_scores(bs, pages, device, s, dist == "quest_ties") if dist.startswith("quest") else
                  make_distribution(dist, bs, pages, device, seed=s) for s in range(1 if on_cpu else 4)]
        W = select_pages_triton(copies[0], seq_lens, mask, page_size, config)[0].shape[1]
        nbytes = bs * pages * 4 + bs * 8 + bs * 1 + bs * W * 4 + bs * 4
        t_ours = timer.cold([partial(select_pages_triton, x, seq_lens, mask, page_size, config) for x in copies])
        m_ours = timer.mode
        t_sel = timer.cold([partial(select_pages, x, seq_lens, mask, page_size, config) for x in copies])
        m_sel = timer.mode
        t_topk = timer.cold([partial(torch.topk, x, k, dim=1, sorted=False) for x in copies])
        shape = f"{bs}x{pages} pages"
        rows.append(_row(shape, k, dist, "cold", t_sel, t_ours, nbytes, copy_bw, "select",
                         baseline="torch select_pages (batched torch: ranks + finalize)", torch_timing=m_sel,
                         ours_timing=m_ours))
        rows.append(_row(shape, k, dist, "cold", t_topk, t_ours, nbytes, copy_bw, "select_vs_topk",
                         baseline="torch.topk(sorted=False) alone (no recent/sink, no finalize)",
                         torch_timing=timer.mode,
                         ours_timing=m_ours))
        if dist == "randn" and not on_cpu:
            x = copies[0]
            t_ours_w = timer.warm(partial(select_pages_triton, x, seq_lens, mask, page_size, config))
            t_sel_w = timer.warm(partial(select_pages, x, seq_lens, mask, page_size, config))
            rows.append(_row(shape, k, dist, "warm", t_sel_w, t_ours_w, nbytes, copy_bw, "select",
                             baseline="torch select_pages, CUDA graph replay"))
    return rows


def bench_quest(device, timer, copy_bw, quick, on_cpu):
    from sparse_ref.algorithms.quest import quest_page_scores_reference
    from sparse_ref.kernels.quest import quest_page_scores

    if on_cpu:
        shapes = [(1, 2, 8, 64, 16, torch.float32), (2, 2, 8, 32, 16, torch.float32)]
    else:
        shapes = [(1, 32, 128, 131072, 16, torch.float32), (64, 8, 128, 32768, 16, torch.float32)]
        if not quick:
            shapes.append((1, 32, 128, 131072, 16, torch.bfloat16))
    rows = []
    sweep_timer = None if quick or on_cpu else Timer(device, reps=30)
    for bs, h_kv, d, ctx, page_size, bound_dtype in shapes:
        max_pages = -(-ctx // page_size)
        num_pages = bs * max_pages + 1  # page 0 is padding; every request's pages are distinct, shuffled
        g = torch.Generator(device="cpu").manual_seed(0)
        pages = (torch.randperm(num_pages - 1, generator=g)[:bs * max_pages] + 1).reshape(bs, max_pages).to(device)
        a = torch.randn(num_pages, h_kv, d, device=device)
        b = torch.randn(num_pages, h_kv, d, device=device)
        page_min, page_max = torch.minimum(a, b).to(bound_dtype), torch.maximum(a, b).to(bound_dtype)
        del a, b
        page_valid = torch.ones(num_pages, dtype=torch.bool, device=device)
        page_valid[0] = False
        q_pos = torch.randn(bs, h_kv, d, device=device).clamp(min=0)
        q_neg = torch.randn(bs, h_kv, d, device=device).clamp(max=0)
        inputs = (q_pos, q_neg, page_min, page_max, page_valid, pages)
        want = quest_page_scores_reference(*inputs)
        got = quest_page_scores(*inputs)
        max_rel_err = float(((got - want).abs() / want.abs().clamp(min=1e-3)).max())
        out = torch.empty(bs, max_pages, device=device)
        nbytes = 2 * bs * max_pages * h_kv * d * page_min.element_size() + bs * max_pages * 4
        t_torch = timer.cold([partial(quest_page_scores_reference, *inputs)])
        m_torch = timer.mode
        t_ours = timer.cold([partial(quest_page_scores, *inputs, out=out)])
        floor_us = nbytes / (copy_bw * 1e12) * 1e6 if math.isfinite(copy_bw) else None
        sweep = {}
        if not quick and not on_cpu and bound_dtype == torch.float32:  # launch knobs around the default
            for block_p in (4, 8, 16, 32):
                for block_hd in (128, 256, 512):
                    for warps in (4, 8):
                        knobs = dict(block_p=block_p, block_hd=block_hd, num_warps=warps)
                        try:
                            t = sweep_timer.cold([partial(quest_page_scores, *inputs, out=out, **knobs)])
                        except Exception as e:  # e.g. out of registers / shared memory: say so
                            t = f"failed: {type(e).__name__}"
                        sweep[f"p{block_p}_hd{block_hd}_w{warps}"] = round(t, 2) if isinstance(t, float) else t
            timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
            if timed:
                best = min(timed, key=timed.get)
                print(f"  launch sweep: best {best} {timed[best]:.1f} us (default p16_hd256_w4 "
                      f"{timed.get('p16_hd256_w4')})", flush=True)
        rows.append(_row(f"bs={bs} Hkv={h_kv} D={d} ctx={ctx} P={page_size} {str(bound_dtype)[6:]}", None,
                         "randn", "cold", t_torch, t_ours, nbytes, copy_bw, "quest_scores",
                         baseline="quest_page_scores_reference (torch gather + bmm)", torch_timing=m_torch,
                         ours_timing=timer.mode, max_rel_err=max_rel_err,
                         floor_us_at_copy_bw=None if floor_us is None else round(floor_us, 2),
                         bytes_note="bounds (min+max) of every scored page read once + fp32 scores written",
                         **({"launch_sweep_us": sweep} if sweep else {})))
        del inputs, page_min, page_max, want, got
    return rows


def bench_retrieve(device, timer, copy_bw, quick, on_cpu):
    from sparse_ref.workloads import make_quest_decode_setup

    bs, ctx, page_size = (2, 256, 16) if on_cpu else (64, 32768, 16)
    setup = make_quest_decode_setup(bs, ctx, page_size, device=device)
    backends = dict(scoring="triton" if setup.algorithm.uses_triton_scoring() else "torch",
                    selection=setup.algorithm.selection_backend)
    if backends["selection"] == "auto":
        backends["selection"] = "triton" if device.type == "cuda" else "torch"
    batched = setup.retrieve()
    looped = setup.retrieve(loop=True)
    same = bool(torch.equal(batched[0], looped[0]) and torch.equal(batched[1], looped[1]))
    t_batched = timer.cold([setup.retrieve])
    m_batched = timer.mode
    loop_times = []
    for _ in range(3 if quick or on_cpu else 5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        setup.retrieve(loop=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        loop_times.append((time.perf_counter() - t0) * 1e6)
    t_loop = statistics.median(loop_times)
    graph_ok = None
    if device.type == "cuda":
        try:
            t_graph = timer.warm(setup.retrieve, calls=5)
            graph_ok = True
        except Exception as e:  # report, don't hide: the row says why
            t_graph, graph_ok = float("nan"), f"capture failed: {type(e).__name__}: {e}"[:300]
    else:
        t_graph = float("nan")
    pages = -(-ctx // page_size)
    rows = [_row(f"bs={bs} ctx={ctx} page={page_size}", None, "planted", "cold", t_loop, t_batched,
                 bs * pages * 4, copy_bw, "retrieve", baseline="retrieve_topk_loop (wall clock, synced)",
                 identical_to_loop=same, graph_replay_us=None if math.isnan(t_graph) else round(t_graph, 2),
                 graph_capturable=graph_ok, torch_timing="wall clock", ours_timing=m_batched,
                 ours_backends=f"scoring={backends['scoring']}, selection={backends['selection']}",
                 loop_backends="the loop scores through the same score_pages (same scoring backend)")]
    return rows


# ------------------------------------------------------------------------------------------
# decode: the paged decode attention kernel, and the sparse decode step against the dense one
# ------------------------------------------------------------------------------------------
def dense_attention_inputs(bs, h_q, h_kv, d, ctx, page_size, kv_dtype, device, seed=0):
    """q fp32, K/V pools of ``bs`` requests of ``ctx`` tokens (shuffled pages; page 0 padding), full page tables."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-ctx // page_size)
    num_pages = bs * pages + 1
    table = (torch.randperm(num_pages - 1, generator=g) + 1).reshape(bs, pages).to(torch.int32).to(device)
    k = torch.randn(num_pages * page_size, h_kv, d, device=device, dtype=kv_dtype)
    v = torch.randn(num_pages * page_size, h_kv, d, device=device, dtype=kv_dtype)
    q = torch.randn(bs, h_q, d, device=device)
    kv_lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
    return q, k, v, table, kv_lens


def decode_step_setup(bs, h_q, h_kv, d, ctx, page_size, budget_tokens, bounds_dtype, device,
                      kv_dtype=torch.bfloat16, seed=0):
    """Quest on a planted workload, with the static buffers of one sparse and one dense decode step.

    Returns a namespace with ``sparse_step()`` (Quest scores + page selection + adaptor + sparse
    attention, all into static buffers: capturable as ONE CUDA graph) and ``dense_step()`` (the
    same attention kernel over the full, precomputed page table), and the byte counts.
    """
    from types import SimpleNamespace

    from sparse_ref.adaptor import page_table_width, retrieve_attention_metadata, to_attention_metadata
    from sparse_ref.algorithms.quest import QuestAlgorithm, split_query_sign
    from sparse_ref.kernels.decode_attention import paged_decode_attention
    from sparse_ref.selection import selection_width
    from sparse_ref.workloads import make_planted_workload

    pages = -(-ctx // page_size)
    recent, sink = 4, 1
    config = SparseConfig(page_budget=budget_tokens // page_size - recent - sink, num_recent_pages=recent,
                          num_sink_pages=sink)
    wl = make_planted_workload([ctx] * bs, page_size=page_size, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=d,
                               interleave_pages=max(1, pages // 32), dtype=kv_dtype, device=device, seed=seed)
    algo = QuestAlgorithm(config, device, bounds_dtype=bounds_dtype)
    wl.attach(algo)
    fb, r2t = wl.forward_batch, wl.req_to_token
    q, k, v = wl.queries, wl.k_buffer, wl.v_buffer
    rows = fb.req_pool_indices
    mask = torch.ones(bs, dtype=torch.bool, device=device)
    width = page_table_width(selection_width(algo.max_pages, config), r2t.shape[1], page_size)
    meta = (torch.zeros(bs, width, dtype=torch.int32, device=device), torch.zeros(bs, dtype=torch.int32, device=device),
            torch.zeros(bs + 1, dtype=torch.int32, device=device))
    out_sparse = torch.empty(q.shape, dtype=torch.float32, device=device)
    out_dense = torch.empty(q.shape, dtype=torch.float32, device=device)
    dense_table, dense_lens, _ = to_attention_metadata(torch.full((bs, 1), -1, dtype=torch.int32, device=device),
                                                       torch.zeros(bs, dtype=torch.int32, device=device),
                                                       torch.zeros(bs, dtype=torch.bool, device=device), fb, r2t,
                                                       page_size)
    ns = SimpleNamespace(algo=algo, workload=wl, q=q, k=k, v=v, meta=meta, out_sparse=out_sparse, out_dense=out_dense,
                         dense_table=dense_table, dense_lens=dense_lens, page_size=page_size)

    def retrieve():
        return algo.retrieve_topk(q, 0, rows, mask, forward_batch=fb)

    def scores():  # the first half of retrieve: query sign split + physical pages + the Quest scoring kernel
        return algo.score_pages(q, 0, rows, fb)

    def scores_unfused():  # what score_pages ran before the fused kernel: torch sign split + page map + kernel
        from sparse_ref.kernels.quest import quest_page_scores

        q_pos, q_neg = split_query_sign(q, algo.num_kv_heads, algo.head_dim, config.gqa_mode)
        return quest_page_scores(q_pos, q_neg, algo.page_min[0], algo.page_max[0], algo.page_valid[0],
                                 algo.physical_pages(rows))

    def scores_with(**knobs):  # the fused scoring launch with explicit launch knobs (the decode bench sweeps them)
        from sparse_ref.kernels.quest import quest_page_scores_from_queries

        return quest_page_scores_from_queries(q, algo.page_min[0], algo.page_max[0], algo.page_valid[0], r2t, rows,
                                              page_size, algo.max_pages, config.gqa_mode, check_values=False, **knobs)

    def adaptor(sel, lens, backend="auto"):  # auto: the one-launch Triton page table on CUDA
        return to_attention_metadata(sel, lens, mask, fb, r2t, page_size, out=meta, backend=backend)

    knobs = {"sparse": {}, "dense": {}}  # attention launch knobs of each step (the bench may tune both)

    def sparse_attention():
        return paged_decode_attention(q, k, v, meta[0], meta[1], page_size, out=out_sparse, **knobs["sparse"])

    def retrieve_table():  # retrieve + adaptor; on CUDA the selection kernel writes the page table (one launch)
        return retrieve_attention_metadata(algo, q, 0, rows, mask, fb, r2t, out=meta)

    def sparse_step():
        retrieve_table()
        return sparse_attention()

    def dense_step():
        return paged_decode_attention(q, k, v, dense_table, dense_lens, page_size, out=out_dense, **knobs["dense"])

    ns.retrieve, ns.adaptor, ns.sparse_attention = retrieve, adaptor, sparse_attention
    ns.retrieve_table = retrieve_table
    ns.scores, ns.scores_unfused, ns.knobs, ns.scores_with = scores, scores_unfused, knobs, scores_with
    ns.sparse_step, ns.dense_step = sparse_step, dense_step
    kv_bytes = 2 * k.element_size() * h_kv * d  # K + V of one token
    ns.dense_bytes = bs * ctx * kv_bytes
    bounds_bytes = 2 * torch.tensor([], dtype=bounds_dtype).element_size() * h_kv * d  # min + max of one page
    ns.sparse_bytes = bs * pages * bounds_bytes + bs * min(budget_tokens, ctx) * kv_bytes
    return ns


def _scoring_default(s) -> str:
    """The Quest scoring launch's default (block_p, block_hd) for a decode-step setup, as the sweep names it."""
    from sparse_ref.kernels.quest import _default_blocks

    hd = s.algo.num_kv_heads * s.algo.head_dim
    bp, bhd = _default_blocks(hd, s.q.shape[0], s.algo.max_pages, s.q.device)
    return f"p{bp}_hd{bhd}_w4"


def _eager_cold(timer, fn, reps):
    """Median µs of eager calls of ``fn`` with the L2 flushed before each (for calls that cannot be captured)."""
    fn()
    times = []
    for _ in range(reps):
        if timer.on_gpu:
            timer.flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


ATTENTION_CANDIDATES = [dict(num_splits=16), dict(num_splits=64), dict(block_n=16), dict(block_n=32),
                        dict(block_n=64), dict(num_warps=8), dict(num_splits=32, block_n=64), dict(num_splits=8)]


def bench_decode(device, timer, copy_bw, quick, on_cpu):
    """(a) the dense decode attention kernel against the copy bandwidth and the torch reference;
    (b) the sparse decode step (one CUDA graph) against the dense step, with fp32 and bf16 Quest bounds."""
    from sparse_ref.attention import sparse_decode_attention
    from sparse_ref.kernels.decode_attention import paged_decode_attention

    rows = []
    # (a) the dense kernel: bs=64 GQA (the 80%-of-copy target) and bs=1 MHA (the baseline of the bs=1 step rows).
    # Timed first, on freshly allocated inputs, before the torch reference runs (its tens of GB of temporaries
    # come after); the same call, timer and inputs as benchmarks/gpu_attn.py's kernel table.
    if on_cpu:
        dense_shapes = [(2, 4, 2, 16, 200, 4, 80), (1, 4, 4, 16, 200, 4, None)]
    else:
        dense_shapes = [(64, 32, 8, 128, 32768, 16, 80), (1, 32, 32, 128, 32768, 16, None)]
    for bs, h_q, h_kv, d, ctx, P, target in dense_shapes:
        q, k, v, table, kv_lens = dense_attention_inputs(bs, h_q, h_kv, d, ctx, P, torch.bfloat16, device)
        out = torch.empty(q.shape, dtype=torch.float32, device=device)
        nbytes = bs * ctx * 2 * h_kv * d * k.element_size()  # K + V read once
        t_ours = timer.cold([partial(paged_decode_attention, q, k, v, table, kv_lens, P, out=out)])
        m_ours = timer.mode
        got = paged_decode_attention(q, k, v, table, kv_lens, P, out=out)
        want = sparse_decode_attention(q, k, v, table, kv_lens, P)
        max_abs_err = float((got - want).abs().max())
        del want
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t_torch = _eager_cold(timer, partial(sparse_decode_attention, q, k, v, table, kv_lens, P), reps=5)
        rows.append(_row(f"bs={bs} Hq={h_q} Hkv={h_kv} D={d} ctx={ctx} P={P} bf16", None, "randn", "cold", t_torch,
                         t_ours, nbytes, copy_bw, "decode_attn", baseline="sparse_decode_attention (torch reference)",
                         torch_timing="eager (it syncs for its checks)", ours_timing=m_ours, max_abs_err=max_abs_err,
                         bytes_note="K + V of every token read once", target_pct_copy_bw=target))
        del q, k, v, table, kv_lens, out, got
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # (b) sparse step vs dense step, one kernel
    if on_cpu:
        shapes = [(1, 4, 4, 16, 256, 4, 32, None), (2, 4, 2, 16, 256, 4, 32, None)]
    else:
        shapes = [(1, 32, 32, 128, 32768, 16, 2048, 7.0), (1, 32, 32, 128, 131072, 16, 2048, 10.0),
                  (64, 32, 8, 128, 32768, 16, 2048, 6.0)]
    for bs, h_q, h_kv, d, ctx, P, budget, target in shapes:
        for bounds_dtype in (torch.float32, torch.bfloat16):
            s = decode_step_setup(bs, h_q, h_kv, d, ctx, P, budget, bounds_dtype, device)
            s.sparse_step()
            s.dense_step()
            ref = sparse_decode_attention(s.q, s.k, s.v, s.meta[0], s.meta[1], P)
            max_abs_err = float((s.out_sparse - ref).abs().max())
            kept_tokens = int(s.meta[1].max())
            sel = s.retrieve()
            torch_meta = s.adaptor(*sel, backend="torch")
            torch_meta = tuple(t.clone() for t in torch_meta)
            triton_meta = tuple(t.clone() for t in s.adaptor(*sel))
            fused = s.retrieve_table()  # the step's own path (selection + table in one launch on CUDA)
            page_table_exact = all(bool(torch.equal(a, b)) for a, b in zip((*torch_meta, *sel, *torch_meta),
                                                                           (*triton_meta, *fused), strict=True))
            # the attention launch knobs of both steps: the best of the same short list (defaults included) on each
            # side, so neither side is held back by a default chosen blind; the all-defaults step is timed too
            cands = {"default": {}, **({} if on_cpu else {str(c): c for c in ATTENTION_CANDIDATES})}
            chosen = {}
            for side, fn in (("dense", s.dense_step), ("sparse", s.sparse_attention)):
                times = {}
                for name, cand in cands.items():
                    s.knobs[side] = dict(cand)
                    try:
                        times[name] = timer.cold([fn])
                    except Exception as e:  # e.g. out of resources: not a candidate
                        times[name] = f"failed: {type(e).__name__}"
                best = min((t, name) for name, t in times.items() if isinstance(t, float))[1]
                s.knobs[side] = dict(cands[best])
                chosen[side] = {"knobs": best, "sweep_us": {k_: round(v_, 2) if isinstance(v_, float) else v_
                                                             for k_, v_ in times.items()}}
            t_dense = timer.cold([s.dense_step])
            m_dense = timer.mode
            t_sparse = timer.cold([s.sparse_step])
            m_sparse = timer.mode
            parts = {"retrieve + page table (the step's; fused on CUDA)": timer.cold([s.retrieve_table]),
                     "retrieve (scores + selection)": timer.cold([s.retrieve]),
                     "retrieve: scores (one launch)": timer.cold([s.scores]),
                     "retrieve: scores unfused (torch q split + page map + kernel, not used)":
                         timer.cold([s.scores_unfused]),
                     "page table (one launch on CUDA)": timer.cold([partial(s.adaptor, *sel)]),
                     "page table (torch adaptor, not used)": timer.cold([partial(s.adaptor, *sel, backend="torch")]),
                     "sparse attention": timer.cold([s.sparse_attention])}
            scoring_sweep = {}
            if bs == 1 and not on_cpu:  # bs=1 scoring is latency bound: a few launch shapes beside the default
                for bp, bhd, nw in ((2, 2048, 4), (4, 1024, 4), (8, 512, 4), (1, 4096, 4), (2, 4096, 8), (4, 2048, 8),
                                    (16, 256, 4)):
                    try:
                        t_ = timer.cold([partial(s.scores_with, block_p=bp, block_hd=bhd, num_warps=nw)])
                        scoring_sweep[f"p{bp}_hd{bhd}_w{nw}"] = round(t_, 2)
                    except Exception as e:  # e.g. out of resources
                        scoring_sweep[f"p{bp}_hd{bhd}_w{nw}"] = f"failed: {type(e).__name__}"
                print(f"    scoring launch sweep (us; default {_scoring_default(s)}): {scoring_sweep}", flush=True)
            tuned_sparse = s.knobs["sparse"]
            s.knobs["sparse"] = {}
            t_sparse_default = timer.cold([s.sparse_step])  # both steps with default knobs, for comparison
            s.knobs["sparse"] = tuned_sparse
            t_dense_default = chosen["dense"]["sweep_us"]["default"]
            s.sparse_step()  # leave the step's own outputs in meta / out_sparse
            ceiling = s.dense_bytes / s.sparse_bytes
            shape = f"bs={bs} Hq={h_q} Hkv={h_kv} ctx={ctx} budget={budget} {str(bounds_dtype)[6:]} bounds"
            rows.append(_row(shape, None, "planted", "cold", t_dense, t_sparse, s.sparse_bytes, copy_bw,
                             "sparse_step", baseline="dense step: the same kernel over every page (table prebuilt)",
                             torch_timing=m_dense, ours_timing=m_sparse, dense_bytes=int(s.dense_bytes),
                             byte_limit_speedup=round(ceiling, 2), target_speedup=target,
                             parts_us={k_: round(v_, 2) for k_, v_ in parts.items()}, kept_tokens=kept_tokens,
                             scoring_sweep_us=scoring_sweep,
                             max_abs_err_vs_reference=max_abs_err, page_table_equals_torch=page_table_exact,
                             attention_knobs=chosen, dense_default_knobs_us=t_dense_default,
                             sparse_step_default_knobs_us=round(t_sparse_default, 2),
                             speedup_default_knobs=round(t_dense_default / t_sparse_default, 2),
                             knobs_note="each side's attention runs with the best of the same candidate list "
                                        "(default included); *_default_* fields: both sides with default knobs",
                             bytes_note="sparse: min+max bounds of every page + K/V of the kept tokens; "
                                        "dense: K/V of every token"))
            print(f"    attention knobs: dense {chosen['dense']['knobs']}, sparse {chosen['sparse']['knobs']}; with "
                  f"default knobs x{t_dense_default / t_sparse_default:.2f}; sparse attention sweep (us) "
                  f"{chosen['sparse']['sweep_us']}", flush=True)
            print(f"    byte-limit speedup {ceiling:.2f}x, target {target}x; page table == torch: {page_table_exact}; "
                  "parts " + ", ".join(f"{k_} {v_:.1f} us" for k_, v_ in parts.items()), flush=True)
            del s, ref, sel
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- dsa (indexer logits)
def make_dsa_logits_inputs(bs: int, ctx: int, device, *, heads: int = 64, dim: int = 128, page: int = 64,
                           tokens_per_req: int = 1, seed: int = 0) -> dict:
    """Inputs of ``paged_indexer_logits`` for ``bs`` requests of ``ctx`` keys in the production FP8 layout.

    Pages are distinct and in random physical order (page 0 is padding); each request gets
    ``tokens_per_req`` query tokens, the last ones of its context (decode: 1; a causal last chunk: many).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_per_req = -(-ctx // page)
    num_pages = bs * pages_per_req + 1
    buf = torch.randint(0, 256, (num_pages, page * (dim + 4)), dtype=torch.uint8, device=device)
    keys = buf[:, : page * dim].view(torch.float8_e4m3fn).view(num_pages, page, dim)
    keys.copy_(torch.randn(num_pages, page, dim, device=device).to(torch.float8_e4m3fn))  # no NaN bit patterns
    scales = buf.view(torch.float32)[:, page * dim // 4:]
    scales.copy_(torch.rand(num_pages, page, device=device) + 0.5)
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    block_table = perm.view(bs, pages_per_req).to(torch.int32).to(device)
    T = bs * tokens_per_req
    token_req = torch.arange(bs, dtype=torch.int32).repeat_interleave(tokens_per_req).to(device)
    bounds = (ctx - torch.arange(tokens_per_req - 1, -1, -1, dtype=torch.int32).repeat(bs)).to(device)
    q = torch.randn(T, heads, dim, generator=g).to(device).to(torch.float8_e4m3fn)
    w = torch.randn(T, heads, generator=g).to(device)
    return dict(q=q, weights=w, keys=keys, scales=scales, block_table=block_table, token_req=token_req,
                bounds=bounds, width=ctx)


def _logits_then_topk(logits_fn, k, lengths, ids):
    from sparse_ref.kernels.topk import topk

    return topk(logits_fn(), k, lengths, order="index", width=k, out=ids)


def _reference_then_topk(inp, k):
    from sparse_ref.algorithms.dsa import paged_indexer_logits_reference

    return torch.topk(paged_indexer_logits_reference(**inp), k, dim=1)


def bench_dsa(device, timer, copy_bw, quick, on_cpu):
    """Paged FP8 indexer logits (and + top-2048) against the batched torch reference; the batched indexer."""
    from sparse_ref.algorithms.dsa import paged_indexer_logits_reference
    from sparse_ref.kernels.dsa import paged_indexer_logits, plan_tiles

    if on_cpu:
        shapes, heads, dim, prefill = [(1, 256), (2, 200)], 8, 32, (64, 256)
    else:
        heads, dim, prefill = 64, 128, (8192, 65536)
        shapes = [(1, 65536), (8, 65536), (64, 16384), (64, 65536)] if quick else \
            [(bs, ctx) for bs in (1, 8, 64) for ctx in (4096, 16384, 65536, 131072)]
    base_timer = Timer(device, reps=3 if on_cpu else 10)
    rows = []
    for bs, ctx in shapes:
        inp = make_dsa_logits_inputs(bs, ctx, device, heads=heads, dim=dim)
        out = torch.empty(bs, ctx, dtype=torch.float32, device=device)
        ours = partial(paged_indexer_logits, **inp, fill_tail=False, out=out)
        want = paged_indexer_logits_reference(**inp)
        got = ours()
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        nbytes = bs * ctx * (dim + 4) + bs * ctx * 4
        t_ours = timer.cold([ours])
        m_ours = timer.mode
        t_torch = base_timer.cold([partial(paged_indexer_logits_reference, **inp)])
        shape = f"bs={bs} ctx={ctx}"
        rows.append(_row(shape, None, "randn", "cold", t_torch, t_ours, nbytes, copy_bw, "dsa_logits",
                         baseline="paged_indexer_logits_reference (batched torch gather + fp32 bmm)",
                         torch_timing=base_timer.mode, ours_timing=m_ours, max_err_rel_to_max=err,
                         knobs=f"default (tiles={plan_tiles(bs, ctx, device)}, num_warps=4, num_stages=3, pointer)",
                         bytes_note="keys+scales read once (132 B/token at D=128) + fp32 logits written"))
        k = min(2048, ctx)
        lengths = inp["bounds"]
        ids = torch.empty(bs, k, dtype=torch.int32, device=device)
        t_ours_k = timer.cold([partial(_logits_then_topk, ours, k, lengths, ids)])
        m_ours_k = timer.mode
        t_torch_k = base_timer.cold([partial(_reference_then_topk, inp, k)])
        rows.append(_row(shape, k, "randn", "cold", t_torch_k, t_ours_k, nbytes + bs * ctx * 4 + bs * k * 4, copy_bw,
                         "dsa_logits+topk", baseline="torch reference + torch.topk", torch_timing=base_timer.mode,
                         ours_timing=m_ours_k))
        del inp, out, want, got
    rows += _bench_dsa_knobs(device, timer, copy_bw, on_cpu, heads, dim)
    T, ctx = prefill  # a causal last chunk: T query tokens of one request over ctx keys
    inp = make_dsa_logits_inputs(1, ctx, device, heads=heads, dim=dim, tokens_per_req=T)
    out = torch.empty(T, ctx, dtype=torch.float32, device=device)
    flops = 2 * heads * dim * (T * ctx - T * (T - 1) // 2)
    for knobs in ({}, {"queries_per_program": 1}):  # default: 4 query tokens per program
        t_ours = timer.cold([partial(paged_indexer_logits, **inp, fill_tail=False, out=out, **knobs)])
        rows.append(_row(f"prefill T={T} ctx={ctx}", None, "randn", "cold", float("nan"), t_ours,
                         ctx * (dim + 4) + T * ctx * 4, copy_bw, "dsa_prefill", ours_timing=timer.mode,
                         knobs=_knob_text(knobs), baseline="none (the torch reference would take seconds)",
                         tflops=round(flops / t_ours / 1e6, 1)))
    del inp, out
    rows += _bench_dsa_indexer(device, timer, copy_bw, quick, on_cpu)
    return rows


def _knob_text(knobs: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.items()) or "default"


def _bench_dsa_knobs(device, timer, copy_bw, on_cpu, heads, dim):
    """The default launch against a few other knob settings at the target shapes (logits only)."""
    from sparse_ref.kernels.dsa import paged_indexer_logits, plan_tiles

    if on_cpu:
        grid = {(2, 256): [{}, {"tiles": 1}]}
    else:
        grid = {(64, 65536): [{"tiles": 8}, {"tiles": 32}, {"variant": "tma", "tiles": 64, "num_stages": 2}],
                (64, 16384): [{"tiles": 8}, {"tiles": 16}],
                (8, 65536): [{"tiles": 2}, {"tiles": 8}]}
    rows = []
    for (bs, ctx), settings in grid.items():
        inp = make_dsa_logits_inputs(bs, ctx, device, heads=heads, dim=dim)
        out = torch.empty(bs, ctx, dtype=torch.float32, device=device)
        for knobs in settings:
            try:
                t = timer.cold([partial(paged_indexer_logits, **inp, fill_tail=False, out=out, **knobs)])
            except Exception as e:  # e.g. a variant this GPU lacks: report, keep going
                print(f"  dsa_knobs bs={bs} ctx={ctx} {knobs}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append(_row(f"bs={bs} ctx={ctx}", None, "randn", "cold", float("nan"), t,
                             bs * ctx * (dim + 4) + bs * ctx * 4, copy_bw, "dsa_logits_knobs", ours_timing=timer.mode,
                             knobs=_knob_text(knobs), default_tiles=plan_tiles(bs, ctx, device),
                             baseline="none (compare with the dsa_logits row of the same shape: default knobs)"))
        del inp, out
    return rows


def _selections_agree(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor, k: int, tol: float) -> bool:
    """Whether two -1 padded selections of ``k`` positions differ only where ``scores`` nearly tie the k-th best.

    Every position chosen by one and not the other must score within ``tol`` x the row's largest
    |score| of the row's k-th best score (a near-tie either path may break either way).
    """
    width = scores.shape[1]
    ma = torch.zeros(a.shape[0], width + 1, dtype=torch.bool, device=a.device).scatter_(1, a.long() + 1, True)
    mb = torch.zeros(b.shape[0], width + 1, dtype=torch.bool, device=b.device).scatter_(1, b.long() + 1, True)
    differ = (ma ^ mb)[:, 1:]
    finite = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))
    kth = torch.topk(scores, min(k, width), dim=1).values[:, -1:]
    kth = torch.where(torch.isfinite(kth), kth, torch.zeros_like(kth))
    near = (finite - kth).abs() <= tol * finite.abs().amax(1, keepdim=True)
    return bool((~differ | near).all())


def _bench_dsa_indexer(device, timer, copy_bw, quick, on_cpu):
    """``LightningIndexer`` decode (batched, Triton on CUDA) against its per-request loop reference."""
    from sparse_ref.algorithms.dsa import IndexerConfig, IndexerKeyCache, LightningIndexer
    from sparse_ref.batch import decode_step
    from sparse_ref.memory import KVCacheManager

    if on_cpu:
        bs, ctx, cfg = 2, 128, IndexerConfig(hidden_size=64, q_lora_rank=32, n_heads=8, head_dim=32, rope_dim=16,
                                             index_topk=16)
    else:
        bs, ctx, cfg = 64, 32768, IndexerConfig()
    page = 64
    mgr = KVCacheManager.create(max_requests=bs, max_context_len=ctx + page, num_pages=bs * (ctx // page + 2) + 1,
                                page_size=page, num_layers=1, device=device)
    cache = IndexerKeyCache.for_manager(mgr, cfg)
    idx = LightningIndexer(cfg, device=device).attach_cache(cache)
    idx_torch = LightningIndexer(cfg, device=device, scoring_backend="torch").attach_cache(cache)
    reqs = [mgr.admit(ctx - 1) for _ in range(bs)]
    slots = torch.cat([mgr.req_to_token_pool.req_to_token[r.req_pool_idx, : ctx - 1] for r in reqs]).long()
    g = torch.Generator(device="cpu").manual_seed(0)
    keys = torch.randn(slots.shape[0], cfg.head_dim, generator=g).to(device)
    idx.cache.write(0, slots, keys, torch.rand(slots.shape[0], generator=g).to(device) + 0.5)  # the cached history
    fb = decode_step(mgr, reqs)
    x = torch.randn(bs, cfg.hidden_size, generator=g).to(device)
    ql = torch.randn(bs, cfg.q_lora_rank, generator=g).to(device)
    batched = partial(idx, x, ql, fb.positions, fb, 0)

    def loop():
        return idx.select(idx.index_scores_loop(x, ql, fb.positions, fb, 0), fb.positions)

    # selections: the loop and the batched torch path (both fp32 torch, other summation orders) and the
    # kernel path (FP8 tensor cores) must agree wherever the scores are not near-ties of the k-th best
    loop_scores = idx.index_scores_loop(x, ql, fb.positions, fb, 0)
    sel_loop, sel_ours, sel_torch = loop(), batched(), idx_torch(x, ql, fb.positions, fb, 0)
    k = cfg.index_topk
    agree = {"identical_to_loop": bool(torch.equal(sel_ours, sel_loop)),
             "torch_batched_identical_to_loop": bool(torch.equal(sel_torch, sel_loop)),
             "torch_batched_agrees_with_loop_up_to_ties_1e-5": _selections_agree(sel_torch, sel_loop, loop_scores, k,
                                                                                 1e-5),
             "ours_agrees_with_loop_up_to_ties_1e-3": _selections_agree(sel_ours, sel_loop, loop_scores, k, 1e-3)}
    t_batched = timer.cold([batched])
    m_batched = timer.mode
    qk = idx.prepare(x, ql, fb.positions)  # where the batched step's time goes, each part timed alone
    width = mgr.req_to_token_pool.req_to_token.shape[1]
    scores = idx.logits(qk, fb, 0, width, fill_tail=False)
    parts = {"prepare (fp64 projections, RoPE, Hadamard, FP8)": partial(idx.prepare, x, ql, fb.positions),
             "cache write": partial(idx.cache.write, 0, fb.out_cache_loc, qk.k, qk.k_scale),
             "logits": partial(idx.logits, qk, fb, 0, width, fill_tail=False),
             "top-k": partial(idx.select, scores, fb.positions)}
    parts_us = {name: round(timer.cold([fn]), 1) for name, fn in parts.items()}
    t_eager = _eager_cold(timer, batched, 5 if on_cpu else 20) if device.type == "cuda" else float("nan")
    times = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return [_row(f"decode bs={bs} ctx={ctx}", cfg.index_topk, "randn", "cold", statistics.median(times), t_batched,
                 bs * ctx * cfg.key_bytes_per_token, copy_bw, "dsa_indexer",
                 baseline="index_scores_loop + select (per-request loop, wall clock, synced)",
                 torch_timing="wall clock", ours_timing=m_batched, ours_eager_us=round(t_eager, 1),
                 parts_us=parts_us, ours_backend="triton" if idx.uses_triton_scoring() else "torch", **agree)]


# --------------------------------------------------------------------------- engine (whole decode step, one graph)
def _engine_with_prompts(layers, bs, ctx, h_q, h_kv, d, page_size, budget, device):
    """A ``DecodeEngine`` (bf16 K/V, 16-bit Quest bounds) of ``max_context_len=ctx`` holding ``bs`` prompts of
    ``ctx - page_size`` random-key tokens (room for a page of decode tokens; ``ctx / page_size`` pages per row,
    as in the decode suite's rows).

    Prefilled on the device (random K/V, then ``attention_end`` builds the Quest bounds): the
    workload's CPU prefill of ``bs * ctx`` tokens per layer would take minutes. Decode tokens still
    come from the workload.
    """
    from sparse_ref.batch import build_extend_batch
    from sparse_ref.engine import DecodeEngine
    from sparse_ref.workloads import PlantedEngineWorkload

    recent, sink = 4, 1
    config = SparseConfig(page_budget=max(budget // page_size - recent - sink, 1), num_recent_pages=recent,
                          num_sink_pages=sink)
    wl = PlantedEngineWorkload(num_layers=len(layers), num_q_heads=h_q, num_kv_heads=h_kv, head_dim=d, seed=0)
    engine = DecodeEngine(wl, layers, config, page_size=page_size, max_requests=bs, max_context_len=ctx,
                          attention_backend="auto" if device.type == "cuda" else "triton", compare_dense=False,
                          dtype=torch.bfloat16, bounds_dtype=torch.bfloat16, device=device)
    pool, gen = engine.manager.token_to_kv_pool, torch.Generator(device=device).manual_seed(0)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.normal_(generator=gen)
    for i in range(bs):
        req = engine.manager.admit(ctx - page_size)
        engine.plans[req.rid] = wl.request(i, ctx - page_size)
        engine.coordinator.on_request_begin(req, ctx - page_size)
        engine.live.append(req)
    batch = build_extend_batch(engine.manager, engine.live)
    for layer in range(len(layers)):
        engine.coordinator.attention_end(layer, batch)  # Quest: the bounds of every full page
    return engine


def bench_engine(device, timer, copy_bw, quick, on_cpu):
    """The engine's whole decode step (4 Quest layers) replayed from ONE CUDA graph (``GraphedDecodeStep``),
    per layer against the sum of one layer's parts timed alone, and the dense whole step (same kernel, same graph
    capture); bs=64, 32 q / 8 KV heads, D=128, page 16, bf16 K/V, bf16 Quest bounds, 32K context, budget 2048."""
    from sparse_ref.adaptor import to_attention_metadata
    from sparse_ref.engine_graph import GraphedDecodeStep
    from sparse_ref.kernels.decode_attention import paged_decode_attention

    layers_n = 4
    bs, h_q, h_kv, d, ctx, P, budget = (2, 4, 2, 16, 60, 4, 16) if on_cpu else (64, 32, 8, 128, 32768, 16, 2048)
    reps = timer.reps
    rows, steps = [], {}
    for name, layers in (("dense", [None] * layers_n), ("quest", ["quest"] * layers_n)):
        engine = _engine_with_prompts(layers, bs, ctx, h_q, h_kv, d, P, budget, device)
        step = GraphedDecodeStep(engine)
        step.step()  # capture (and run) the first decode step; replays repeat it on the same static inputs
        steps[name] = {"graph": _eager_cold(timer, step.replay, reps),
                       "eager": _eager_cold(timer, step.run_device_half, max(3, reps // 10)),
                       "mode": "graph replay" if step.graph is not None else "eager (no CUDA graph on CPU)"}
        if name == "dense":
            del engine, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    # one Quest layer's parts, each timed alone (captured on its own) on the step's static inputs
    fb, coord, pool = step.batch, engine.coordinator, engine.manager.token_to_kv_pool
    q, k_new, v_new, _, _ = step.inputs[0]
    algo, r2t = coord.algorithms[0], engine.manager.req_to_token_pool.req_to_token
    mask = fb.seq_lens >= coord.configs[0].min_sparse_seq_len
    scores = algo.score_pages(q, 0, fb.req_pool_indices, fb)
    sel, lens = algo._select(scores, fb.seq_lens, mask)
    table, kv_lens, _ = to_attention_metadata(sel, lens, mask, fb, r2t, P)
    kb, vb = pool.get_key_buffer(0), pool.get_value_buffer(0)
    parts = {"K/V append": partial(pool.set_kv, 0, fb.out_cache_loc, k_new, v_new),
             "scores": partial(algo.score_pages, q, 0, fb.req_pool_indices, fb),
             "selection": partial(algo._select, scores, fb.seq_lens, mask),
             "page table": partial(to_attention_metadata, sel, lens, mask, fb, r2t, P),
             "attention": partial(paged_decode_attention, q, kb, vb, table, kv_lens, P),
             "representation update": partial(algo.update_representations, 0, fb, kb),
             "dense metadata (once per step)": partial(coord.forward_begin, fb)}
    parts_us = {name: round(timer.cold([fn]), 2) for name, fn in parts.items()}
    per_layer_sum = sum(v for name, v in parts_us.items() if "once per step" not in name)
    sparse, dense = steps["quest"]["graph"], steps["dense"]["graph"]
    per_layer = (sparse - parts_us["dense metadata (once per step)"]) / layers_n
    kv_bytes = 2 * 2 * h_kv * d  # bf16 K + V of one token
    bounds_bytes = 2 * 2 * h_kv * d  # bf16 min + max of one page
    sparse_bytes = layers_n * bs * (-(-ctx // P) * bounds_bytes + min(budget, ctx) * kv_bytes)
    shape = f"bs={bs} Hq={h_q} Hkv={h_kv} D={d} ctx={ctx} P={P} budget={budget} {layers_n} layers"  # ctx: the max
    rows.append(_row(shape, None, "random", "cold", dense, sparse, sparse_bytes, copy_bw, "engine_step",
                     baseline="dense whole step: the same engine step, every layer dense (same kernel, one graph)",
                     torch_timing=steps["dense"]["mode"], ours_timing=steps["quest"]["mode"],
                     sparse_eager_us=round(steps["quest"]["eager"], 1),
                     dense_eager_us=round(steps["dense"]["eager"], 1),
                     per_layer_us=round(per_layer, 2), sum_of_parts_per_layer_us=round(per_layer_sum, 2),
                     parts_us=parts_us, dense_bytes=layers_n * bs * ctx * kv_bytes, seq_len=int(fb.seq_lens[0]),
                     parts_note="one Quest layer's parts, each captured and replayed alone, L2 cold; per_layer_us = "
                                "(whole step - dense metadata) / layers",
                     bytes_note="sparse: bf16 min+max bounds of every page + K/V of the kept tokens, all layers"))
    print(f"    per layer {per_layer:.1f} us against the sum of its parts {per_layer_sum:.1f} us; eager step "
          f"{steps['quest']['eager']:.0f} us (dense {steps['dense']['eager']:.0f} us); parts "
          + ", ".join(f"{k_} {v_:.1f}" for k_, v_ in parts_us.items()), flush=True)
    return rows


SUITES = {"topk": bench_topk, "select": bench_select, "quest": bench_quest, "retrieve": bench_retrieve,
          "decode": bench_decode, "dsa": bench_dsa, "engine": bench_engine}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m sparse_ref.bench", description=__doc__.split("\n")[0])
    parser.add_argument("suite", nargs="+", choices=[*SUITES, "all"], help="one or more suites, or all")
    parser.add_argument("--quick", action="store_true", help="fewer distributions and repetitions")
    parser.add_argument("--out", default=None,
                        help=f"where to write the JSON (default: {DEFAULT_OUT}, e.g. build/bench/topk-gpu.json; "
                             f"committed GPU results go to {RESULTS_DIR}/ only with an explicit --out)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on CPU through Triton's interpreter (tiny sizes; not GPU numbers; never written "
                             f"into {RESULTS_DIR}/)")
    args = parser.parse_args(argv)
    device = sparse_ref.default_device()
    on_cpu = device.type != "cuda"
    if on_cpu and not args.allow_cpu:
        raise SystemExit("sparse_ref.bench: no CUDA GPU (or TRITON_INTERPRET is on), so there is nothing to time: "
                         "interpreter timings say nothing about the kernels. Run it on a GPU, or pass --allow-cpu "
                         "for a smoke run whose results are labelled as CPU results (never commit them as GPU "
                         "numbers).")
    out = Path(args.out) if args.out else default_out(args.suite, on_cpu)
    if on_cpu and _in_results_dir(out):
        raise SystemExit(f"sparse_ref.bench: --out {out} is inside {RESULTS_DIR}/, which holds the committed GPU "
                         "results; a CPU run must not overwrite them. Drop --out (it defaults to "
                         f"{default_out(args.suite, on_cpu)}) or write somewhere else.")
    import triton

    timer = Timer(device, reps=2 if on_cpu else (30 if args.quick else 100))
    gpu = torch.cuda.get_device_name() if not on_cpu else "CPU (Triton interpreter) - NOT GPU numbers"
    print(f"sparse_ref.bench on {gpu}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    copy_bw = copy_bandwidth(device, timer)
    print(f"device-to-device copy bandwidth: {copy_bw:.2f} TB/s", flush=True)
    suites = list(SUITES) if "all" in args.suite else list(dict.fromkeys(args.suite))
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
        out.write_text(json.dumps(result, indent=1))
    print(f"\n{'op':<15}{'shape':<24}{'k':>6} {'dist':<10}{'L2':<5}{'torch us':>10}{'ours us':>10}{'x':>7}"
          f"{'TB/s':>7}{'%copy':>7}")
    for r in rows:
        print(f"{r['op']:<15}{r['shape']:<24}{r['k'] if r['k'] is not None else '-':>6} {r['distribution']:<10}"
              f"{r['l2']:<5}{r['torch_us']:>10.1f}{r['ours_us']:>10.1f}{r['speedup']:>7.2f}{r['tbps']:>7.2f}"
              f"{r['pct_copy_bw'] if r['pct_copy_bw'] is not None else '-':>7}")
    print(f"wrote {out}")
    return result


RESULTS_DIR = "benchmarks/results"  # committed GPU results; never written by a CPU run
DEFAULT_OUT = "build/bench/<suites>-<gpu|cpu>.json"


def default_out(suites: list[str], on_cpu: bool) -> Path:
    """Where a run writes its JSON without ``--out``: an ignored build folder, never the committed results."""
    return Path("build", "bench", f"{'+'.join(dict.fromkeys(suites))}-{'cpu' if on_cpu else 'gpu'}.json")


def _in_results_dir(path: Path) -> bool:
    """True when ``path`` lies in a ``benchmarks/results`` folder (relative to anywhere)."""
    parts = path.resolve().parts
    return any(parts[i:i + 2] == ("benchmarks", "results") for i in range(len(parts) - 1))


if __name__ == "__main__":
    main()
