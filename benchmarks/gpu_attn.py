"""GPU check of the paged decode attention kernel: ``python benchmarks/gpu_attn.py [--quick] [--no-bench]``.

1. Correctness, compiled (exit code 1 on any failure): the kernel against
   ``sparse_decode_attention`` / ``dense_decode_attention`` on awkward shapes (lengths 0, 1, one
   page, not a multiple of the page size, the full table; GQA ratios 1/4/8; bf16/fp16/fp32 K/V;
   fp32/bf16 queries; split counts; launch knobs), NaN queries and empty rows, CUDA-graph replay
   == eager, and Quest's outward rounding of 16-bit bounds on the GPU == on the CPU.
2. Timings (L2 cold, CUDA-graph replay, median): the dense kernel at bs=64, 32 q / 8 KV heads,
   D=128, bf16 K/V, 32K context, page 16 with launch-knob variants (splits, warps, block size,
   stages, one- or two-term dots, broadcast instead of tl.dot), the bs=1 MHA kernel at 32K
   (dense) and 2048 tokens (sparse), against the copy bandwidth.
3. ``python -m sparse_ref.bench decode`` (the sparse-vs-dense decode step rows), JSON written to
   ``benchmarks/results/h200_decode.json``.
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
    compare("MHA use_dot=True", case(lens, 16, 16, 128, P, torch.bfloat16, width=64, seed=4), P,
            tol(torch.bfloat16), use_dot=True)

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

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
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


def timings(quick: bool, timer, copy_bw) -> list[tuple]:
    print("== kernel timings (L2 cold, graph replay, median)", flush=True)
    table_rows = []

    def run(label, inputs, nbytes, **knobs):
        q, k, v, table, kv_lens, P = inputs
        out = torch.empty(q.shape, device="cuda")
        try:
            t = timer.cold([partial(paged_decode_attention, q, k, v, table, kv_lens, P, out=out, **knobs)])
            tbps = nbytes / (t * 1e-6) / 1e12
            table_rows.append((label, str(knobs) if knobs else "default", round(t, 1), round(tbps, 2),
                               round(100 * tbps / copy_bw, 1)))
        except Exception as e:  # e.g. out of shared memory
            table_rows.append((label, str(knobs), f"failed: {type(e).__name__}", "", ""))
        print("  ", *table_rows[-1], flush=True)

    P = 16
    q, k, v, table, kv_lens = bench.dense_attention_inputs(64, 32, 8, 128, 32768, P, torch.bfloat16, "cuda")
    nbytes = 64 * 32768 * 2 * 8 * 128 * 2
    label = "dense bs=64 32/8 D=128 32K bf16"
    variants = [{}, dict(num_splits=1), dict(num_splits=2), dict(num_splits=4), dict(num_warps=8),
                dict(block_n=16), dict(block_n=64), dict(block_n=64, num_warps=8), dict(num_stages=2),
                dict(num_stages=4), dict(precise=False), dict(use_dot=False)]
    for knobs in variants[:4] if quick else variants:
        run(label, (q, k, v, table, kv_lens, P), nbytes, **knobs)
    del q, k, v, table, kv_lens
    torch.cuda.empty_cache()
    q, k, v, table, kv_lens = bench.dense_attention_inputs(1, 32, 32, 128, 32768, P, torch.bfloat16, "cuda")
    nbytes = 32768 * 2 * 32 * 128 * 2
    for knobs in ({}, dict(num_splits=8), dict(num_splits=32), dict(num_splits=64), dict(block_n=32),
                  dict(block_n=128), dict(num_warps=8), dict(use_dot=True)):
        run("dense bs=1 MHA 32 D=128 32K bf16", (q, k, v, table, kv_lens, P), nbytes, **knobs)
    sparse_lens = torch.full_like(kv_lens, 2048)
    for knobs in ({}, dict(num_splits=8), dict(num_splits=32), dict(num_splits=64), dict(block_n=32),
                  dict(num_warps=8)):
        run("sparse bs=1 MHA 32 2048 tokens", (q, k, v, table, sparse_lens, P), 2048 * 2 * 32 * 128 * 2, **knobs)
    del q, k, v, table, kv_lens
    torch.cuda.empty_cache()
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
    try:
        correctness(args.quick)
    except Exception as e:
        FAILURES.append(f"correctness section raised {type(e).__name__}: {e}")
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
            bench.main(bench_args)
        except Exception as e:
            FAILURES.append(f"bench decode raised {type(e).__name__}: {e}")
            traceback.print_exc()
    print(f"\n== kernel timings (copy bandwidth {copy_bw:.2f} TB/s)")
    print(f"{'shape':<34}{'knobs':<40}{'us':>10}{'TB/s':>7}{'%copy':>7}")
    for label, knobs, t, tbps, pct in rows:
        print(f"{label:<34}{knobs:<40}{t!s:>10}{tbps!s:>7}{pct!s:>7}")
    print(f"\ncorrectness: {'ALL PASS' if not FAILURES else f'{len(FAILURES)} FAILURE(S)'}")
    for f in FAILURES:
        print("  FAIL", f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
