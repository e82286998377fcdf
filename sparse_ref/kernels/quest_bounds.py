"""Quest page bounds in one launch: min/max of every page a step completed, gathered through ``req_to_token``.

``update_page_bounds`` writes what ``QuestAlgorithm``'s torch hooks write, bit for bit. A request
with ``prefix`` tokens before this step and ``seq_len`` after it completes its logical pages
``[prefix // P, seq_len // P)`` (a prefill: ``prefix = extend_prefix_lens``; a decode step:
``prefix = seq_len - 1``, so the range is the one page the new token filled, or empty). For each
such page ``p = req_to_token[row, j * P] // P`` the kernel stores, per KV head, the elementwise
minimum and maximum of the page's ``P`` keys into ``page_min[p]`` / ``page_max[p]`` (rounded
outward to 16 bits when the bounds are bf16/fp16, as ``round_bounds_outward`` does) and sets
``page_valid[p]``. Pages not completed this step are not touched.

The torch update gathers the newest page of every row, takes min/max, rounds, and writes three
masked scatters: about ten launches whether or not any row completed a page (88 µs per layer in
the bs=64 engine step on an H200). Here: one launch, grid ``(bs * H_kv, parts)``; a program takes
one (request, KV head) and every ``parts``-th page of the row's range, so a decode step (one page
at most) is one cheap program per (request, head) that usually exits after reading two ints.

Outward rounding without a rounding mode: round to nearest, then one 16-bit ulp outward where
that landed on the wrong side (the bits of a 16-bit float step by one ulp; the sign bit says which
way is outward). The result is the nearest 16-bit value on the outer side, the same as torch's
``nextafter`` correction.

Every index is clamped inside the kernel (row, lengths into the row, page into the pool), so even
unchecked values (during CUDA-graph capture, when the caller's value checks are skipped) never
write outside the pools. Nothing is read back to the host: the launch is graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import (
    FLOAT_DTYPES,
    check_int,
    check_kernel_device,
    check_quest_bounds_pool,
    check_same_device,
    check_tensor,
)
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import Knob, Knobs

_BOUNDS_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _outward(x, r, UP: tl.constexpr):
    """``r``, fp32 ``x`` rounded to nearest in 16 bits, moved one ulp outward where it landed inside: down for a
    min, up (UP) for a max."""
    bits = r.to(tl.int16, bitcast=True)
    negative = bits < 0  # the sign bit (also set for -0.0)
    if UP:
        wrong = r.to(tl.float32) < x
        step = tl.where(negative, bits - 1, bits + 1)  # toward +inf
    else:
        wrong = r.to(tl.float32) > x
        step = tl.where(negative, bits + 1, bits - 1)  # toward -inf
    return tl.where(wrong, step, bits).to(r.dtype, bitcast=True)


@triton.jit
def _store_bounds(min_ptr, max_ptr, out, lo, hi, mask, OUT: tl.constexpr):
    """Store fp32 ``lo``/``hi`` in the bounds dtype (OUT: 0 fp32, 1 bf16, 2 fp16), rounded outward."""
    if OUT == 1:
        tl.store(min_ptr + out, _outward(lo, lo.to(tl.bfloat16), False), mask=mask)
        tl.store(max_ptr + out, _outward(hi, hi.to(tl.bfloat16), True), mask=mask)
    elif OUT == 2:
        tl.store(min_ptr + out, _outward(lo, lo.to(tl.float16), False), mask=mask)
        tl.store(max_ptr + out, _outward(hi, hi.to(tl.float16), True), mask=mask)
    else:
        tl.store(min_ptr + out, lo, mask=mask)
        tl.store(max_ptr + out, hi, mask=mask)


@triton.jit
def _page_bounds_kernel(k_ptr, min_ptr, max_ptr, valid_ptr, req_to_token_ptr, rows_ptr, seq_lens_ptr, prefix_ptr,
                        dims,  # (KV heads, req_to_token rows, req_to_token width, pages in the pool, parts)
                        P: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                        DECODE: tl.constexpr, OUT: tl.constexpr):
    """One program = one (request, KV head) and every ``parts``-th page the request completed this step."""
    num_kv_heads, r2t_rows, r2t_width, num_pages, parts = dims[0], dims[1], dims[2], dims[3], dims[4]
    pid = tl.program_id(0)
    r = pid // num_kv_heads
    h = pid % num_kv_heads
    seq = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + r).to(tl.int64), 0), r2t_width)
    if DECODE:
        prefix = seq - 1
    else:
        prefix = tl.load(prefix_ptr + r).to(tl.int64)
    prefix = tl.minimum(tl.maximum(prefix, 0), seq)
    row = tl.minimum(tl.maximum(tl.load(rows_ptr + r).to(tl.int64), 0), r2t_rows - 1)
    o = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    mask = (o < P)[:, None] & (d < D)[None, :]
    for j in range(prefix // P + tl.program_id(1), seq // P, parts):
        slot = tl.load(req_to_token_ptr + row * r2t_width + j * P).to(tl.int64)
        page = tl.minimum(tl.maximum(slot // P, 0), num_pages - 1)
        offs = ((page * P + o)[:, None] * num_kv_heads + h) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        has_nan = tl.max(tl.where(mask & (k != k), 1, 0), axis=0) > 0  # torch's min/max propagate NaN
        lo = tl.where(has_nan, float("nan"), tl.min(tl.where(mask, k, float("inf")), axis=0))
        hi = tl.where(has_nan, float("nan"), tl.max(tl.where(mask, k, float("-inf")), axis=0))
        out = (page * num_kv_heads + h) * D + d
        _store_bounds(min_ptr, max_ptr, out, lo, hi, d < D, OUT)
        tl.store(valid_ptr + page, 1)  # every head's program stores the same 1


MAX_PARTS = 64  # programs per (request, KV head) for a prefill's many pages
TUNING = Knobs("quest_bounds", {"num_warps": Knob(1, 32, pow2=True)},  # warps per program (a [P, D] tile: 16 x
               num_warps=4)  # 128 keys at serving sizes)


def update_page_bounds(k_buffer: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                       page_valid: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, page_size: int, prefix_lens: torch.Tensor | None = None) -> None:
    """Write the bounds of every page this step completed, in place (see the module docstring).

    ``k_buffer`` ``[num_pages * P, H_kv, D]`` (fp32/bf16/fp16, contiguous), the layer's keys;
    ``page_min``/``page_max`` ``[num_pages, H_kv, D]`` (fp32/bf16/fp16, contiguous) and ``page_valid`` bool
    ``[num_pages]``: the layer's Quest pools. ``req_to_token`` int32 ``[rows, width]``; ``req_pool_indices``,
    ``seq_lens`` ``[bs]`` (after the step). ``prefix_lens`` ``[bs]``: the tokens before a prefill; ``None``
    for a decode step (one new token per request).
    """
    check_page_bounds_update(k_buffer, page_min, page_max, page_valid, req_to_token, req_pool_indices,
                                    seq_lens, page_size, prefix_lens)
    bs = req_pool_indices.shape[0]
    num_pages, num_kv_heads, head_dim = page_min.shape
    if bs == 0 or num_pages == 0 or req_to_token.numel() == 0:
        return
    r2t_rows, r2t_width = req_to_token.shape
    parts = 1 if prefix_lens is None else max(1, min(MAX_PARTS, r2t_width // page_size))
    seq_lens = seq_lens.contiguous()
    _page_bounds_kernel[(bs * num_kv_heads, parts)](
        k_buffer, page_min, page_max, page_valid.view(torch.uint8), req_to_token, req_pool_indices.contiguous(),
        seq_lens, seq_lens if prefix_lens is None else prefix_lens.contiguous(),
        (num_kv_heads, r2t_rows, r2t_width, num_pages, parts), P=page_size, D=head_dim,
        BLOCK_P=triton.next_power_of_2(page_size), BLOCK_D=triton.next_power_of_2(head_dim),
        DECODE=prefix_lens is None, OUT=_BOUNDS_CODE[page_min.dtype], num_warps=TUNING["num_warps"])


# ------------------------------ argument checks (each entry point above calls one first)
def check_page_bounds_update(k_buffer, page_min, page_max, page_valid, req_to_token, req_pool_indices, seq_lens,
                             page_size, prefix_lens) -> None:
    """The inputs of ``update_page_bounds`` (the Quest bounds kernel): shapes, dtypes, one device; the values are
    the caller's (``QuestAlgorithm`` checks them eagerly; the kernel clamps every index)."""
    fn = "update_page_bounds"
    num_pages, num_kv_heads, head_dim = check_quest_bounds_pool(page_min, page_max, page_valid)
    page_size = check_int("page_size", page_size, low=1, fix="pass the pool's page size.", error=SparseRefError)
    check_tensor("k_buffer", k_buffer, dtype=FLOAT_DTYPES, shape=(num_pages * page_size, num_kv_heads, head_dim),
                 contiguous=True, fix="pass token_to_kv_pool.get_key_buffer(layer_id) of the pool the bounds cover.")
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass ReqToTokenPool.req_to_token.")
    check_tensor("req_pool_indices", req_pool_indices, dtype=(torch.int32, torch.int64), dims=1,
                 fix="pass forward_batch.req_pool_indices, one row of req_to_token per request.")
    bs = req_pool_indices.shape[0]
    lens = {"seq_lens": seq_lens} | ({} if prefix_lens is None else {"prefix_lens": prefix_lens})
    for name, t in lens.items():
        check_tensor(name, t, dtype=(torch.int32, torch.int64), shape=(bs,),
                     fix=f"pass forward_batch.{'extend_prefix_lens' if name == 'prefix_lens' else name}, one per "
                         "request.")
    check_kernel_device(f"{fn}: page_min", page_min, "move the pools to the GPU, or use the torch bounds update.")
    on_host = {} if k_buffer.is_pinned() else {"k_buffer": k_buffer}  # pinned host K (offload): read through UVA
    check_same_device(fn, "page_min", {"page_min": page_min, "page_max": page_max, "page_valid": page_valid,
                                       **on_host, "req_to_token": req_to_token,
                                       "req_pool_indices": req_pool_indices, **lens})
