"""GPU check of the paged FP8 indexer-logits kernel: correctness, then timings and a launch-knob sweep.

    .venv/bin/python benchmarks/gpu_dsa.py [--quick] [--no-sweep]

1. **Correctness** (exit code 1 on any failure): ``sparse_ref.kernels.dsa.paged_indexer_logits``
   against ``paged_indexer_logits_reference`` (torch, fp32 on the same FP8 values) at ragged
   lengths (1, 63, 64, 65, ...), random page order, page 64 and 16, chunked prefill (many query
   tokens per request, each with its own causal bound), B=1 x 64K, tails filled or not, the
   full-precision cache, every launch knob of the sweep and the TMA variant; then the whole
   ``LightningIndexer`` (Triton vs torch scoring paths, prefill + decode, DeepSeek's shapes) and a
   CUDA-graph capture of its decode step.
   Tolerance: Hopper's FP8 tensor cores accumulate the products of a dot in reduced precision
   (about 14 mantissa bits, not fp32's 24), so a dot's error is ~2^-14 times the sum of the
   |products| it adds, and a logit's error follows the MAGNITUDE of its terms,
   ``M[t, s] = k_scale[s] * sum_h |w[t, h]| relu(q[t, h] · k[s])`` (the reference with |w|), not
   its signed value: with signed head weights a short row's logits can nearly cancel (the
   indexer's row of position 0 holds one logit), so "relative to the row's max |logit|" blows up
   there (1.1e-3 seen on prefill rows while calc_diff stayed 8e-9). The check: per row
   ``max |kernel - reference| <= 1e-3 * max M`` (measured ~1e-4), and, over a case,
   ``calc_diff = 1 - 2 sum(x y) / sum(x^2 + y^2) <= 1e-5`` (DeepGEMM's metric); ``-inf`` entries
   must match exactly, and a rerun must be bitwise identical. The old ratio to ``max |logit|`` is
   printed too (``vs |I|``).
2. **Timing**: CUDA-graph replay of one call, 1 GiB L2 flush before each, median (the
   ``sparse_ref.bench`` harness), against the device-to-device copy bandwidth of the same run.
   Byte floor = keys + scales read once (132 B/token) + fp32 logits written.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch

import sparse_ref
from sparse_ref.algorithms.dsa import IndexerConfig, IndexerKeyCache, LightningIndexer, paged_indexer_logits_reference
from sparse_ref.batch import build_extend_batch, decode_step
from sparse_ref.bench import Timer, copy_bandwidth, make_dsa_logits_inputs
from sparse_ref.kernels.dsa import paged_indexer_logits, plan_tiles
from sparse_ref.kernels.topk import topk
from sparse_ref.memory import KVCacheManager

FAILURES: list[str] = []
DEV = torch.device("cuda")
MAX_REL, MAX_CALC_DIFF = 1e-3, 1e-5


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def compare_logits(name: str, got: torch.Tensor, want: torch.Tensor, bounds: torch.Tensor, fill_tail: bool = True,
            magnitude: torch.Tensor | None = None) -> None:
    """``magnitude``: the reference computed with |weights| (same shape); None: ``|want|``."""
    cols = torch.arange(want.shape[1], device=want.device)[None, :]
    visible = cols < bounds[:, None].long()
    ok_inf = True
    if fill_tail:
        ok_inf = bool(torch.equal(torch.isinf(got), torch.isinf(want))) and bool((got[~visible] == -torch.inf).all())
    g, w = got.masked_fill(~visible, 0), want.masked_fill(~visible, 0)
    m = w.abs() if magnitude is None else magnitude.masked_fill(~visible, 0).abs()
    err = (g - w).abs().amax(1) if g.numel() else torch.zeros(0, device=g.device)
    rel = float((err / m.amax(1).clamp_min(1e-30)).max()) if g.numel() else 0.0
    rel_signed = float((err / w.abs().amax(1).clamp_min(1e-30)).max()) if g.numel() else 0.0
    cd = calc_diff(g[visible], w[visible]) if visible.any() else 0.0
    good = ok_inf and rel <= MAX_REL and cd <= MAX_CALC_DIFF and not torch.isnan(g).any()
    print(f"  {'ok  ' if good else 'FAIL'} {name:<58} max rel {rel:.1e} (vs |I| {rel_signed:.1e})  calc_diff "
          f"{cd:.1e}  -inf ok {ok_inf}", flush=True)
    if not good:
        FAILURES.append(name)


def selection_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |a ∩ b| / |b| for -1 padded id rows (1.0 for rows where b is empty)."""
    width = int(max(a.max(), b.max(), 0)) + 2
    ma = torch.zeros(a.shape[0], width, dtype=torch.bool, device=a.device).scatter_(1, a.long() + 1, True)
    mb = torch.zeros(b.shape[0], width, dtype=torch.bool, device=b.device).scatter_(1, b.long() + 1, True)
    inter, count = (ma & mb)[:, 1:].sum(1), mb[:, 1:].sum(1)
    return float(torch.where(count > 0, inter / count.clamp_min(1), 1.0).mean())


