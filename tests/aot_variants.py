"""Ahead-of-time compile variants of every launched kernel, at the shapes the GPU runs (``test_aot_compile.py``).

Triton's interpreter accepts code the compiler refuses, so CI compiles each kernel for sm_90 without a
GPU. Each entry is ``(kernel, signature, constexprs, options)``: the constexpr variants a launcher
picks at the benchmark and decode-step shapes (a representative subset where there are many). Every
module-level ``triton.JITFunction`` named ``*_kernel`` in ``sparse_ref.kernels`` must appear here.
"""

import torch

from sparse_ref.kernels import decode_attention, dsa, page_select, page_table, quest, quest_bounds, swap_in
from sparse_ref.kernels.topk import candidates, select, sort, threshold
from sparse_ref.kernels.topk import rows as topk_rows
from sparse_ref.offload import READY_CHUNK


def aot_variant(kernel, constexprs, options=None, **types):
    """One ahead-of-time compile variant: every argument not named in
    ``types`` or ``constexprs`` is an i32 scalar. A kernel with the ``PDL`` switch compiles with it on
    (as a Hopper GPU runs it; off only removes code)."""
    if "PDL" in kernel.arg_names:
        constexprs = {"PDL": True, **constexprs}
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in kernel.arg_names}
    return (kernel, sig, constexprs, options or {"num_warps": 8})


AOT_PTRS = dict(scores="*fp32", out="*i32")
# k an int and every row full; one k and one length per row (k: a pointer, lengths: None or a pointer)
AOT_ROWS = [(dict(k="i32"), dict(lengths=None)), (dict(k="*i32", lengths="*i64"), {})]


# ----------------------------------------------------------------------------- the top-k
TOPK = [  # the short rows: 8192 columns at k = 2048 (direct, 16 warps), k = 128 (delegates); bf16, rounds only
    *[aot_variant(topk_rows.short_row_kernel, dict(**rc, N_PAD=8192, G=g, SLOTS=g, PAIR=pr, BLOCK_OUT=b, DIRECT=d,
                                                   ALL=False),
                  {"num_warps": nw}, scratch="*i32", flags="*i32", **rt, **AOT_PTRS)
      for (rt, rc), g, b, pr, d, nw in zip(AOT_ROWS, (4096, 256), (1024, 128), (512, 128), (128, 0), (16, 8),
                                           strict=True)],
    aot_variant(topk_rows.short_row_kernel, dict(lengths=None, N_PAD=1024, G=256, SLOTS=256, PAIR=0, BLOCK_OUT=16,
                                                 DIRECT=1, ALL=False), {"num_warps": 8}, scratch="*i32", flags="*i32",
                k="i32", **{**AOT_PTRS, "scores": "*bf16"}),
    aot_variant(topk_rows.short_row_kernel, dict(lengths=None, N_PAD=2048, G=2048, SLOTS=2048, PAIR=256,  # k = N
                                                 BLOCK_OUT=1024, DIRECT=128, ALL=True), {"num_warps": 8},
                scratch="*i32", flags="*i32", k="i32", **AOT_PTRS),
]
TOPK += [  # 64 x 64K and 8 x 128K at k = 2048 (LOCAL); 1 x 128K (the row's merged histogram)
    *[aot_variant(threshold.delegates_kernel, dict(**rc, G=g, COLS=1024, ROWS=8, LOG_C=c, LOCAL=lc),
                  {"num_warps": nw}, work="*i32", sync="*i32", **rt, **AOT_PTRS)
      for (rt, rc), g, c, nw, lc in zip(AOT_ROWS * 2, (4096, 8192) * 2, (4, 7) * 2, (16, 8) * 2,
                                        (True, True, False, False), strict=True)],
    aot_variant(threshold.delegates_kernel,  # 128 x 128K
                dict(lengths=None, G=4096, COLS=2048, ROWS=4, LOG_C=6, LOCAL=True), work="*i32", sync="*i32", k="i32",
                **AOT_PTRS),
]
TOPK += [
    *[aot_variant(candidates.candidates_kernel, dict(**rc, G=g, CHUNK=ch, SLOTS=g, LOG_C=c, BITMASK=bm, REVERSE=rv),
                  {"num_warps": nw}, cand="*i32", runs="*i64", work="*i32", sync="*i32", **rt, **AOT_PTRS)
      for (rt, rc), g, ch, c, nw, rv, bm in zip(AOT_ROWS * 2, (4096, 8192, 4096, 4096), (2048, 1024, 8192, 4096),
                                                (5, 7, 3, 5), (4, 8, 16, 8), (True, False, True, False),
                                                (True, False, False, True), strict=True)],
    *[aot_variant(select.select_kernel, dict(**rc, G=g, CHUNK=ch, SLOTS=g, LOG_C=c, BITMASK=bm, PAIR=pr, SPAN=sp,
                                       TILE=tl_), {"num_warps": nw}, cand="*i32", runs="*i64", work="*i32",
                  sync="*i32", **rt, **AOT_PTRS)
      for (rt, rc), g, ch, c, nw, pr, sp, tl_, bm in zip(AOT_ROWS * 2, (4096, 8192, 4096, 4096),
                                                         (2048, 1024, 8192, 4096), (5, 7, 3, 5), (16, 8, 16, 16),
                                                         (0, 128, 128, 128), (16384, 2048, 65536, 8192),
                                                         (8192, 2048, 8192, 8192), (True, False, True, False),
                                                         strict=True)],
]
TOPK += [
    aot_variant(select.whole_row_kernel, dict(**rc, BLOCK=1024), **rt, **AOT_PTRS) for rt, rc in AOT_ROWS]
