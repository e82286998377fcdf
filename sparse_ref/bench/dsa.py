"""Suite ``dsa``: paged FP8 indexer logits (and + top-2048) against the batched torch reference; the indexer.

Logits (``sparse_ref.kernels.dsa.paged_indexer_logits``; 64 heads, D=128, page 64, random page order)
and logits + top-2048 against the batched torch reference (gather + fp32 bmm; + ``torch.topk``) at
bs 1/8/64 x 4K..128K (quick: 1x64K, 8x64K, 64x16K, 64x64K); a few other launch knobs at the target
shapes; prefill rows (8192 query tokens, a causal last chunk of 64K keys; 4 and 1 queries per
program); the batched ``LightningIndexer`` decode step (one CUDA graph) against its per-request loop
(bs=64, 32K), with the step's parts timed alone, its eager time, and whether the selections agree
(differences allowed only at near-ties of the 2048th score). Bytes = keys + scales read once
(132 B/token) + logits written.
"""

from __future__ import annotations

from functools import partial

import torch

from sparse_ref.bench.timing import Timer, eager_cold, row, wall_clock_us


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
        rows.append(row(shape, None, "randn", "cold", t_torch, t_ours, nbytes, copy_bw, "dsa_logits",
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
        rows.append(row(shape, k, "randn", "cold", t_torch_k, t_ours_k, nbytes + bs * ctx * 4 + bs * k * 4, copy_bw,
                        "dsa_logits+topk", baseline="torch reference + torch.topk", torch_timing=base_timer.mode,
                        ours_timing=m_ours_k))
        del inp, out, want, got
    T, ctx = prefill  # a causal last chunk: T query tokens of one request over ctx keys
    inp = make_dsa_logits_inputs(1, ctx, device, heads=heads, dim=dim, tokens_per_req=T)
    out = torch.empty(T, ctx, dtype=torch.float32, device=device)
    flops = 2 * heads * dim * (T * ctx - T * (T - 1) // 2)
    t_ours = timer.cold([partial(paged_indexer_logits, **inp, fill_tail=False, out=out)])
    rows.append(row(f"prefill T={T} ctx={ctx}", None, "randn", "cold", float("nan"), t_ours,
                    ctx * (dim + 4) + T * ctx * 4, copy_bw, "dsa_prefill", ours_timing=timer.mode,
                    baseline="none (the torch reference would take seconds)", tflops=round(flops / t_ours / 1e6, 1)))
    del inp, out
    rows += _bench_dsa_indexer(device, timer, copy_bw, quick, on_cpu)
    return rows



def selections_agree(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor, k: int, tol: float) -> bool:
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
    from sparse_ref.algorithms.dsa import LightningIndexer
    from sparse_ref.batch import decode_step
    from sparse_ref.config import IndexerConfig
    from sparse_ref.memory import IndexerKeyCache, KVCacheManager

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
    idx_torch = LightningIndexer(cfg, device=device, backend="torch").attach_cache(cache)
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
             "torch_batched_agrees_with_loop_up_to_ties_1e-5": selections_agree(sel_torch, sel_loop, loop_scores, k,
                                                                                 1e-5),
             "ours_agrees_with_loop_up_to_ties_1e-3": selections_agree(sel_ours, sel_loop, loop_scores, k, 1e-3)}
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
    t_eager = eager_cold(timer, batched, 5 if on_cpu else 20) if device.type == "cuda" else float("nan")
    t_loop = wall_clock_us(loop, 3, device)
    return [row(f"decode bs={bs} ctx={ctx}", cfg.index_topk, "randn", "cold", t_loop, t_batched,
                bs * ctx * cfg.key_bytes_per_token, copy_bw, "dsa_indexer",
                baseline="index_scores_loop + select (per-request loop, wall clock, synced)",
                torch_timing="wall clock", ours_timing=m_batched, ours_eager_us=round(t_eager, 1),
                parts_us=parts_us, ours_backend=idx.backend.name, **agree)]