def ragged_inputs(lengths, page, tokens_per_req=1, heads=64, dim=128, seed=0):
    """Like make_dsa_logits_inputs, with one length per request (and a random page order)."""
    dev = DEV
    ctx = max(lengths)
    base = make_dsa_logits_inputs(len(lengths), ctx, dev, heads=heads, dim=dim, page=page, seed=seed,
                                  tokens_per_req=tokens_per_req)
    bounds = []
    for n in lengths:
        bounds += [max(1, n - j) for j in range(tokens_per_req - 1, -1, -1)]
    base["bounds"] = torch.tensor(bounds, dtype=torch.int32, device=dev)
    base["width"] = ctx + 37  # a width that is not a multiple of anything
    return base


def check_kernel(quick: bool) -> None:
    print("== kernel vs torch reference", flush=True)
    sm90 = torch.cuda.get_device_capability() >= (9, 0)
    cases = {
        "decode ragged 1/63/64/65/1000/4097/30000, page 64": (ragged_inputs([1, 63, 64, 65, 1000, 4097, 30000], 64),
                                                               True),
        "decode ragged, page 16 (per-row gather)": (ragged_inputs([1, 15, 16, 17, 500, 9000], 16), False),
        "chunked prefill: 96 query tokens/request": (ragged_inputs([130, 1500, 5000], 64, tokens_per_req=96), True),
        "B=1 x 64K": (make_dsa_logits_inputs(1, 65536, DEV), True),
        "heads 32, D 64, page 64": (ragged_inputs([70, 700, 7000], 64, heads=32, dim=64), True),
    }
    for name, (inp, tma_ok) in cases.items():
        want = paged_indexer_logits_reference(**inp)
        magnitude = paged_indexer_logits_reference(**dict(inp, weights=inp["weights"].abs()))
        compare = partial(compare_logits, magnitude=magnitude)
        got = paged_indexer_logits(**inp)
        compare(name, got, want, inp["bounds"])
        again = paged_indexer_logits(**inp)
        if not torch.equal(got, again):
            FAILURES.append(name + " (rerun not bitwise identical)")
            print("  FAIL rerun not bitwise identical", flush=True)
        out = torch.full_like(got, 7.0)
        paged_indexer_logits(**inp, fill_tail=False, out=out)
        compare(name + " | no tail fill", out, want, inp["bounds"], fill_tail=False)
        for qb in (2, 4, 8):
            try:
                got_qb = paged_indexer_logits(**inp, queries_per_program=qb, num_warps=4 if qb < 8 else 8)
                compare(f"{name} | {qb} queries per program", got_qb, want, inp["bounds"])
            except Exception as e:  # e.g. out of resources: report, keep going
                FAILURES.append(f"{name} | {qb} queries per program: {type(e).__name__}")
                print(f"  FAIL {name} | {qb} queries per program: {type(e).__name__}: {str(e)[:500]}", flush=True)
        if name.startswith("decode ragged 1/63"):
            for tiles in (1, 4, 16, 64, 128):
                for warps in (4, 8):
                    compare(f"  knobs tiles={tiles} warps={warps}", paged_indexer_logits(**inp, tiles=tiles,
                            num_warps=warps), want, inp["bounds"])
            compare("  knobs block_t=128 (2 pages per tile)", paged_indexer_logits(**inp, block_t=128), want,
                    inp["bounds"])
            compare("  knobs num_stages=3", paged_indexer_logits(**inp, num_stages=3), want, inp["bounds"])
        if tma_ok and sm90:
            try:
                compare(name + " | TMA", paged_indexer_logits(**inp, variant="tma"), want, inp["bounds"])
                out = torch.full_like(got, 7.0)
                paged_indexer_logits(**inp, variant="tma", fill_tail=False, out=out)
                compare(name + " | TMA, no tail fill", out, want, inp["bounds"], fill_tail=False)
            except Exception as e:  # report, keep going
                FAILURES.append(f"{name} | TMA: {type(e).__name__}")
                print(f"  FAIL {name} | TMA: {type(e).__name__}: {str(e)[:800]}", flush=True)
        del inp, want, got
    # full-precision cache (use_fp8=False): fp32 keys, ieee fp32 dot
    inp = ragged_inputs([5, 100, 1000], 64, heads=16, dim=64)
    keys32 = inp["keys"].float().contiguous()
    scales32 = inp["scales"].contiguous()
    inp32 = dict(inp, q=inp["q"].float(), keys=keys32, scales=scales32)
    compare_logits("full-precision cache (fp32 keys)", paged_indexer_logits(**inp32),
                   paged_indexer_logits_reference(**inp32), inp["bounds"])


