"""Quest page scores in one launch, straight from the decode queries: ``score[r, j] = q+ . max[p] + q- . min[p]``.

The torch path (``sparse_ref.algorithms.quest``: ``split_query_sign``, ``physical_pages``,
``quest_page_scores_reference``) gathers every request's page bounds into new ``[bs, max_pages, H_kv*D]``
tensors and then runs ``bmm``: at bs=64 and 32K context that writes and re-reads about 1 GB, in about ten
launches. This kernel (``quest_page_scores_from_queries``, what ``QuestAlgorithm`` runs) reads each page's
bounds once, straight from the pool, and writes one fp32 score per page: it is memory bound, and its byte
floor is "the bounds of every scored page, read once". The steps before it are folded in:

* the signed query: the GQA group's mean (or, ``per_kv_head``, its per-head sum) split by sign, from the raw
  queries ``[bs, H_q, D]`` (tiny, but each torch op is a launch of a few microseconds, which at bs=1 costs
  as much as the scoring itself);
* the physical page of logical page ``j``: ``req_to_token[row, j * P] // P``, clamped into the pool.

``page_min`` / ``page_max``: ``[num_pages, H_kv, D]`` fp32 (or fp16/bf16: widened to fp32; accumulation is
always fp32), by physical page. ``page_valid``: bool ``[num_pages]``; an invalid page scores exactly
``-inf`` and its bounds are not read (masked loads).

Safety: the rows are checked eagerly (one host sync, skipped while a CUDA graph captures) and every index is
also clamped inside the kernel, so a bad value never reads outside the pools. Nothing else is read back to
the host: the launch is graph capturable.

Layout: one program scores ``BLOCK_P`` consecutive logical pages of one request; it walks the ``H_kv*D``
bound vector in ``BLOCK_HD`` chunks (masked, so any ``H_kv*D`` works), keeps a ``[BLOCK_P, BLOCK_HD]`` fp32
accumulator and reduces it once at the end. ``H_kv*D`` is a runtime argument, not a constexpr: one compiled
kernel serves every model shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import (
    check_choice,
    check_int,
    check_kernel_device,
    check_quest_bounds_pool,
    check_range,
    check_same_device,
    check_tensor,
    fail,
)
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import Knob, Knobs, after_previous_launch, pdl_options


@triton.jit
def _bound_terms(page_min_ptr, page_max_ptr, base, d, read, in_hd, qp, qn):
    """``[BLOCK_P, BLOCK_HD]`` terms ``max * q+ + min * q-`` of the bound values ``d`` of the pages at ``base``;
    the bounds are streamed once (evict first) and widened to fp32."""
    m = read[:, None] & in_hd[None, :]
    offs = base[:, None] + d[None, :]
    mx = tl.load(page_max_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    mn = tl.load(page_min_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    return mx * qp[None, :] + mn * qn[None, :]


@triton.jit
def _quest_scores_from_queries_kernel(q_ptr, page_min_ptr, page_max_ptr, valid_ptr, req_to_token_ptr, rows_ptr,
                                      out_ptr, max_pages, num_pages, HD, head_dim, r2t_rows, r2t_width, page_size,
                                      GROUP: tl.constexpr, MEAN: tl.constexpr,
                                      BLOCK_P: tl.constexpr, BLOCK_HD: tl.constexpr, PDL: tl.constexpr):
    """One program = BLOCK_P pages of one request: streams their min/max bounds once, BLOCK_HD values a step.

    The physical page of logical page ``j`` is read from ``req_to_token[row, j * P] // P``
    (``QuestAlgorithm.physical_pages``) and the signed query from the raw queries
    ``[bs, H_q, D]`` (``split_query_sign``: the GQA group's mean, or its per-head sum, split by sign).
    PDL: placed while the launch before it finishes; the selection launch after it likewise.
    """
    after_previous_launch(PDL)
    r = tl.program_id(1).to(tl.int64)
    req = tl.load(rows_ptr + r).to(tl.int64)
    req = tl.minimum(tl.maximum(req, 0), r2t_rows - 1)
    j = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_row = j < max_pages
    first_token = tl.minimum(j.to(tl.int64) * page_size, r2t_width - 1)
    slot = tl.load(req_to_token_ptr + req * r2t_width + first_token, mask=in_row, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(slot // page_size, 0), num_pages - 1)  # never read outside the pool
    valid = tl.load(valid_ptr + page, mask=in_row, other=0) != 0
    read = in_row & valid
    base = page * HD
    q_row = q_ptr + r * HD * GROUP  # this request's H_q * D query values
    acc = tl.zeros([BLOCK_P, BLOCK_HD], dtype=tl.float32)
    for start in range(0, HD, BLOCK_HD):
        d = start + tl.arange(0, BLOCK_HD)
        in_hd = d < HD
        q_offs = (d // head_dim) * GROUP * head_dim + d % head_dim  # query head kvh * GROUP + g, element d % D
        if MEAN:
            q = tl.zeros([BLOCK_HD], dtype=tl.float32)
            for g in tl.static_range(GROUP):
                q += tl.load(q_row + q_offs + g * head_dim, mask=in_hd, other=0.0).to(tl.float32)
            q = q / GROUP
            qp = tl.maximum(q, 0.0)
            qn = tl.minimum(q, 0.0)
        else:
            qp = tl.zeros([BLOCK_HD], dtype=tl.float32)
            qn = tl.zeros([BLOCK_HD], dtype=tl.float32)
            for g in tl.static_range(GROUP):
                x = tl.load(q_row + q_offs + g * head_dim, mask=in_hd, other=0.0).to(tl.float32)
                qp += tl.maximum(x, 0.0)
                qn += tl.minimum(x, 0.0)
        acc += _bound_terms(page_min_ptr, page_max_ptr, base, d, read, in_hd, qp, qn)
    score = tl.sum(acc, axis=1)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + r * max_pages + j, score, mask=in_row)


PROGRAMS_PER_SM = 2  # the default blocks aim for at least this many programs per SM (memory latency hiding)
# Launch knobs (powers of two; None: the defaults of default_blocks). Vary them with sparse_ref.kernels.tuning.
TUNING = Knobs("quest", {
    "block_p": Knob(2, 1024, pow2=True, none=True), "block_hd": Knob(8, 8192, pow2=True, none=True),
    "num_warps": Knob(1, 32, pow2=True, none=True),
}, block_p=None, block_hd=None, num_warps=None)


def default_blocks(hd: int, bs: int, max_pages: int, device: torch.device) -> tuple[int, int]:
    """``(BLOCK_P, BLOCK_HD)``: 16 pages x 256 values per step, or fewer pages (and wider steps) when few programs.

    At bs=1 and 32K tokens (2048 pages) 16 pages per program leave 128 programs on a 132-SM H200:
    one per SM, bound by memory latency. There a program takes fewer pages and a wider slice of
    ``H_kv*D`` per step (the tile stays 4096 values), so the grid has a few programs per SM. Two
    per SM measured best on the H200 at bs=1 (32 heads, bf16 bounds): 4 pages x 1024 values at
    32K (16.5 us against 16.9 with 2 pages), 16 x 256 at 128K (42.5 against 44.0 with 8).
    """
    block_p, tile = 16, 4096
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        want = PROGRAMS_PER_SM * torch.cuda.get_device_properties(index).multi_processor_count
        while block_p > 2 and bs * triton.cdiv(max_pages, block_p) < want:
            block_p //= 2
    return block_p, min(tile // block_p, triton.next_power_of_2(max(hd, 16)))


def _block_sizes(hd: int, bs: int, max_pages: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_P, BLOCK_HD, num_warps)``: the ``TUNING`` knobs where set (ranged there), else the defaults."""
    default_p, default_hd = default_blocks(hd, bs, max_pages, device)
    pick = [TUNING[name] for name in ("block_p", "block_hd", "num_warps")]
    return tuple(d if v is None else v for v, d in zip(pick, (default_p, default_hd, 4), strict=True))


def quest_page_scores_from_queries(queries: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                                   page_valid: torch.Tensor, req_to_token: torch.Tensor,
                                   req_pool_indices: torch.Tensor, page_size: int, max_pages: int,
                                   gqa_mode: str = "mean", *, out: torch.Tensor | None = None,
                                   check_values: bool = True) -> torch.Tensor:
    """fp32 ``[bs, max_pages]`` Quest scores straight from the raw queries and ``req_to_token``, in one launch.

    Equals ``quest_page_scores_reference(*split_query_sign(queries, H_kv, D, gqa_mode), page_min, page_max,
    page_valid, pages)`` with ``pages = req_to_token[req_pool_indices, j * P] // P`` clamped into
    the pool (``QuestAlgorithm.physical_pages``), up to fp32 rounding (the sums run in another order).
    ``queries``: ``[bs, H_q, D]`` or ``[bs, H_q * D]``, fp32/bf16/fp16;
    ``gqa_mode``: "mean" or "per_kv_head".
    ``check_values=False`` skips the host-side range checks of index values when the caller has made
    them (one host sync per call, not two); the kernel still clamps every index it reads.
    """
    num_pages, hd, head_dim, group, page_size, max_pages = check_quest_scores_from_queries(
        queries, page_min, page_max, page_valid, req_to_token, req_pool_indices, page_size, max_pages, gqa_mode,
        out, check_values)
    bs = req_pool_indices.shape[0]
    r2t_rows, r2t_width = req_to_token.shape
    device = page_min.device
    block_p, block_hd, num_warps = _block_sizes(hd, bs, max_pages, device)
    if out is None:
        out = torch.empty((bs, max_pages), dtype=torch.float32, device=device)
    if bs == 0 or max_pages == 0:
        return out
    grid = (triton.cdiv(max_pages, block_p), bs)
    _quest_scores_from_queries_kernel[grid](
        queries.contiguous(), page_min, page_max, page_valid.view(torch.uint8), req_to_token.contiguous(),
        req_pool_indices.contiguous(), out, max_pages, num_pages, hd, head_dim, r2t_rows, r2t_width, page_size,
        GROUP=group, MEAN=gqa_mode == "mean", BLOCK_P=block_p, BLOCK_HD=block_hd, num_warps=num_warps,
        **pdl_options(device))
    return out


# ------------------------------ argument checks (each entry point above calls one first)
_QUEST_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_quest_scores_from_queries(queries, page_min, page_max, page_valid, req_to_token, req_pool_indices,
                                    page_size, max_pages, gqa_mode, out, check_values):
    """``(num_pages, H_kv * D, D, GQA group, page_size, max_pages)`` of ``quest_page_scores_from_queries``."""
    fn = "quest_page_scores_from_queries"
    num_pages, num_kv_heads, head_dim = check_quest_bounds_pool(page_min, page_max, page_valid)
    hd = num_kv_heads * head_dim
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, fix="pass ReqToTokenPool.req_to_token.")
    check_tensor("req_pool_indices", req_pool_indices, dtype=(torch.int32, torch.int64), dims=1,
                 fix="pass forward_batch.req_pool_indices, one row of req_to_token per request.")
    bs = req_pool_indices.shape[0]
    check_tensor("queries", queries, dtype=_QUEST_QUERY_DTYPES, dims=(2, 3), fix="pass the float decode queries.")
    if queries.dim() == 3:
        num_q_heads, head_dim_fits = queries.shape[1], queries.shape[2] == head_dim
    else:
        num_q_heads, head_dim_fits = queries.shape[1] // head_dim, queries.shape[1] % head_dim == 0
    if queries.shape[0] != bs or not head_dim_fits or num_q_heads == 0 or num_q_heads % num_kv_heads:
        fail("queries", f"[bs={bs}, H_q, {head_dim}] or [bs, H_q * {head_dim}] with H_q a multiple of the "
             f"{num_kv_heads} KV heads", f"shape {tuple(queries.shape)}",
             "pass all query heads of the layer, one decode query per request.")
    group = num_q_heads // num_kv_heads
    check_choice("gqa_mode", gqa_mode, ("mean", "per_kv_head"), "pass SparseConfig.gqa_mode.", SparseRefError)
    page_size = check_int("page_size", page_size, low=1, fix="pass the pool's page size.", error=SparseRefError)
    max_pages = check_int("max_pages", max_pages, low=0, fix="pass QuestAlgorithm.max_pages.", error=SparseRefError)
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(bs, max_pages), contiguous=True,
                     fix="pass torch.empty(bs, max_pages) in fp32.")
    check_kernel_device(f"{fn}: page_min", page_min, "move the pools and queries to the GPU, or use the torch "
                        "scoring backend.")
    check_same_device(fn, "page_min", {"page_min": page_min, "queries": queries, "page_max": page_max,
                                       "page_valid": page_valid, "req_to_token": req_to_token,
                                       "req_pool_indices": req_pool_indices, "out": out})
    r2t_rows, r2t_width = req_to_token.shape
    if bs and max_pages and (num_pages == 0 or r2t_rows == 0 or r2t_width == 0):
        fail("page_min", "allocated pools", f"page_min {tuple(page_min.shape)}, req_to_token "
             f"{tuple(req_to_token.shape)}", "allocate the pools before scoring.")
    if check_values:  # retrieve_topk checked the rows already (one host sync per call, not two)
        check_range("req_pool_indices", req_pool_indices, 0, r2t_rows - 1, "pass forward_batch.req_pool_indices.")
    if bs > 65535:
        fail("req_pool_indices", "at most 65535 requests per launch", f"bs={bs}", "score the batch in chunks.")
    return num_pages, hd, head_dim, group, page_size, max_pages
