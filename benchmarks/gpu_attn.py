"""GPU check of the decode step's kernels: ``python benchmarks/gpu_attn.py [--quick] [--no-bench]``.

1. Correctness, compiled (exit code 1 on any failure): the paged decode attention kernel against
   ``sparse_decode_attention`` / ``dense_decode_attention`` on awkward shapes (lengths 0, 1, one
   page, not a multiple of the page size, the full table; GQA ratios 1/4/8; bf16/fp16/fp32 K/V;
   fp32/bf16 queries; split counts; launch knobs), NaN queries and empty rows, CUDA-graph replay
   == eager; the one-launch page table (``kernels/page_table.py``) == the torch adaptor, exactly,
   on random layouts up to bs=3000 and under CUDA-graph replay; the one-launch Quest scoring ==
   the unfused path (and the same selection); Quest's outward rounding of 16-bit bounds on the GPU
   == on the CPU.
2. Timings (L2 cold, CUDA-graph replay, median): a short launch-knob sweep of the attention kernel
   (dense bs=64 GQA 32K, dense bs=1 MHA 32K, sparse bs=1 2048 tokens), the page table kernel
   against the torch adaptor, and the retrieve parts, against the copy bandwidth.
3. ``python -m sparse_ref.bench decode`` (dense kernel rows, the sparse-vs-dense decode step rows
   with their parts), JSON written to ``benchmarks/results/h200_decode.json``; a failed
   page-table equality there is a failure here too.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from functools import partial

import torch

import sparse_ref
from sparse_ref import SparseConfig, bench
from sparse_ref.adaptor import to_attention_metadata
from sparse_ref.algorithms.quest import QuestAlgorithm, round_bounds_outward
from sparse_ref.attention import dense_decode_attention, sparse_decode_attention
from sparse_ref.kernels.decode_attention import paged_decode_attention
from sparse_ref.workloads import make_planted_workload

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(f"{name} {detail}")


def case(lens, h_q, h_kv, d, P, kv_dtype, q_dtype=torch.float32, width=None, num_pages=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs = len(lens)
    width = width or max(1, max(-(-n // P) for n in lens))
    num_pages = num_pages or min(bs * width + 3, 200)  # rows may share pages: read-only
    q = torch.randn(bs, h_q, d, generator=g).to(q_dtype)
    k = (torch.randn(num_pages * P, h_kv, d, generator=g) * 2).to(kv_dtype)
    v = torch.randn(num_pages * P, h_kv, d, generator=g).to(kv_dtype)
    table = torch.zeros(bs, width, dtype=torch.int32)
    for r, n in enumerate(lens):
        used = -(-n // P)
        table[r, :used] = torch.randint(0, num_pages, (used,), generator=g, dtype=torch.int32)
    table[0, 0] = num_pages - 1
    return [t.cuda() for t in (q, k, v, table, torch.tensor(lens, dtype=torch.int32))]


def tol(kv_dtype, precise=True):
    if kv_dtype == torch.float32:
        return 1e-5
    return 1e-3 if precise else 3e-2


def compare(name, c, P, tolerance, **launch):
    q, k, v, table, kv_lens = c
    try:
        got = paged_decode_attention(q, k, v, table, kv_lens, P, **launch)
        torch.cuda.synchronize()
        want = sparse_decode_attention(q, k, v, table, kv_lens, P, scale=launch.get("scale"))
        err = float((got - want).abs().max()) if got.numel() else 0.0
        rel = err / max(1.0, float(want.abs().max()) if want.numel() else 1.0)
        check(name, rel <= tolerance and bool(torch.isfinite(got).all()), f"max err {err:.2e} (tol {tolerance})")
    except Exception as e:  # report and go on
        check(name, False, f"raised {type(e).__name__}: {e}"[:400])
        traceback.print_exc()


def correctness(quick: bool) -> None:
    print("== correctness (compiled)", flush=True)
    P = 16
    lens = [0, 1, 16, 17, 100, 1000, 63 * 16]
    for h_q, h_kv in ((32, 32), (32, 8), (32, 4), (8, 8), (28, 4), (6, 2)):
        for kv_dtype in (torch.bfloat16, torch.float16, torch.float32):
            for d in ((128,) if quick else (128, 64, 80)):
                c = case(lens, h_q, h_kv, d, P, kv_dtype, width=64, seed=h_q + h_kv + d)
                for splits in (None, 1, 7, 64):
                    compare(f"Hq={h_q} Hkv={h_kv} D={d} {str(kv_dtype)[6:]} splits={splits}", c, P, tol(kv_dtype),
                            num_splits=splits)
    c = case(lens, 32, 8, 128, P, torch.bfloat16, q_dtype=torch.bfloat16, width=64, seed=1)
    compare("bf16 queries, scale 0.05", c, P, tol(torch.bfloat16), scale=0.05)
    for P_ in (1, 3):
        compare(f"page size {P_}", case([0, 1, 5, 200], 16, 4, 128, P_, torch.bfloat16, seed=2), P_,
                tol(torch.bfloat16))
    c = case(lens, 32, 8, 128, P, torch.bfloat16, width=64, seed=3)
    for knobs in (dict(use_dot=False), dict(block_n=16), dict(block_n=64), dict(num_warps=8), dict(num_stages=2),
                  dict(num_stages=4), dict(precise=False)):
        compare(f"knobs {knobs}", c, P, tol(torch.bfloat16, knobs.get("precise", True)), **knobs)
    for knobs in (dict(use_dot=False), dict(use_dot=False, num_splits=64), dict(block_n=16), dict(block_n=64)):
        compare(f"MHA {knobs}", case(lens, 16, 16, 128, P, torch.bfloat16, width=64, seed=4), P,
                tol(torch.bfloat16), **knobs)

    # NaN query -> NaN, empty row -> 0 (stated semantics, not the reference)
    q, k, v, table, kv_lens = case([50, 0, 50], 32, 8, 128, P, torch.bfloat16, seed=5)
    q[2, 5, 7] = float("nan")
    q[1] = float("nan")
    out = paged_decode_attention(q, k, v, table, kv_lens, P, num_splits=3)
    check("NaN query gives NaN, empty row gives 0",
          bool(torch.isnan(out[2, 5]).all()) and not bool(out[1].any()) and bool(torch.isfinite(out[0]).all())
          and bool(torch.isfinite(out[2, :5]).all()))

    # dense through the adaptor == dense_decode_attention
    wl = make_planted_workload([3000, 17, 1, 2048], page_size=P, num_q_heads=32, num_kv_heads=8, head_dim=128,
                               dtype=torch.bfloat16, device="cuda", seed=6)
    fb = wl.forward_batch
    bs = 4
    table, kv_lens, _ = to_attention_metadata(torch.full((bs, 1), -1, dtype=torch.int32, device="cuda"),
                                              torch.zeros(bs, dtype=torch.int32, device="cuda"),
                                              torch.zeros(bs, dtype=torch.bool, device="cuda"), fb, wl.req_to_token, P)
    got = paged_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, table, kv_lens, P)
    want = dense_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, wl.req_to_token, fb.req_pool_indices,
                                  fb.seq_lens)
    err = float((got - want).abs().max())
    check("dense step through the adaptor == dense_decode_attention", err < 1e-3, f"max err {err:.2e}")

    # CUDA graph replay == eager
    static = case([0, 1, 16, 333, 1000], 32, 8, 128, P, torch.bfloat16, width=70, num_pages=400, seed=7)
    out = torch.empty(static[0].shape, device="cuda")

    def call():
        paged_decode_attention(*static, P, out=out)

    graph = bench.capture_graph(call)  # warmed up on a side stream, then one call captured
    for seed in range(3):
        lens_ = [int(x) for x in torch.randint(0, 70 * P + 1, (5,), generator=torch.Generator().manual_seed(seed))]
        fresh = case(lens_, 32, 8, 128, P, torch.bfloat16, width=70, num_pages=400, seed=seed + 20)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = paged_decode_attention(*fresh, P)
        check(f"graph replay == eager (lens {lens_})", bool(torch.equal(out, eager)))

    # 16-bit Quest bounds: outward rounding on the GPU == on the CPU, and the step's selection matches fp32
    x = torch.randn(100000) * 30
    x[:4] = torch.tensor([7e4, -7e4, 0.0, float("inf")])
    for dtype in (torch.bfloat16, torch.float16):
        lo_c, hi_c = round_bounds_outward(x, x, dtype)
        lo_g, hi_g = round_bounds_outward(x.cuda(), x.cuda(), dtype)
        check(f"round_bounds_outward {str(dtype)[6:]} cuda == cpu",
              bool(torch.equal(lo_g.cpu(), lo_c)) and bool(torch.equal(hi_g.cpu(), hi_c))
              and bool((lo_c.float() <= x).all()) and bool((hi_c.float() >= x).all()))
    picks = {}
    for bounds in (torch.float32, torch.bfloat16):
        wl = make_planted_workload([4000, 3000], page_size=P, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                   device="cuda", seed=8)
        algo = QuestAlgorithm(SparseConfig(page_budget=4, num_recent_pages=1, num_sink_pages=1), "cuda",
                              bounds_dtype=bounds)
        wl.attach(algo)
        fb = wl.forward_batch
        picks[bounds] = algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices,
                                           torch.ones(2, dtype=torch.bool, device="cuda"), forward_batch=fb)
    check("bf16 bounds select the same pages as fp32 (planted needles)",
          bool(torch.equal(picks[torch.float32][0], picks[torch.bfloat16][0])))


def page_table_case(bs, P, width, r2t_width, seed, sparse_frac=0.7):
    """A random valid (selected, lengths, mask, forward_batch, req_to_token) on the GPU, built without Python loops."""
    from types import SimpleNamespace

    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    seq = torch.randint(0, r2t_width + 1, (bs,), generator=g, device=dev)
    specials = torch.tensor([0, 1, P, 2 * P, r2t_width, r2t_width - 1, P + 1], device=dev).clamp(0, r2t_width)
    if bs >= 2 * len(specials):
        seq[: len(specials)] = specials
    else:
        seq[0] = r2t_width  # a full row
    n = -(-seq // P)
    num_rows = bs + 5
    rows = torch.randperm(num_rows, generator=g, device=dev)[:bs]
    max_n = -(-r2t_width // P)
    offs = torch.cumsum(n, 0) - n
    perm = torch.randperm(int(n.sum()) + 1, generator=g, device=dev) + 1  # physical pages, never 0
    j = torch.arange(max_n, device=dev)
    page_of = perm[(offs[:, None] + j[None, :]).clamp(max=perm.numel() - 1)]  # [bs, max_n]
    t = torch.arange(r2t_width, device=dev)
    slots = page_of[:, (t // P).clamp(max=max_n - 1)] * P + t % P
    r2t = torch.randint(0, 1 << 20, (num_rows, r2t_width), generator=g, device=dev, dtype=torch.int32)  # stale
    r2t[rows] = torch.where(t[None, :] < seq[:, None], slots, r2t[rows].long()).to(torch.int32)
    # sparse rows: k-1 distinct random pages among [0, n-1), ascending, then the last page n-1
    r = torch.rand(bs, max(max_n, 1), generator=g, device=dev)
    r = torch.where(torch.arange(r.shape[1], device=dev)[None, :] < (n - 1)[:, None], r, 2.0)
    picks = torch.argsort(r, dim=1)[:, : width - 1]
    if picks.shape[1] < width - 1:  # fewer pages than selection slots: pad (never picked: keep < n)
        picks = torch.cat([picks, torch.zeros(bs, width - 1 - picks.shape[1], dtype=picks.dtype, device=dev)], 1)
    want = torch.randint(1, width + 1, (bs,), generator=g, device=dev)
    keep = torch.minimum(want - 1, (n - 1).clamp(min=0))  # pages before the last one
    cols = torch.arange(width - 1, device=dev)
    picks = torch.where(cols[None, :] < keep[:, None], picks, 1 << 30).sort(dim=1).values
    selected = torch.full((bs, width), -1, dtype=torch.int32, device=dev)
    selected[:, : width - 1] = torch.where(picks < (1 << 30), picks, -1).to(torch.int32)
    selected.scatter_(1, keep[:, None], (n - 1)[:, None].to(torch.int32))
    lengths = torch.where(n > 0, keep + 1, 0).to(torch.int32)
    selected[n == 0] = -1
    mask = torch.rand(bs, generator=g, device=dev) < sparse_frac
    fb = SimpleNamespace(seq_lens=seq, req_pool_indices=rows)
    return selected, lengths, mask, fb, r2t


def page_table_correctness() -> None:
    print("== page table kernel (compiled) == torch adaptor", flush=True)
    for bs, P, width, r2t_width in ((1, 16, 128, 32768), (7, 16, 40, 1000), (3000, 4, 9, 64), (64, 16, 128, 32768),
                                    (5, 1, 33, 50), (300, 3, 200, 250)):
        try:
            case_ = page_table_case(bs, P, width, r2t_width, seed=bs + P)
            want = to_attention_metadata(*case_, P, backend="torch")
            got = to_attention_metadata(*case_, P, backend="triton")
            ok = all(bool(torch.equal(a, b)) for a, b in zip(want, got, strict=True))
            check(f"page table bs={bs} P={P} W={width} ctx<={r2t_width}", ok)
        except Exception as e:
            check(f"page table bs={bs} P={P} W={width}", False, f"raised {type(e).__name__}: {e}"[:400])
            traceback.print_exc()
    # CUDA graph replay with fresh values == torch adaptor
    static = list(page_table_case(64, 16, 128, 4096, seed=1))
    meta = tuple(t.clone() for t in to_attention_metadata(*static, 16, backend="torch"))
    fb = static[3]

    def call():
        to_attention_metadata(static[0], static[1], static[2], fb, static[4], 16, out=meta, backend="triton")

    graph = bench.capture_graph(call)  # warmed up on a side stream, then one call captured
    for seed in range(3):
        fresh = page_table_case(64, 16, 128, 4096, seed=seed + 10)
        for dst, src in ((static[0], fresh[0]), (static[1], fresh[1]), (static[2], fresh[2]),
                         (fb.seq_lens, fresh[3].seq_lens), (fb.req_pool_indices, fresh[3].req_pool_indices),
                         (static[4], fresh[4])):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = to_attention_metadata(*fresh, 16, backend="torch")
        check(f"page table graph replay == torch adaptor (seed {seed})",
              all(bool(torch.equal(a, b)) for a, b in zip(want, meta, strict=True)))


def quest_fused_correctness() -> None:
    print("== one-launch Quest scoring (compiled) == unfused", flush=True)
    from sparse_ref.algorithms.quest import quest_page_scores_reference, split_query_sign
    from sparse_ref.kernels.quest import quest_page_scores_from_queries

    for h_q, h_kv, mode, q_dtype, b_dtype in ((32, 32, "mean", torch.float32, torch.bfloat16),
                                              (32, 8, "mean", torch.float32, torch.float32),
                                              (32, 8, "per_kv_head", torch.bfloat16, torch.bfloat16),
                                              (28, 4, "mean", torch.float16, torch.float32)):
        try:
            wl = make_planted_workload([5000, 17, 1, 2048, 333], page_size=16, num_q_heads=h_q, num_kv_heads=h_kv,
                                       head_dim=128, device="cuda", seed=h_q + h_kv)
            algo = QuestAlgorithm(SparseConfig(page_budget=8, num_recent_pages=1, num_sink_pages=1, gqa_mode=mode),
                                  "cuda", bounds_dtype=b_dtype)
            wl.attach(algo)
            fb = wl.forward_batch
            q = wl.queries.to(q_dtype)
            got = quest_page_scores_from_queries(q, algo.page_min[0], algo.page_max[0], algo.page_valid[0],
                                                 wl.req_to_token, fb.req_pool_indices, 16, algo.max_pages, mode)
            q_pos, q_neg = split_query_sign(q, h_kv, 128, mode)
            pages = algo.physical_pages(fb.req_pool_indices)
            want = quest_page_scores_reference(q_pos, q_neg, algo.page_min[0], algo.page_max[0], algo.page_valid[0],
                                               pages)
            fin = torch.isfinite(want)
            ok = torch.equal(fin, torch.isfinite(got)) and torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-3)
            err = float((got[fin] - want[fin]).abs().max()) if bool(fin.any()) else 0.0
            picks = [QuestAlgorithm(algo.config, "cuda", bounds_dtype=b_dtype, scoring_backend=backend)
                     for backend in ("torch", "triton")]
            sels = []
            for a in picks:
                wl.attach(a)
                sels.append(a.retrieve_topk(q, 0, fb.req_pool_indices, torch.ones(5, dtype=torch.bool, device="cuda"),
                                            forward_batch=fb))
            same = torch.equal(sels[0][0], sels[1][0]) and torch.equal(sels[0][1], sels[1][1])
            check(f"fused Quest scores Hq={h_q} Hkv={h_kv} {mode} q {str(q_dtype)[6:]} bounds {str(b_dtype)[6:]}",
                  bool(ok) and same, f"max err {err:.2e}, same selection as torch scoring: {same}")
        except Exception as e:
            check(f"fused Quest scores Hq={h_q} Hkv={h_kv} {mode}", False, f"raised {type(e).__name__}: {e}"[:400])
            traceback.print_exc()


def gpu_state() -> str:
    """SM clock and temperature, where torch can read them (pynvml); '' otherwise."""
    try:
        return f"SM clock {torch.cuda.clock_rate()} MHz, {torch.cuda.temperature()} C, {torch.cuda.power_draw()} mW"
    except Exception:
        return ""


def timings(quick: bool, timer, copy_bw) -> list[tuple]:
    print(f"== kernel timings (L2 cold, graph replay, median) {gpu_state()}", flush=True)
    table_rows = []

    def record(label, knobs, fn, nbytes):
        try:
            t = timer.cold([fn])
            tbps = nbytes / (t * 1e-6) / 1e12
            table_rows.append((label, knobs, round(t, 1), round(tbps, 2), round(100 * tbps / copy_bw, 1)))
        except Exception as e:  # e.g. out of shared memory
            table_rows.append((label, knobs, f"failed: {type(e).__name__}", "", ""))
        print("  ", *table_rows[-1], flush=True)

    def run(label, inputs, nbytes, **knobs):
        q, k, v, table, kv_lens, P = inputs
        out = torch.empty(q.shape, device="cuda")
        record(label, str(knobs) if knobs else "default",
               partial(paged_decode_attention, q, k, v, table, kv_lens, P, out=out, **knobs), nbytes)

    P = 16
    q, k, v, table, kv_lens = bench.dense_attention_inputs(64, 32, 8, 128, 32768, P, torch.bfloat16, "cuda")
    nbytes = 64 * 32768 * 2 * 8 * 128 * 2
    label = "dense bs=64 32/8 D=128 32K bf16"
    variants = [{}, dict(num_splits=1), dict(num_splits=2), dict(num_splits=4), dict(block_n=64),
                dict(num_warps=8), dict(precise=False)]
    for knobs in variants[:4] if quick else variants:
        run(label, (q, k, v, table, kv_lens, P), nbytes, **knobs)
    # diagnostic: the same bytes with each row's pages in order (page-table locality / TLB reach)
    ordered = torch.arange(1, table.numel() + 1, dtype=torch.int32, device="cuda").reshape(table.shape)
    run(label + " pages in order", (q, k, v, ordered, kv_lens, P), nbytes)
    run(label + " (again)", (q, k, v, table, kv_lens, P), nbytes)  # drift within the run
    del q, k, v, table, kv_lens, ordered
    torch.cuda.empty_cache()

    q, k, v, table, kv_lens = bench.dense_attention_inputs(1, 32, 32, 128, 32768, P, torch.bfloat16, "cuda")
    nbytes = 32768 * 2 * 32 * 128 * 2
    for knobs in ({}, dict(num_splits=16), dict(num_splits=64), dict(block_n=64), dict(num_warps=8),
                  dict(use_dot=False, num_splits=64)):
        run("dense bs=1 MHA 32 D=128 32K bf16", (q, k, v, table, kv_lens, P), nbytes, **knobs)
    sparse_lens = torch.full_like(kv_lens, 2048)
    for knobs in ({}, dict(num_splits=8), dict(num_splits=16), dict(num_splits=64), dict(block_n=16),
                  dict(block_n=64), dict(block_n=16, num_splits=64), dict(num_warps=2)):
        run("sparse bs=1 MHA 32 2048 tokens", (q, k, v, table, sparse_lens, P), 2048 * 2 * 32 * 128 * 2, **knobs)
    del q, k, v, table, kv_lens
    torch.cuda.empty_cache()

    # the page table: one launch against the torch adaptor (bytes: the table written)
    for bs, width, ctx in ((1, 128, 32768), (1, 128, 131072), (64, 128, 32768)):
        case_ = page_table_case(bs, 16, width, ctx, seed=3, sparse_frac=1.0)
        w_out = max(width, ctx // 16)
        meta = tuple(t.clone() for t in to_attention_metadata(*case_, 16, backend="torch"))
        for backend in ("triton", "torch"):
            record(f"page table bs={bs} ctx={ctx // 1024}K", backend,
                   partial(to_attention_metadata, *case_, 16, out=meta, backend=backend), bs * w_out * 4)
    return table_rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-bench", action="store_true", help="skip python -m sparse_ref.bench decode")
    args = parser.parse_args()
    if sparse_ref.default_device().type != "cuda":
        print("benchmarks/gpu_attn.py needs a CUDA GPU (and TRITON_INTERPRET unset).")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    for section in (partial(correctness, args.quick), page_table_correctness, quest_fused_correctness):
        try:
            section()
        except Exception as e:
            FAILURES.append(f"{getattr(section, '__name__', 'correctness')} raised {type(e).__name__}: {e}")
            traceback.print_exc()
    timer = bench.Timer(torch.device("cuda"), reps=30 if args.quick else 50)
    copy_bw = bench.copy_bandwidth(torch.device("cuda"), timer)
    print(f"copy bandwidth {copy_bw:.2f} TB/s")
    rows = []
    try:
        rows = timings(args.quick, timer, copy_bw)
    except Exception as e:
        FAILURES.append(f"timings raised {type(e).__name__}: {e}")
        traceback.print_exc()
    if not args.no_bench:
        bench_args = ["decode", "--out", "benchmarks/results/h200_decode.json"] + (["--quick"] if args.quick else [])
        try:
            result = bench.main(bench_args)
            for row in result["rows"]:
                if row.get("page_table_equals_torch") is False:
                    FAILURES.append(f"bench {row['shape']}: the Triton page table differs from the torch adaptor")
                if row["op"] == "decode_attn":
                    rows.append((f"bench row {row['shape'][:26]}", "default (bench decode suite)", row["ours_us"],
                                 row["tbps"], row["pct_copy_bw"]))
        except Exception as e:
            FAILURES.append(f"bench decode raised {type(e).__name__}: {e}")
            traceback.print_exc()
    print(f"\n== kernel timings (copy bandwidth {copy_bw:.2f} TB/s) {gpu_state()}")
    print(f"{'shape':<48}{'knobs':<40}{'us':>10}{'TB/s':>7}{'%copy':>7}")
    for label, knobs, t, tbps, pct in rows:
        print(f"{label:<48}{knobs:<40}{t!s:>10}{tbps!s:>7}{pct!s:>7}")
    print(f"\ncorrectness: {'ALL PASS' if not FAILURES else f'{len(FAILURES)} FAILURE(S)'}")
    for f in FAILURES:
        print("  FAIL", f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
