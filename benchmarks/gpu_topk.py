"""One GPU run for the delegate-threshold top-k and the fused page selection: exactness, timings, knobs.

    python benchmarks/gpu_topk.py [--quick] [--no-sweep] [--reps N]

1. **Exactness** (eager and CUDA-graph replay) against ``topk_reference`` for every shape and
   distribution (randn, indexer-like, clustered, ascending-sorted, plateau), both orders, and of
   ``select_pages_triton`` against ``select_pages``.
2. **Candidates**: per-row candidate counts of the delegate filter (min / median / max) and how many
   rows took the fallback (read from the kernels' per-row path flags; register rows' counts: the 16-bit rule in torch).
3. **Timings** (CUDA-graph replay, L2 flushed by zeroing 1 GiB before each call, median): ours
   ``order="index"`` vs ``torch.topk(sorted=False)``, ``order="score"`` vs ``torch.topk(sorted=True)``;
   the fused selection 32 x 8192 pages (k=128, 4 recent) vs ``torch.topk`` alone and torch
   ``select_pages``.
4. **Knob variants** (always run, randn): exactness and time of each ``TUNING`` variant of the winners'
   sort for ``order="score"`` (one ``tl.sort`` per row, or sorted runs then a merge) at 64 x 65536 and
   1 x 131072, and of a few launch knobs in index order at 64 x 65536, 128 x 131072 and 1 x 131072 (some also on
   clustered rows).
5. **Per-launch breakdown** at 64 x 65536, k=2048 (randn and clustered): the call cut after each launch
   (CUDA graph of the launches up to it, L2 flushed before each replay), and each launch's share = the
   difference between consecutive cuts (see ``breakdown``: timing a launch alone would replay the select
   launch on a state with no candidates). The shares add up to the whole call.
6. **Knob sweep** (index order, randn): a few launch-knob variants per shape (``TUNING`` keys).

Budget: the whole run (compilation included) is meant to finish in about 4 minutes on an H200.

Prints a compact table at the end; exits 1 on any exactness failure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch

import sparse_ref  # noqa: F401  (interpreter set-up; a GPU is required here)
from sparse_ref.bench import Timer, make_distribution
from sparse_ref.config import SparseConfig
from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels import topk_common
from sparse_ref.kernels.page_select import select_pages_triton
from sparse_ref.kernels.topk import TUNING, launch_topk, launches, topk
from sparse_ref.selection import select_pages, topk_reference

SHAPES = [(64, 65536, 2048), (64, 131072, 2048), (128, 131072, 2048), (1, 131072, 2048), (32, 8192, 128)]
DISTS = ["randn", "indexer", "clustered", "sorted", "plateau"]
SWEEP = {"pair_rank": [0], "chunk": [1024], "delegate_warps": [4], "num_warps": [16], "delegate_cols": [512],
         "reverse_rows": [False]}
SORT_SWEEP = {"sort_run": [0, 256, 1024]}  # order="score" at SORT_SHAPE
SORT_SHAPE = (64, 65536, 2048)
# order="score" variants, always run (exactness + time over index order): one tl.sort per row with its warps,
# or runs of sort_run winners sorted by parallel programs then merged (sort_run_warps)
SORT_VARIANTS = [dict(sort_run=0, sort_warps=16), dict(sort_run=0, sort_warps=32)] + [
    dict(sort_run=r, sort_run_warps=w) for r, w in ((512, 4), (512, 8), (1024, 8), (256, 4))]
SORT_VARIANT_SHAPES = [(64, 65536, 2048), (1, 131072, 2048)]
# index-order knob variants, always run (exactness + time against the defaults), randn
INDEX_VARIANTS = [dict(pdl=False), dict(chunk=1024), dict(select_warps=32), dict(pair_rank=64),
                  dict(reverse_rows=False), dict(local_threshold=0)]
# also on clustered rows (their runs are uneven; some take the tie path)
CLUSTERED_VARIANTS = [dict(chunk=4096), dict(tie_tile=4096), dict(select_programs=512)]
INDEX_VARIANT_SHAPES = [(64, 65536, 2048), (128, 131072, 2048), (1, 131072, 2048)]
SWEEP_SHAPES = [(64, 65536, 2048), (128, 131072, 2048), (1, 131072, 2048), (32, 8192, 128)]
failures: list[str] = []


def check(label, got, ref):
    if not torch.equal(got.cpu(), ref.cpu()):
        bad = (got.cpu() != ref.cpu()).any(1).nonzero().flatten().tolist()
        failures.append(f"{label}: rows {bad[:8]} differ")
        print(f"  FAIL {label}: rows {bad[:8]} differ", flush=True)


def candidate_stats(x, k):
    """(per-row candidate counts, fallback rows) of the delegate filter for this call. Register rows: the
    counts at the 16-bit threshold (a row over the slots then continues to the exact k-th delegate); the
    fallback rows from the kernel's per-row path flags, as for long rows."""
    R, N = x.shape
    out = torch.empty(R, k, dtype=torch.int32, device=x.device)
    stats: dict = {}
    launch_topk(x, k, None, None, out, stats)
    p = stats["plan"]
    if "above" in stats:
        counts = (stats["above"] + stats["ties"]).sum(1)  # keys > T plus keys == T: the candidates
        flags = stats["flags"]  # 0: in the slots, 2: tie path, 3: the keys > T reselected, 1: whole-row radix select
        return counts, f"{int((flags != 0).sum())}/{R} r{int((flags == 1).sum())}"
    # register rows: the kernel's rule in torch (keys, strided delegates, k-th delegate cut to 16 bits)
    f = x.float() + 0.0
    i = f.view(torch.int32)
    none = torch.iinfo(torch.int32).min
    key = torch.where(torch.isnan(f) | (f == float("-inf")), none, i ^ ((i >> 31) & 0x7FFFFFFF))
    pad = p["n_pad"] - N
    keyp = torch.nn.functional.pad(key, (0, pad), value=none)
    dele = keyp.view(R, p["n_pad"] // p["G"], p["G"]).amax(1)
    t = dele.topk(min(k, p["G"]), dim=1).values[:, -1]
    t = ((t.long() + 2**31) >> 16 << 16) - 2**31  # the two-round (16-bit) prefix of the k-th delegate
    counts = (key.long() >= t[:, None]).sum(1)
    flags = stats["flags"]  # 0: in the slots, 2: tie path, 3: the keys > T reselected, 1: whole-row radix select
    return counts, f"{int((flags != 0).sum())}/{R} r{int((flags == 1).sum())}"


def breakdown(R, N, k, dist, timer, device) -> list:
    """Each launch's share of one call: the call cut after each launch (delegates; + candidates; + select),
    each cut replayed with L2 flushed, and the differences between cuts. (Timing a launch
    alone would replay it on the state earlier replays left: after many replays of the candidates
    launch alone, the rows' slot counters are far past the slots, so a select replayed alone sees no
    candidates at all.) The cut after the candidates launch must leave the slot counters at zero as a
    whole call does, so it ends with a tiny torch kernel that zeroes them; that kernel's own share (the
    cut "delegates + reset" minus "delegates") is taken off again."""
    copies = [make_distribution(dist, R, N, device, seed=s) for s in range(4)]
    plans = []
    for c in copies:
        out = torch.empty(R, k, dtype=torch.int32, device=device)
        stats: dict = {}
        steps = launches(c, k, None, None, out, stats)
        for _, fn in steps:
            fn()
        plans.append(steps)
    torch.cuda.synchronize()
    flags = stats.get("flags")
    counters = topk_module._SYNC[str(copies[0].device)][:, topk_common.CNT.value]  # (the key names the index)

    def cut(n, reset=False):  # the first n launches of each copy's call, then the counter reset
        def call(steps):
            for _, fn in steps[:n]:
                fn()
            if reset:
                counters.zero_()
        return timer.cold([partial(call, steps) for steps in plans])

    names = [name for name, _ in plans[0]]
    t_del = cut(1)
    reset_share = cut(1, reset=True) - t_del
    cuts = [t_del, cut(2, reset=True) - reset_share] + [cut(n) for n in range(3, len(names) + 1)]
    rows = []
    for i, name in enumerate(names):
        t = cuts[i] - (cuts[i - 1] if i else 0.0)
        rows.append((f"{R}x{N} {dist}", name, t))
        print(f"  breakdown {R}x{N} k={k} {dist:<9} {name:<12} {t:7.1f} us (the call up to it: {cuts[i]:.1f})"
              + (f" (fallback flags {flags.tolist()[:4]}...)" if name == "select" and flags is not None else ""),
              flush=True)
    return rows


def knob_variants(shapes, variants, order, timer, device, dist="randn") -> list:
    """``order`` under each knob set of ``variants``: exactness, and the time against the defaults in
    index order. Rows: (shape, knobs, index-order time with the defaults, time with the knobs)."""
    rows = []
    for R, N, k in shapes:
        copies = [make_distribution(dist, R, N, device, seed=s) for s in range(4)]
        out = torch.empty(R, k, dtype=torch.int32, device=device)
        t_index = timer.cold([partial(topk, c, k, order="index", out=out) for c in copies])
        for variant in variants:
            saved = dict(TUNING)
            TUNING.update(variant)
            name = ",".join(f"{a}={b}" for a, b in variant.items())
            try:
                for c in copies[:2]:
                    check(f"variant {R}x{N} {order} {name}", topk(c, k, order=order),
                          topk_reference(c, k, order=order))
                t = timer.cold([partial(topk, c, k, order=order, out=out) for c in copies])
            except Exception as e:  # noqa: BLE001
                print(f"  variant {R}x{N} {name}: {type(e).__name__}: {str(e)[-200:]}", flush=True)
                t = float("nan")
            finally:
                TUNING.clear()
                TUNING.update(saved)
            rows.append((f"{R}x{N}" + (f" {dist}" if dist != "randn" else ""), name, t_index, t))
            print(f"  order={order} {R}x{N} {dist} {name:<32} {t:7.1f} us (index order, defaults {t_index:.1f}: "
                  f"{t - t_index:+.1f})", flush=True)
    return rows


def run_shape(R, N, k, dist, timer, device) -> dict:
    """Exactness (eager, graph replay), candidate counts and the four timings for one shape."""
    copies = [make_distribution(dist, R, N, device, seed=s) for s in range(4)]
    x = copies[0]
    for order in ("index", "score"):
        check(f"{R}x{N} k={k} {dist} {order}", topk(x, k, order=order), topk_reference(x, k, order=order))
    # CUDA graph: captured on copy 0, replayed on copy 1 (the counters must have reset themselves)
    out = torch.empty(R, k, dtype=torch.int32, device=device)
    buf = x.clone()
    topk(buf, k, order="index", out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk(buf, k, order="index", out=out)
    for c in copies[1:3]:
        buf.copy_(c)
        graph.replay()
        check(f"{R}x{N} k={k} {dist} graph replay", out, topk_reference(c, k, order="index"))
    counts, fallback = candidate_stats(x, k)
    cand = (f"{int(counts.min())}/{int(counts.float().median())}/{int(counts.max())}")
    t_ti = timer.cold([partial(torch.topk, c, k, dim=1, sorted=False) for c in copies])
    t_oi = timer.cold([partial(topk, c, k, order="index", out=out) for c in copies])
    t_ts = timer.cold([partial(torch.topk, c, k, dim=1, sorted=True) for c in copies])
    t_os = timer.cold([partial(topk, c, k, order="score", out=out) for c in copies])
    row = dict(shape=f"{R}x{N}", k=k, dist=dist, torch_unsorted=t_ti, ours_index=t_oi, torch_sorted=t_ts,
               ours_score=t_os, cand=cand, fallback=fallback)
    print(f"  {row['shape']:>10} k={k:<5} {dist:<9} torch(sorted=False) {t_ti:7.1f} | index {t_oi:7.1f} "
          f"(x{t_ti / t_oi:4.2f}) | torch(sorted=True) {t_ts:7.1f} | score {t_os:7.1f} (x{t_ts / t_os:4.2f})"
          f" | cand min/med/max {cand} | fallback rows {fallback}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="randn and sorted only, fewer reps")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    timer = Timer(device, reps=30 if args.quick else args.reps)
    dists = ["randn", "sorted"] if args.quick else DISTS
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, TUNING {TUNING}", flush=True)
    table = []
    for R, N, k in SHAPES:
        for dist in dists:
            try:
                table.append(run_shape(R, N, k, dist, timer, device))
            except Exception as e:  # noqa: BLE001  (report and go on: one GPU call should give all it can)
                failures.append(f"{R}x{N} k={k} {dist}: {type(e).__name__}: {str(e)[-300:]}")
                print(f"  FAIL {failures[-1]}", flush=True)

    # fused page selection, 32 x 8192 pages, k = 128 + 4 recent pages
    bs, pages, page_size, k = 32, 8192, 16, 128
    config = SparseConfig(page_budget=k, num_recent_pages=4)
    g = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(pages * page_size * 3 // 4, pages * page_size + 1, (bs,), generator=g).to(device)
    seq_lens[0] = pages * page_size
    mask = torch.ones(bs, dtype=torch.bool, device=device)
    sel_rows = []
    for dist in dists:
        try:
            copies = [make_distribution(dist, bs, pages, device, seed=s) for s in range(4)]
            got = select_pages_triton(copies[0], seq_lens, mask, page_size, config)
            ref = select_pages(copies[0], seq_lens, mask, page_size, config)
            check(f"select {dist} selected", got[0], ref[0])
            check(f"select {dist} lengths", got[1][None], ref[1][None])
            t_ours = timer.cold([partial(select_pages_triton, c, seq_lens, mask, page_size, config) for c in copies])
            t_topk = timer.cold([partial(torch.topk, c, k, dim=1, sorted=False) for c in copies])
            t_sel = timer.cold([partial(select_pages, c, seq_lens, mask, page_size, config) for c in copies])
            sel_rows.append((dist, t_ours, t_topk, t_sel))
            print(f"  select 32x8192 k=128+4 {dist:<9} ours {t_ours:6.1f} | torch.topk alone {t_topk:6.1f} | "
                  f"torch select_pages {t_sel:7.1f}", flush=True)
        except Exception as e:  # noqa: BLE001
            failures.append(f"select {dist}: {type(e).__name__}: {str(e)[-300:]}")
            print(f"  FAIL {failures[-1]}", flush=True)

    sort_rows = knob_variants(SORT_VARIANT_SHAPES, SORT_VARIANTS, "score", timer, device)
    index_rows = knob_variants(INDEX_VARIANT_SHAPES, INDEX_VARIANTS, "index", timer, device)
    index_rows += knob_variants(INDEX_VARIANT_SHAPES, CLUSTERED_VARIANTS, "index", timer, device, dist="clustered")

    parts = []
    for dist in ("randn", "clustered"):
        try:
            parts += breakdown(64, 65536, 2048, dist, timer, device)
        except Exception as e:  # noqa: BLE001
            print(f"  breakdown {dist}: {type(e).__name__}: {str(e)[-300:]}", flush=True)

    sweep_rows = []
    if not args.no_sweep:
        for R, N, k in SWEEP_SHAPES:
            copies = [make_distribution("randn", R, N, device, seed=s) for s in range(4)]
            out = torch.empty(R, k, dtype=torch.int32, device=device)
            base = timer.cold([partial(topk, c, k, order="index", out=out) for c in copies])
            sweep_rows.append((f"{R}x{N}", "default", base))
            for knob, values in SWEEP.items():
                if N <= TUNING["register_row"] and knob not in ("pair_rank", "num_warps"):
                    continue  # register rows: one kernel, the long-row knobs do not apply
                for v in values:
                    saved = TUNING[knob]
                    TUNING[knob] = v
                    try:
                        check(f"sweep {R}x{N} {knob}={v}", topk(copies[0], k, order="index"),
                              topk_reference(copies[0], k, order="index"))
                        t = timer.cold([partial(topk, c, k, order="index", out=out) for c in copies])
                    except Exception as e:  # noqa: BLE001  (a knob may not compile: report, continue)
                        print(f"  sweep {R}x{N} {knob}={v}: {type(e).__name__}: {str(e)[-200:]}", flush=True)
                        t = float("nan")
                    finally:
                        TUNING[knob] = saved
                    sweep_rows.append((f"{R}x{N}", f"{knob}={v}", t))
                    print(f"  sweep {R}x{N} {knob}={v}: {t:.1f} us (default {base:.1f})", flush=True)
        # order="score": the warps of the winners' sort
        R, N, k = SORT_SHAPE
        copies = [make_distribution("randn", R, N, device, seed=s) for s in range(4)]
        out = torch.empty(R, k, dtype=torch.int32, device=device)
        for knob, values in SORT_SWEEP.items():
            for v in [TUNING[knob], *values]:
                saved = TUNING[knob]
                TUNING[knob] = v
                try:
                    check(f"sweep score {knob}={v}", topk(copies[0], k, order="score"),
                          topk_reference(copies[0], k, order="score"))
                    t = timer.cold([partial(topk, c, k, order="score", out=out) for c in copies])
                except Exception as e:  # noqa: BLE001
                    print(f"  sweep score {knob}={v}: {type(e).__name__}: {str(e)[-200:]}", flush=True)
                    t = float("nan")
                finally:
                    TUNING[knob] = saved
                sweep_rows.append((f"{R}x{N} order=score", f"{knob}={v}", t))
                print(f"  sweep {R}x{N} order=score {knob}={v}: {t:.1f} us", flush=True)
        # the fused selection: pairwise rank off, 16 warps (randn and clustered)
        for dist in ("randn", "clustered"):
            copies = [make_distribution(dist, bs, pages, device, seed=s) for s in range(4)]
            for knob, v in (("pair_rank", 128), ("pair_rank", 0), ("num_warps", 16)):
                saved = TUNING[knob]
                TUNING[knob] = v
                try:
                    check(f"sweep select {dist} {knob}={v}",
                          select_pages_triton(copies[0], seq_lens, mask, page_size, config)[0],
                          select_pages(copies[0], seq_lens, mask, page_size, config)[0])
                    t = timer.cold([partial(select_pages_triton, c, seq_lens, mask, page_size, config)
                                    for c in copies])
                except Exception as e:  # noqa: BLE001
                    print(f"  sweep select {knob}={v}: {type(e).__name__}: {str(e)[-200:]}", flush=True)
                    t = float("nan")
                finally:
                    TUNING[knob] = saved
                sweep_rows.append((f"select 32x8192 {dist}", f"{knob}={v}", t))
                print(f"  sweep select {dist} {knob}={v}: {t:.1f} us", flush=True)

    print("\n== top-k, us (CUDA-graph replay, L2 flushed, median) ==")
    print(f"{'shape':>10} {'k':>5} {'dist':<9} {'torch sF':>9} {'index':>8} {'x':>5} {'torch sT':>9} {'score':>8} "
          f"{'x':>5} {'cand min/med/max':>18} {'fallback':>12}")
    for r in table:
        print(f"{r['shape']:>10} {r['k']:>5} {r['dist']:<9} {r['torch_unsorted']:9.1f} {r['ours_index']:8.1f} "
              f"{r['torch_unsorted'] / r['ours_index']:5.2f} {r['torch_sorted']:9.1f} {r['ours_score']:8.1f} "
              f"{r['torch_sorted'] / r['ours_score']:5.2f} {r['cand']:>18} {r['fallback']:>12}")
    print("\n== fused page selection 32 x 8192 pages, k=128 + 4 recent, us ==")
    for dist, t_ours, t_topk, t_sel in sel_rows:
        print(f"{dist:<9} ours {t_ours:6.1f} | torch.topk alone {t_topk:6.1f} (x{t_topk / t_ours:4.2f}) | "
              f"select_pages {t_sel:7.1f} (x{t_sel / t_ours:5.1f})")
    if parts:
        print("\n== per-launch breakdown, 64 x 65536 k=2048 (each launch's share of the call, L2 flushed), us ==")
        for shape in dict.fromkeys(s for s, _, _ in parts):
            print(f"{shape:>16}: " + ", ".join(f"{n} {t:.1f}" for s, n, t in parts if s == shape)
                  + f" | sum {sum(t for s, _, t in parts if s == shape):.1f}")
        t = {(s.split()[-1], n): v for s, n, v in parts}
        if ("randn", "candidates") in t and ("clustered", "candidates") in t:
            print(f"  candidates randn {t['randn', 'candidates']:.1f} vs clustered {t['clustered', 'candidates']:.1f}")
    for title, rows in (("order=\"score\" variants (randn), us: score order (its cost over index order)", sort_rows),
                        ("index-order knob variants (randn unless named), us (vs the defaults)", index_rows)):
        print(f"\n== {title} ==")
        for shape in dict.fromkeys(r[0] for r in rows):
            print(f"{shape:>10} index {[r for r in rows if r[0] == shape][0][2]:.1f}: "
                  + ", ".join(f"{n} {t:.1f} ({t - ti:+.1f})" for s_, n, ti, t in rows if s_ == shape))
    if sweep_rows:
        print("\n== knob sweep (index order, randn), us ==")
        for shape in dict.fromkeys(s for s, _, _ in sweep_rows):
            items = [(n, t) for s, n, t in sweep_rows if s == shape]
            print(f"{shape:>22}: " + ", ".join(f"{n} {t:.1f}" for n, t in items))
    if table:
        print(f"\nmedian speedup index vs sorted=False: "
              f"{statistics.median(r['torch_unsorted'] / r['ours_index'] for r in table):.2f}")
    if failures:
        print(f"\n{len(failures)} EXACTNESS FAILURES:\n" + "\n".join(failures))
        return 1
    print("\nall exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