def check_indexer(quick: bool, cfg: IndexerConfig | None = None, lengths: list[int] | None = None) -> None:
    print("== LightningIndexer: Triton path vs torch path vs per-request loop (DeepSeek shapes)", flush=True)
    dev = DEV
    cfg = cfg or IndexerConfig()
    lengths = lengths or ([1, 65, 3000, 9000] if not quick else [1, 65, 3000])
    page = 64
    runs = {}
    for backend in ("torch", "triton"):
        mgr = KVCacheManager.create(max_requests=len(lengths) + 1, max_context_len=16384, num_pages=700, page_size=page,
                                    num_layers=1, device=dev)
        junk = mgr.admit(5000)  # scramble the physical page order
        idx = LightningIndexer(cfg, seed=0, device=dev, scoring_backend=backend)
        idx.attach_cache(IndexerKeyCache.for_manager(mgr, cfg))
        reqs = [mgr.admit(n) for n in lengths]
        mgr.release(junk)
        g = torch.Generator(device="cpu").manual_seed(1)
        T = sum(lengths)
        x = torch.randn(T, cfg.hidden_size, generator=g).to(dev)
        ql = torch.randn(T, cfg.q_lora_rank, generator=g).to(dev)
        fb = build_extend_batch(mgr, reqs)
        pre = idx.index_scores(x, ql, fb.positions, fb, 0)
        sel_pre = idx.select(pre, fb.positions)
        qk = idx.prepare(x, ql, fb.positions)  # the magnitude of each logit's terms: the scores with |w|
        magnitude = idx.logits(qk._replace(weights=qk.weights.abs()), fb, 0, pre.shape[1])
        steps = []
        for _ in range(2):
            fb = decode_step(mgr, reqs)
            xd = torch.randn(len(lengths), cfg.hidden_size, generator=g).to(dev)
            qd = torch.randn(len(lengths), cfg.q_lora_rank, generator=g).to(dev)
            steps.append(idx(xd, qd, fb.positions, fb, 0))
        runs[backend] = (pre, sel_pre, steps, idx, mgr, reqs, magnitude)
    (pre_t, sel_t, steps_t, *_, mag_t), (pre_k, sel_k, steps_k, idx, mgr, reqs, _) = runs["torch"], runs["triton"]
    bounds = torch.cat([torch.arange(1, n + 1) for n in lengths]).to(dev)
    compare_logits("prefill scores, Triton vs torch", pre_k, pre_t, bounds, magnitude=mag_t)
    overlap = selection_overlap(sel_k, sel_t)
    print(f"  prefill top-{cfg.index_topk}: mean fraction of the torch path's selection also selected by the Triton "
          f"path {overlap:.5f}", flush=True)
    if overlap < 0.99:
        FAILURES.append("prefill selection overlap")
    for i, (sk, st) in enumerate(zip(steps_k, steps_t, strict=True)):
        same = selection_overlap(sk, st)
        print(f"  decode step {i}: selection Triton vs torch, identical fraction {same:.5f}", flush=True)
        if same < 0.99:
            FAILURES.append(f"decode step {i} selection")
    if dev.type != "cuda":
        return
    # CUDA graph: capture the decode forward (no host sync allowed inside), replay, compare
    fb = decode_step(mgr, reqs)
    g = torch.Generator(device="cpu").manual_seed(2)
    xd = torch.randn(len(lengths), cfg.hidden_size, generator=g).to(dev)
    qd = torch.randn(len(lengths), cfg.q_lora_rank, generator=g).to(dev)
    try:
        eager = idx(xd, qd, fb.positions, fb, 0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            idx(xd, qd, fb.positions, fb, 0)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = idx(xd, qd, fb.positions, fb, 0)
        graph.replay()
        torch.cuda.synchronize()
        ok = torch.equal(captured, eager)
        print(f"  {'ok  ' if ok else 'FAIL'} decode forward captured in a CUDA graph, replay == eager: {ok}",
              flush=True)
        if not ok:
            FAILURES.append("graph replay differs")
    except Exception as e:
        FAILURES.append(f"graph capture: {type(e).__name__}")
        print(f"  FAIL graph capture: {type(e).__name__}: {str(e)[:800]}", flush=True)


def timings(quick: bool, sweep: bool) -> list[dict]:
    dev = DEV
    timer = Timer(dev, reps=30 if quick else 60)
    copy_bw = copy_bandwidth(dev, timer)
    print(f"== timings (copy bandwidth {copy_bw:.2f} TB/s, L2 cold, CUDA-graph replay, median)", flush=True)
    rows = []

    def row(op, shape, knobs, us, nbytes, mode, extra=""):
        tbps = nbytes / (us * 1e-6) / 1e12
        floor = nbytes / (copy_bw * 1e12) * 1e6
        rows.append(dict(op=op, shape=shape, knobs=knobs, us=us, tbps=tbps, pct=100 * tbps / copy_bw, floor=floor,
                         mode=mode, extra=extra))
        print(f"  {op:<16} {shape:<16} {knobs:<34} {us:9.1f} us  {tbps:5.2f} TB/s  {100 * tbps / copy_bw:5.1f}% "
              f"floor {floor:7.1f} us  {mode} {extra}", flush=True)

    def time_logits(bs, ctx, knobs, op="logits", tokens_per_req=1):
        inp = make_dsa_logits_inputs(bs, ctx, dev, tokens_per_req=tokens_per_req)
        T = inp["q"].shape[0]
        out = torch.empty(T, ctx, dtype=torch.float32, device=dev)
        fn = partial(paged_indexer_logits, **inp, fill_tail=False, out=out, **knobs)
        try:
            us = timer.cold([fn])
        except Exception as e:
            print(f"  {op:<16} bs={bs} ctx={ctx} {knobs}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
            return None
        nbytes = bs * ctx * 132 + T * ctx * 4
        qb = knobs.get("queries_per_program") or (4 if tokens_per_req >= 4 and knobs.get("variant") != "tma" else 1)
        tiles = knobs.get("tiles") or plan_tiles(-(-T // qb), ctx, dev, knobs.get("block_t", 64))
        label = ",".join(f"{k}={v}" for k, v in knobs.items() if k != "tiles") or "default"
        row(op, f"{bs}x{ctx}" if tokens_per_req == 1 else f"T={T}x{ctx}", f"tiles={tiles} {label}", us, nbytes,
            timer.mode)
        return us

    if sweep:
        print("-- launch-knob sweep at bs=64, 64K decode", flush=True)
        for variant in ("pointer", "tma"):
            for tiles in (16, 32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        time_logits(64, 65536, dict(tiles=tiles, num_warps=warps, num_stages=stages, variant=variant),
                                    op="sweep")
        for tiles in (16, 32):
            time_logits(64, 65536, dict(tiles=tiles, block_t=128), op="sweep")
    print("-- main shapes (default knobs)", flush=True)
    shapes = [(64, 65536), (64, 16384), (8, 65536), (1, 65536), (1, 4096), (64, 131072), (32, 65536)]
    for bs, ctx in shapes[:4] if quick else shapes:
        time_logits(bs, ctx, {})
        if torch.cuda.get_device_capability() >= (9, 0) and not quick:
            time_logits(bs, ctx, dict(variant="tma"))
    # logits + top-2048 at bs=64, 64K
    inp = make_dsa_logits_inputs(64, 65536, dev)
    out = torch.empty(64, 65536, dtype=torch.float32, device=dev)
    ids = torch.empty(64, 2048, dtype=torch.int32, device=dev)
    for variant, knobs in (("pointer", {}), ("tma", dict(tiles=64, num_stages=2))):
        def both(variant=variant, knobs=knobs, inp=inp, out=out, ids=ids):
            paged_indexer_logits(**inp, fill_tail=False, out=out, variant=variant, **knobs)
            return topk(out, 2048, inp["bounds"], order="index", width=2048, out=ids)
        try:
            us = timer.cold([both])
            row("logits+top2048", "64x65536", variant, us, 64 * 65536 * 136 + 64 * 65536 * 4, timer.mode)
        except Exception as e:
            print(f"  logits+top2048 {variant}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
    us = timer.cold([partial(topk, out, 2048, inp["bounds"], order="index", width=2048, out=ids)])
    row("top2048 alone", "64x65536", "-", us, 64 * 65536 * 4, timer.mode)
    ref_timer = Timer(dev, reps=5)
    small = make_dsa_logits_inputs(64, 16384, dev)
    us = ref_timer.cold([partial(paged_indexer_logits_reference, **small)])
    row("torch reference", "64x16384", "gather+fp32 bmm", us, 64 * 16384 * 136, ref_timer.mode)
    del inp, out, small
    # prefill: 8192 query tokens, a causal last chunk of 64K keys
    for knobs in ({}, dict(queries_per_program=1), dict(queries_per_program=2), dict(queries_per_program=4, tiles=32),
                  dict(queries_per_program=8)):
        us = time_logits(1, 65536, knobs, op="prefill", tokens_per_req=8192)
        if us:
            flops = 2 * 64 * 128 * (8192 * 65536 - 8192 * 8191 // 2)
            print(f"     prefill: {flops / us / 1e6:.0f} TFLOP/s", flush=True)
    return rows


def indexer_vs_loop() -> None:
    """The batched decode forward vs the per-request loop at bs=64, 32K (wall clock, synced)."""
    import sparse_ref.bench as bench

    dev = DEV
    timer = Timer(dev, reps=20)
    r = bench._bench_dsa_indexer(dev, timer, float("nan"), False, False)[0]
    print(f"  batched indexer {r['ours_us']:.1f} us ({r['ours_timing']}; eager {r['ours_eager_us']:.1f} us) vs loop "
          f"{r['torch_us']:.1f} us: x{r['speedup']:.1f}; parts {r['parts_us']}", flush=True)
    for key in ("identical_to_loop", "torch_batched_identical_to_loop",
                "torch_batched_agrees_with_loop_up_to_ties_1e-5", "ours_agrees_with_loop_up_to_ties_1e-3"):
        print(f"  {key}: {r[key]}", flush=True)
    if not (r["ours_agrees_with_loop_up_to_ties_1e-3"] and r["torch_batched_agrees_with_loop_up_to_ties_1e-5"]):
        FAILURES.append("batched selection differs from the loop beyond near-ties")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    if sparse_ref.default_device().type != "cuda":
        print("gpu_dsa.py needs a CUDA GPU.")
        return 2
    import triton

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    t0 = time.time()
    check_kernel(args.quick)
    check_indexer(args.quick)
    print(f"correctness: {'FAILED: ' + '; '.join(FAILURES) if FAILURES else 'all passed'} "
          f"({time.time() - t0:.0f} s)", flush=True)
    rows = timings(args.quick, not args.no_sweep)
    print("== batched indexer vs per-request loop (bs=64 decode, 32K, DeepSeek shapes)", flush=True)
    indexer_vs_loop()
    sweep = [r for r in rows if r["op"] == "sweep"]
    if sweep:
        best = sorted(sweep, key=lambda r: r["us"])[:5]
        print("\nbest knobs at bs=64, 64K:")
        for r in best:
            print(f"  {r['knobs']:<40} {r['us']:8.1f} us  {r['pct']:5.1f}% of copy")
    print(f"\n{'op':<16}{'shape':<16}{'knobs':<36}{'us':>9}{'TB/s':>7}{'%copy':>7}{'floor us':>10}")
    for r in rows:
        if r["op"] != "sweep":
            print(f"{r['op']:<16}{r['shape']:<16}{r['knobs']:<36}{r['us']:>9.1f}{r['tbps']:>7.2f}{r['pct']:>7.1f}"
                  f"{r['floor']:>10.1f}")
    print(f"\ncorrectness: {'FAILED: ' + '; '.join(FAILURES) if FAILURES else 'all passed'}; total "
          f"{time.time() - t0:.0f} s")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