TOPK += [
    aot_variant(sort.sort_runs_kernel, dict(RUN=2048, W_PAD=2048), {"num_warps": 16}, scores="*fp32", out="*i32",
                runs="*i32"),  # one tile a row: the ids back into out
    *[aot_variant(sort.sort_runs_kernel, dict(RUN=run, W_PAD=2048), {"num_warps": 4}, scores="*fp32", out="*i32",
                  runs="*i64") for run in (256, 512)],
    *[aot_variant(sort.merge_runs_kernel, dict(RUN=run, W_PAD=2048), {"num_warps": 4}, runs="*i64", out="*i32")
      for run in (256, 512)],
]


# ----------------------------------------------------------------------------- page selection
# the decode-step shapes (k ~ 128: 2048 pages direct, 8 warps; 8192 pages by delegates, 8 warps)
_SELECT_SIG = {"scores": "*fp32", "selected": "*i32", "lengths": "*i32", "seq_lens": "*i64", "sparse_mask": "*i1",
               "budget": "*i32", "scratch": "*i32", "sizes": ("i32",) * 3, "rules": ("i32",) * 4}
_TABLE_SIG = {**{k: v for k, v in _SELECT_SIG.items() if k not in ("sizes", "rules")}, "rows": "*i64",
              "req_to_token": "*i32", "page_table": "*i32", "kv_lens": "*i32", "cu_kv_lens": "*i32",
              "sizes": ("i32",) * 6, "rules": ("i32",) * 4}
PAGE_SELECT = [
    (page_select._page_select_kernel, _SELECT_SIG,
     {"N_PAD": n_pad, "G": 256, "SLOTS": 512, "PAIR": pr, "BLOCK_OUT": 256, "DIRECT": d}, {"num_warps": 8})
    for n_pad, pr, d in ((2048, page_select.PAGE_PAIR, 1), (8192, 128, 0))
] + [
    (page_select._select_to_table_kernel, _TABLE_SIG,
     {"N_PAD": n_pad, "G": 256, "SLOTS": 512, "PAIR": pr, "BLOCK_OUT": 256, "BLOCK_T": 1024, "DIRECT": d,
      "PDL": True}, {"num_warps": 8})
    for n_pad, pr, d in ((2048, page_select.PAGE_PAIR, 1), (8192, 128, 0))
]


# ----------------------------------------------------------------------------- page table
def _page_table_variants():
    variants = []
    for sel, lens, seq, rows in (("*i32", "*i32", "*i32", "*i32"), ("*i32", "*i32", "*i64", "*i64"),
                                 ("*i64", "*i64", "*i64", "*i64")):
        sig = {"selected_ptr": sel, "lengths_ptr": lens, "mask_ptr": "*u8", "seq_lens_ptr": seq, "rows_ptr": rows,
               "req_to_token_ptr": "*i32", "page_table_ptr": "*i32", "kv_lens_ptr": "*i32", "cu_kv_lens_ptr": "*i32",
               "bs": "i32", "width": "i32", "out_width": "i32", "r2t_rows": "i32", "r2t_width": "i32",
               "page_size": "i32", "BLOCK_W": "constexpr", "BLOCK_B": "constexpr"}
        for block_w in (128, 1024):
            variants.append((page_table._page_table_kernel, sig, {"BLOCK_W": block_w, "BLOCK_B": 1024},
                             {"num_warps": 4}))
    return variants


PAGE_TABLE = _page_table_variants()


# ----------------------------------------------------------------------------- Quest scores: the default blocks
QUEST = [
    (quest._quest_scores_from_queries_kernel,
     {"q_ptr": q_dtype, "page_min_ptr": dtype, "page_max_ptr": dtype, "valid_ptr": "*u8", "req_to_token_ptr": "*i32",
      "rows_ptr": "*i64", "out_ptr": "*fp32", "max_pages": "i32", "num_pages": "i32", "HD": "i32", "head_dim": "i32",
      "r2t_rows": "i32", "r2t_width": "i32", "page_size": "i32", "GROUP": "constexpr", "MEAN": "constexpr",
      "BLOCK_P": "constexpr", "BLOCK_HD": "constexpr"},
     {"GROUP": group, "MEAN": mean, "BLOCK_P": block_p, "BLOCK_HD": 4096 // block_p, "PDL": True}, {"num_warps": 4})
    for q_dtype in ("*fp32", "*bf16") for dtype in ("*fp32", "*bf16") for group, mean in ((1, True), (4, True),
                                                                                     (4, False))
    for block_p in ((16, 8, 4, 2) if (q_dtype, dtype, group) == ("*fp32", "*bf16", 1) else (16, 4))  # (bs=1: all)
]


# ----------------------------------------------------------------------------- Quest bounds update
QUEST_BOUNDS = [  # page 16, D = 128 (the engine step's shape), decode and prefill, each bounds dtype and K dtype
    (quest_bounds._page_bounds_kernel,
     {"k_ptr": k_dtype, "min_ptr": b_dtype, "max_ptr": b_dtype, "valid_ptr": "*u8", "req_to_token_ptr": "*i32",
      "rows_ptr": "*i64", "seq_lens_ptr": "*i64", "prefix_ptr": "*i64", "dims": ("i32",) * 5,
      "P": "constexpr", "D": "constexpr", "BLOCK_P": "constexpr", "BLOCK_D": "constexpr", "DECODE": "constexpr",
      "OUT": "constexpr"},
     {"P": 16, "D": 128, "BLOCK_P": 16, "BLOCK_D": 128, "DECODE": decode, "OUT": out}, {"num_warps": 4})
    for k_dtype in ("*bf16", "*fp32") for b_dtype, out in (("*fp32", 0), ("*bf16", 1), ("*fp16", 2))
    for decode in (True, False)
]


# ----------------------------------------------------------------------------- paged decode attention
_TRITON_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def _split_signature(q_dtype, kv_dtype, constexprs):
    sig = {"q_ptr": _TRITON_TYPES[q_dtype], "k_ptr": _TRITON_TYPES[kv_dtype], "v_ptr": _TRITON_TYPES[kv_dtype],
           "page_table_ptr": "*i32", "kv_lens_ptr": "*i32", "ready_ptr": "*i32", "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32", "sm_scale": "fp32", "dims": ("i32",) * 7}
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def _decode_attention_variants():
    variants = []
    for q_dtype, kv_dtype, group, head_dim in [
        (torch.float32, torch.bfloat16, 4, 128), (torch.float32, torch.bfloat16, 1, 128),
        (torch.float32, torch.bfloat16, 8, 128), (torch.float32, torch.float16, 4, 128),
        (torch.float32, torch.float32, 4, 128), (torch.float32, torch.float32, 1, 128),
        (torch.bfloat16, torch.bfloat16, 4, 128), (torch.float32, torch.bfloat16, 4, 64),
        (torch.float16, torch.float16, 1, 64),
    ]:
        for precise in (True, False) if kv_dtype == torch.bfloat16 and group == 4 else (True,):
            for split_len in (0, 1 << 15):  # short splits and long ones (the long-split tile)
                cfg = decode_attention.launch_config(group, head_dim, kv_dtype, False, precise=precise,
                                                     split_len=split_len)
                # waiting on the offload's flags: the offload's shapes (bf16 K/V, GQA 4 and MHA, D = 128)
                for wait in (False, True) if (kv_dtype, head_dim) == (torch.bfloat16, 128) and precise else (False,):
                    ce = {**cfg["constexprs"], "WAIT": wait, "PDL": True}
                    variant = (decode_attention._decode_split_kernel, _split_signature(q_dtype, kv_dtype, ce), ce,
                               cfg["options"])
                    if variant not in variants:
                        variants.append(variant)
    for group in (4, 1):  # the broadcast path (use_dot=False) for a GQA group and for MHA
        cfg = decode_attention.launch_config(group, 128, torch.bfloat16, False, use_dot=False)
        ce = {**cfg["constexprs"], "WAIT": False, "PDL": False}  # (PDL off: the plain launch)
        variants.append((decode_attention._decode_split_kernel, _split_signature(torch.float32, torch.bfloat16, ce),
                         ce, {"num_warps": 4}))
    for head_dim, block_s in ((128, 2), (128, 4), (128, 8), (128, 16), (128, 32), (128, 64), (64, 32)):
        ce = dict(HEAD_DIM=head_dim, BLOCK_S=block_s, BLOCK_D=head_dim, PDL=block_s != 2)
        sig = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*fp32", "num_splits": "i32",
               **{name: "constexpr" for name in ce}}
        variants.append((decode_attention._decode_merge_kernel, sig, ce, {"num_warps": 4}))
    return variants


DECODE_ATTENTION = _decode_attention_variants()


# ----------------------------------------------------------------------------- DSA indexer logits
def _aot(page, d, h, tiles, fp8=True, fill_tail=True, block_t=dsa.BLOCK_T, runtime_loop=True, num_warps=4,
         num_stages=3):
    dt = "*fp8e4nv" if fp8 else "*fp32"
    block_h, block_d = dsa._block_sizes(h, d)
    stride_k = page * (d + 4) if fp8 else page * d
    stride_s = stride_k // 4 if fp8 else page
    sig = {"q_ptr": dt, "w_ptr": "*fp32", "keys_ptr": dt, "scales_ptr": "*fp32", "block_table_ptr": "*i32",
           "token_req_ptr": "*i32", "bounds_ptr": "*i32", "out_ptr": "*fp32", "dims": ("i32",) * 5}
    const = dict(PAGE=page, D=d, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_T=block_t, TILES=tiles,
                 PAGE_STRIDE_K=stride_k, PAGE_STRIDE_S=stride_s, FILL_TAIL=fill_tail, RUNTIME_LOOP=runtime_loop)
    return (dsa._indexer_logits_kernel, sig, const, {"num_warps": num_warps, "num_stages": num_stages})


def _aot_multiq(page, d, h, tiles, qb, fill_tail=False, runtime_loop=True, num_warps=4, fp8=True):
    kernel, sig, const, opts = _aot(page, d, h, tiles, fill_tail=fill_tail, runtime_loop=runtime_loop,
                                    num_warps=num_warps, fp8=fp8)
    sig = {**sig, "dims": ("i32",) * 6}
    return (dsa._indexer_logits_multiq_kernel, sig, {**const, "QB": qb}, opts)


# DeepSeek's shape (page 64, D=128, 64 heads) at every tile count the planner picks, both tail modes,
# small pages (per-row gather), the full-precision cache, and the multi-query
# program (the extend default, 4 queries per program) in both tail modes.
DSA = (
    [_aot(64, 128, 64, tiles) for tiles in (1, 2, 4, 8, 16, 32, 64)]
    + [_aot(64, 128, 64, 16, fill_tail=False), _aot(64, 128, 64, 16, num_warps=8, num_stages=2),
       _aot(16, 128, 64, 8), _aot(64, 64, 8, 4, fp8=False), _aot(16, 32, 4, 2, runtime_loop=False)]
    + [_aot_multiq(64, 128, 64, tiles, 4) for tiles in (4, 16, 64)]
    + [_aot_multiq(64, 128, 64, 64, 4, fill_tail=True), _aot_multiq(64, 128, 64, 64, 2),
       _aot_multiq(64, 64, 8, 4, 4, fill_tail=True, fp8=False), _aot_multiq(16, 32, 4, 2, 2, runtime_loop=False)]
)


# the offload swap-in: DSA's top-2048 in a 4096-slot buffer (bf16 K/V, 8 KV heads x 128), and a small fp32 case
SWAP_IN = [aot_variant(swap_in._swap_in_kernel, dict(P=p, B=b, HD=hd, W_PAD=w, B_PAD=b, NC_PAD=nc, CHUNK=READY_CHUNK,
                                                     ROWS=swap_in.COPY_ROWS, BLOCK_D=min(hd, 1024)),
                       {"num_warps": swap_in.BOOK_WARPS},
                       selected="*i32", lengths="*i32", sparse_mask="*i1", seq_lens="*i64", rows="*i64",
                       req_to_token="*i32", host_k=f"*{dt}", host_v=f"*{dt}", hot_k=f"*{dt}", hot_v=f"*{dt}",
                       new_k="*fp32", new_v="*fp32", new_loc="*i64", token="*i32", last_used="*i32",
                       slot_of="*i32", lru="*i32", scratch="*i32", table="*i32", counts="*i32", copies="*i32",
                       clock_ptr="*i32", stats="*i64", ready="*i32")
           for p, b, hd, w, dt, nc in ((16, 4096, 1024, 2048, "bf16", 32), (1, 4096, 1024, 2048, "bf16", 32),
                                       (1, 16, 64, 32, "fp32", 1))]
SWAP_IN += [aot_variant(swap_in._copy_in_kernel, dict(HD=hd, CHUNK=READY_CHUNK,
                                                      ROWS=swap_in.COPY_ROWS, BLOCK_D=min(hd, 1024)),
                        {"num_warps": 8}, copies="*i32", table="*i32", ready="*i32", host_k=f"*{dt}",
                        host_v=f"*{dt}", hot_k=f"*{dt}", hot_v=f"*{dt}") for hd, dt in ((1024, "bf16"), (64, "fp32"))]

VARIANTS = TOPK + PAGE_SELECT + PAGE_TABLE + QUEST + QUEST_BOUNDS + DECODE_ATTENTION + DSA + SWAP_IN



# The operation of sparse_ref.backend's table each kernel module serves (the others run on every capability)
OPERATIONS = {"sparse_ref.kernels.decode_attention": "attention", "sparse_ref.kernels.dsa": "dsa_logits",
              "sparse_ref.kernels.quest": "quest_scores", "sparse_ref.kernels.quest_bounds": "update_bounds"}
POINTER_DTYPES = {torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv"}


def runs_on(kernel, signature, constexprs, capability: int) -> bool:
    """Whether the backend launches this variant on a GPU of ``capability`` (90: 9.0): not where its table sends a
    tensor of that dtype to the torch twin (``sparse_ref.backend.CAPABILITIES``: bf16 below 8.0, FP8 below 8.9)."""
    from sparse_ref.backend import CAPABILITIES

    op = OPERATIONS.get(kernel.fn.__module__)
    pointers = {v for v in signature.values() if isinstance(v, str)}
    return not any(name == op and POINTER_DTYPES[dtype] in pointers and capability < 10 * needed[0] + needed[1]
                   for name, dtype, needed, _ in CAPABILITIES)
