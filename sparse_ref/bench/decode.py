"""Suite ``decode``: the paged decode attention kernel, and the sparse decode step against the dense one.

(a) The kernel (``sparse_ref.kernels.decode_attention``) at bs=64, 32 q / 8 KV heads, D=128, bf16 K/V,
32K context, page 16, and at bs=1 MHA (32 heads), against the copy bandwidth (bytes = K + V read
once) and the torch reference. (b) The sparse decode step (Quest scores + selection + the page table
+ sparse attention, one CUDA graph) against the dense step (the same kernel over every page), at bs=1
MHA 32K and 128K and bs=64 GQA 32K, budget 2048 tokens, with fp32 and bf16 Quest bounds; each row
gives the speedup, the byte-limit speedup (dense bytes / sparse bytes), the time of each part and
whether the Triton page table equals the torch adaptor's. Both parts also time what a user would pick for
dense decode: torch SDPA on contiguous K/V of the same shape (``sdpa_baseline``: the cuDNN backend where
it runs, else the first of flash, memory-efficient and math that does), in the ``sdpa_*`` fields.
"""

from __future__ import annotations

from functools import partial

import torch

from sparse_ref.bench.decode_setup import decode_step_setup
from sparse_ref.bench.timing import eager_cold, row


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



SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def sdpa_baseline(timer, bs, h_q, h_kv, d, ctx, device) -> dict:
    """Dense decode by ``torch.nn.functional.scaled_dot_product_attention`` on contiguous bf16 K/V
    ``[bs, h_kv, ctx, d]`` (one query token per request, GQA by ``enable_gqa``): the first backend of
    ``SDPA_BACKENDS`` that runs, timed like every row (L2 cold, a graph replay where capturable). Returns
    the ``sdpa_*`` fields of a row."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(bs, h_q, 1, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(bs, h_kv, ctx, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(bs, h_kv, ctx, d, device=device, dtype=torch.bfloat16)
    call = partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=h_q != h_kv)
    tried = {}
    for name in SDPA_BACKENDS:
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):  # (the capture inside the timer runs under it too)
                t = timer.cold([call])
            return dict(sdpa_us=round(t, 2), sdpa_backend=name, sdpa_timing=timer.mode, sdpa_layout=(
                "contiguous [bs, h_kv, ctx, d] bf16 K/V, q [bs, h_q, 1, d] bf16"), sdpa_not_run=tried)
        except RuntimeError as e:  # this backend does not run this shape here: the next one
            tried[name] = str(e).split("\n")[0][:120]
    return dict(sdpa_us=None, sdpa_backend=None, sdpa_not_run=tried)


def bench_decode(device, timer, copy_bw, quick, on_cpu):
    """(a) the dense decode attention kernel against the copy bandwidth and the torch reference;
    (b) the sparse decode step (one CUDA graph) against the dense step, with fp32 and bf16 Quest bounds."""
    from sparse_ref.attention import sparse_decode_attention
    from sparse_ref.kernels.decode_attention import paged_decode_attention

    rows = []
    # (a) the dense kernel: bs=64 GQA (the 80%-of-copy target) and bs=1 MHA (the baseline of the bs=1 step rows);
    # without --quick also bs=1 128K, bs=8 64K and bs=64 2K.
    # Timed first, on freshly allocated inputs, before the torch reference runs (its tens of GB of temporaries
    # come after).
    if on_cpu:
        dense_shapes = [(2, 4, 2, 16, 200, 4, 80), (1, 4, 4, 16, 200, 4, None)]
    else:
        dense_shapes = [(64, 32, 8, 128, 32768, 16, 80), (1, 32, 32, 128, 32768, 16, None)]
        if not quick:  # the other shapes a server runs, each beside cuDNN: a long batch-1 row, bs=8, short rows
            dense_shapes += [(1, 32, 32, 128, 131072, 16, None), (8, 32, 8, 128, 65536, 16, None),
                             (64, 32, 8, 128, 2048, 16, None)]
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
        t_torch = eager_cold(timer, partial(sparse_decode_attention, q, k, v, table, kv_lens, P), reps=5)
        sdpa = sdpa_baseline(timer, bs, h_q, h_kv, d, ctx, device)
        rows.append(row(f"bs={bs} Hq={h_q} Hkv={h_kv} D={d} ctx={ctx} P={P} bf16", None, "randn", "cold", t_torch,
                        t_ours, nbytes, copy_bw, "decode_attn", baseline="sparse_decode_attention (torch reference)",
                        torch_timing="eager (it syncs for its checks)", ours_timing=m_ours, max_abs_err=max_abs_err,
                        bytes_note="K + V of every token read once", target_pct_copy_bw=target, **sdpa))
        del q, k, v, table, kv_lens, out, got
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # (b) sparse step vs dense step, one kernel
    if on_cpu:
        shapes = [(1, 4, 4, 16, 256, 4, 32, None), (2, 4, 2, 16, 256, 4, 32, None)]
    else:
        shapes = [(1, 32, 32, 128, 32768, 16, 2048, 4.0), (1, 32, 32, 128, 131072, 16, 2048, 8.0),
                  (64, 32, 8, 128, 32768, 16, 2048, 6.0)]
    for bs, h_q, h_kv, d, ctx, P, budget, target in shapes:
        sdpa = sdpa_baseline(timer, bs, h_q, h_kv, d, ctx, device)  # the dense step a user would pick
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for bounds_dtype in (torch.float32, torch.bfloat16):
            s = decode_step_setup(bs, h_q, h_kv, d, ctx, P, budget, bounds_dtype, device)
            s.sparse_step()
            s.dense_step()
            ref = sparse_decode_attention(s.q, s.k, s.v, s.meta[0], s.meta[1], P)
            max_abs_err = float((s.out_sparse - ref).abs().max())
            kept_tokens = int(s.meta[1].max())
            sel = s.retrieve()
            torch_meta = s.adaptor(*sel, backend=None)  # None: the adaptor's torch
            torch_meta = tuple(t.clone() for t in torch_meta)
            triton_meta = tuple(t.clone() for t in s.adaptor(*sel))
            fused = s.retrieve_table()  # the step's own path (selection + table in one launch on CUDA)
            page_table_exact = all(bool(torch.equal(a, b)) for a, b in zip((*torch_meta, *sel, *torch_meta),
                                                                           (*triton_meta, *fused), strict=True))
            t_dense = timer.cold([s.dense_step])  # both steps at the default launch knobs
            m_dense = timer.mode
            t_sparse = timer.cold([s.sparse_step])
            m_sparse = timer.mode
            parts = {"retrieve + page table (the step's; fused on CUDA)": timer.cold([s.retrieve_table]),
                     "retrieve (scores + selection)": timer.cold([s.retrieve]),
                     "retrieve: scores (one launch)": timer.cold([s.scores]),
                     "page table (one launch on CUDA)": timer.cold([partial(s.adaptor, *sel)]),
                     "sparse attention": timer.cold([s.sparse_attention])}
            s.sparse_step()  # leave the step's own outputs in meta / out_sparse
            ceiling = s.dense_bytes / s.sparse_bytes
            shape = f"bs={bs} Hq={h_q} Hkv={h_kv} ctx={ctx} budget={budget} {str(bounds_dtype)[6:]} bounds"
            rows.append(row(shape, None, "planted", "cold", t_dense, t_sparse, s.sparse_bytes, copy_bw,
                            "sparse_step", baseline="dense step: the same kernel over every page (table prebuilt)",
                            torch_timing=m_dense, ours_timing=m_sparse, dense_bytes=int(s.dense_bytes),
                            byte_limit_speedup=round(ceiling, 2), target_speedup=target,
                            parts_us={k_: round(v_, 2) for k_, v_ in parts.items()}, kept_tokens=kept_tokens,
                            max_abs_err_vs_reference=max_abs_err, page_table_equals_torch=page_table_exact,
                            bytes_note="sparse: min+max bounds of every page + K/V of the kept tokens; "
                                        "dense: K/V of every token", **sdpa,
                            speedup_vs_sdpa=round(sdpa["sdpa_us"] / t_sparse, 2) if sdpa["sdpa_us"] else None))
            print(f"    torch SDPA ({sdpa['sdpa_backend']}, contiguous K/V): {sdpa['sdpa_us']} us; "
                  f"byte-limit speedup {ceiling:.2f}x, target {target}x; page table == torch: {page_table_exact}; "
                  "parts " + ", ".join(f"{k_} {v_:.1f} us" for k_, v_ in parts.items()), flush=True)
            del s, ref, sel
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows
