"""Quest page scores in one streaming pass: ``score[r, j] = q+ . max[p] + q- . min[p]``, -inf where invalid.

The torch path (``sparse_ref.algorithms.quest.quest_page_scores_reference``) gathers every
request's page bounds into new ``[bs, max_pages, H_kv*D]`` tensors and then runs ``bmm``: at
bs=64 and 32K context that writes and re-reads about 1 GB. This kernel reads each page's bounds
once, straight from the pool, and writes one fp32 score per page: it is memory bound, and its
byte floor is "the bounds of every scored page, read once".

Inputs (the launcher checks them all before the launch):

* ``q_pos``, ``q_neg``: fp32 ``[bs, H_kv, D]`` (or ``[bs, H_kv*D]``), from ``split_query_sign``:
  the GQA mean / per-KV-head sum and the sign split stay in torch (they are tiny).
* ``page_min``, ``page_max``: ``[num_pages, H_kv, D]`` fp32 (or fp16/bf16: loaded and widened to
  fp32; accumulation is always fp32), indexed by PHYSICAL page.
* ``page_valid``: bool ``[num_pages]``. An invalid page scores exactly ``-inf``, and its bounds
  are not read at all (masked loads).
* ``pages``: int32/int64 ``[bs, max_pages]``, the physical page of logical page ``j`` of row ``r``
  (what ``QuestAlgorithm.physical_pages`` returns). Taking the page table rather than
  ``req_to_token`` keeps the kernel independent of how pages are mapped; reading it costs 8 bytes
  per page against ``2 * H_kv * D * 4`` for the bounds (0.1% at H_kv=8, D=128).

Safety: page ids are checked eagerly (one host sync, skipped while a CUDA graph is being
captured) and also clamped into ``[0, num_pages)`` inside the kernel, so a bad id can never read
outside the pool. Nothing is read back to the host otherwise: the launch is graph capturable.

Layout: one program scores ``BLOCK_P`` consecutive logical pages of one request; it walks the
``H_kv*D`` bound vector in ``BLOCK_HD`` chunks (masked, so any ``H_kv*D`` works, powers of two or
not), keeps a ``[BLOCK_P, BLOCK_HD]`` fp32 accumulator and reduces it once at the end. ``H_kv*D``
is a runtime argument (Triton specializes it on divisibility by 16, so pool rows stay 16-byte
aligned for vector loads) rather than a constexpr: one compiled kernel serves every model shape.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparse_ref.errors import ShapeError, SparseRefError

BOUND_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _quest_scores_kernel(q_pos_ptr, q_neg_ptr, page_min_ptr, page_max_ptr, valid_ptr, pages_ptr, out_ptr,
                         max_pages, num_pages, HD,
                         BLOCK_P: tl.constexpr, BLOCK_HD: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_row = j < max_pages
    page = tl.load(pages_ptr + row * max_pages + j, mask=in_row, other=0).to(tl.int64)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)  # never read outside the pool
    valid = tl.load(valid_ptr + page, mask=in_row, other=0) != 0
    read = in_row & valid  # an invalid page's bounds are not read: its score is -inf anyway
    base = page * HD
    acc = tl.zeros([BLOCK_P, BLOCK_HD], dtype=tl.float32)
    for start in range(0, HD, BLOCK_HD):
        d = start + tl.arange(0, BLOCK_HD)
        in_hd = d < HD
        qp = tl.load(q_pos_ptr + row * HD + d, mask=in_hd, other=0.0)
        qn = tl.load(q_neg_ptr + row * HD + d, mask=in_hd, other=0.0)
        m = read[:, None] & in_hd[None, :]
        offs = base[:, None] + d[None, :]
        mx = tl.load(page_max_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        mn = tl.load(page_min_ptr + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += mx * qp[None, :] + mn * qn[None, :]
    score = tl.sum(acc, axis=1)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + row * max_pages + j, score, mask=in_row)


def interpreted() -> bool:
    """True when Triton runs kernels through its interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def capturing() -> bool:
    """True while a CUDA graph is being captured: then no check may read device data."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check(fn: str, name: str, t, dtypes, shape, fix: str) -> None:
    """ShapeError unless ``t`` is a contiguous tensor of one of ``dtypes`` with ``shape`` (None: any size)."""
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}. Fix: {fix}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ShapeError(f"{fn}: {name} must have dtype {want}, got {t.dtype}. Fix: {fix}")
    if t.dim() != len(shape) or any(w is not None and w != g for w, g in zip(shape, t.shape, strict=True)):
        want = "[" + ", ".join("any" if w is None else str(w) for w in shape) + "]"
        raise ShapeError(f"{fn}: {name} must have shape {want}, got {tuple(t.shape)}. Fix: {fix}")
    if not t.is_contiguous():
        raise ShapeError(f"{fn}: {name} must be contiguous, got strides {t.stride()}. Fix: pass {name}.contiguous().")


def _block_sizes(hd: int, block_p, block_hd, num_warps) -> tuple[int, int, int]:
    block_hd = min(256, triton.next_power_of_2(max(hd, 16))) if block_hd is None else block_hd
    block_p = 16 if block_p is None else block_p
    num_warps = 4 if num_warps is None else num_warps
    for name, v, lo in (("block_p", block_p, 2), ("block_hd", block_hd, 8), ("num_warps", num_warps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or v & (v - 1):
            raise SparseRefError(f"quest_page_scores: {name} must be a power of two >= {lo}, got {v!r}. "
                                 f"Fix: leave {name}=None for the default.")
    return block_p, block_hd, num_warps


def quest_page_scores(q_pos: torch.Tensor, q_neg: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                      page_valid: torch.Tensor, pages: torch.Tensor, *, out: torch.Tensor | None = None,
                      block_p: int | None = None, block_hd: int | None = None,
                      num_warps: int | None = None) -> torch.Tensor:
    """fp32 ``[bs, max_pages]`` Quest page scores; equals ``quest_page_scores_reference`` (see module docstring).

    ``out`` (fp32 ``[bs, max_pages]``, contiguous) receives the scores if given. ``block_p``,
    ``block_hd``, ``num_warps``: launch knobs (powers of two); None picks the defaults.
    """
    fn = "quest_page_scores"
    _check(fn, "page_min", page_min, BOUND_DTYPES, (None, None, None),
           "pass QuestAlgorithm.page_min[layer_id], [num_pages, H_kv, D].")
    num_pages, num_kv_heads, head_dim = page_min.shape
    hd = num_kv_heads * head_dim
    _check(fn, "page_max", page_max, (page_min.dtype,), tuple(page_min.shape),
           "pass QuestAlgorithm.page_max[layer_id] of the same layer as page_min.")
    _check(fn, "page_valid", page_valid, (torch.bool,), (num_pages,),
           "pass QuestAlgorithm.page_valid[layer_id], one bool per physical page.")
    _check(fn, "pages", pages, (torch.int32, torch.int64), (None, None),
           "pass QuestAlgorithm.physical_pages(req_pool_indices), [bs, max_pages] physical page ids.")
    bs, max_pages = pages.shape
    for name, q in (("q_pos", q_pos), ("q_neg", q_neg)):
        shape = (bs, num_kv_heads, head_dim) if isinstance(q, torch.Tensor) and q.dim() == 3 else (bs, hd)
        _check(fn, name, q, (torch.float32,), shape,
               f"pass {name} from split_query_sign: fp32 [bs={bs}, H_kv={num_kv_heads}, D={head_dim}].")
    if out is not None:
        _check(fn, "out", out, (torch.float32,), (bs, max_pages), "pass torch.empty(bs, max_pages) in fp32.")
    tensors = {"q_pos": q_pos, "q_neg": q_neg, "page_max": page_max, "page_valid": page_valid, "pages": pages,
               **({"out": out} if out is not None else {})}
    device = page_min.device
    if device.type != "cuda" and not (device.type == "cpu" and interpreted()):
        raise ShapeError(f"{fn}: tensors must be on a CUDA device (or on CPU with TRITON_INTERPRET=1), got "
                         f"{device}. Fix: move the pools and queries to the GPU, or use the torch scoring backend.")
    for name, t in tensors.items():
        if t.device != device:
            raise ShapeError(f"{fn}: {name} must be on the same device as page_min ({device}), got {t.device}. "
                             f"Fix: {name}.to({str(device)!r}).")
    block_p, block_hd, num_warps = _block_sizes(hd, block_p, block_hd, num_warps)
    if pages.numel() and num_pages == 0:
        raise ShapeError(f"{fn}: pages names {pages.numel()} pages but the pool has none (page_min has shape "
                         f"{tuple(page_min.shape)}). Fix: allocate the Quest pools before scoring.")
    if pages.numel() and not capturing():
        lo, hi = (int(x) for x in pages.aminmax())
        if lo < 0 or hi >= num_pages:
            raise ShapeError(f"{fn}: pages must lie in [0, {num_pages}) (the pool's physical pages), got min {lo}, "
                             f"max {hi}. Fix: build pages with QuestAlgorithm.physical_pages (which clamps), "
                             f"from a req_to_token filled through KVCacheManager.")
    if bs > 65535:
        raise ShapeError(f"{fn}: at most 65535 requests per launch, got bs={bs}. Fix: score the batch in chunks.")
    if out is None:
        out = torch.empty((bs, max_pages), dtype=torch.float32, device=device)
    if bs == 0 or max_pages == 0:
        return out
    grid = (triton.cdiv(max_pages, block_p), bs)  # requests on axis 1 (<= 65535 of them)
    _quest_scores_kernel[grid](q_pos, q_neg, page_min, page_max, page_valid.view(torch.uint8), pages, out,
                               max_pages, num_pages, hd, BLOCK_P=block_p, BLOCK_HD=block_hd,
                               num_warps=num_warps)
    return out


# Ahead-of-time compile variants (tests/test_aot_compile.py): the launcher's default blocks.
AOT_VARIANTS = [
    (_quest_scores_kernel,
     {"q_pos_ptr": "*fp32", "q_neg_ptr": "*fp32", "page_min_ptr": dtype, "page_max_ptr": dtype, "valid_ptr": "*u8",
      "pages_ptr": "*i64", "out_ptr": "*fp32", "max_pages": "i32", "num_pages": "i32", "HD": "i32",
      "BLOCK_P": "constexpr", "BLOCK_HD": "constexpr"},
     {"BLOCK_P": 16, "BLOCK_HD": 256}, {"num_warps": 4})
    for dtype in ("*fp32", "*bf16")
]
