"""Paged FP8 lightning-indexer logits: ``I[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] · k[s])``.

The torch reference is ``sparse_ref.algorithms.dsa.paged_indexer_logits_reference``; this kernel
computes the same thing reading each key straight from the paged key cache.

**Inputs** (the launcher checks them all before the launch):

* ``q``: ``[T, H, D]`` FP8 e4m3 queries (or fp32 for the full-precision cache), one row per
  query token; ``weights``: fp32 ``[T, H]`` head weights (q's scale already folded in).
* ``keys``: ``[num_pages, P, D]`` and ``scales``: fp32 ``[num_pages, P]``, views of one layer of
  ``IndexerKeyCache``. In FP8 mode both are views of ONE uint8 buffer ``[num_pages, P*(D+4)]``:
  a page is ``P*D`` key bytes (token-major) followed by ``P`` fp32 scales, so ``keys`` has page
  stride ``P*(D+4)`` bytes and ``scales`` page stride ``P*(D+4)/4`` floats.
* ``block_table``: int32 ``[bs, max_pages]``, physical page of logical page ``j`` of request ``b``
  (``req_to_token[rows, ::P] // P``).
* ``token_req``: int32 ``[T]``, the block-table row of each query token; ``bounds``: int32
  ``[T]``, its causal bound: it sees keys ``0 .. bounds[t] - 1`` (position + 1). Decode is
  ``T = bs`` with ``token_req = arange(bs)``; extend and chunked prefill have many tokens per
  request, each with its own bound.

**Output**: fp32 ``[T, width]``. Entries ``s < bounds[t]`` hold the logit. With
``fill_tail=True`` entries ``bounds[t] <= s < width`` hold ``-inf`` (a self-contained score
matrix); with ``fill_tail=False`` they are left unwritten and a top-k must read only the first
``bounds[t]`` entries of a row (``topk(..., lengths=bounds)`` does).

**Tile math** (one program = one query token x ``TILES`` tiles of ``BLOCK_T`` key tokens):
tokens on M and heads on N, ``tl.dot(K [BLOCK_T, D], Q^T [D, H]) -> [BLOCK_T, H]`` fp32, then
``relu``, ``* w[None, :]`` and ``tl.sum(axis=1)``: one token's heads sit in one warp, so the head
sum never leaves registers. ``k_scale`` multiplies after the head sum (``relu(s x) = s relu(x)`` for
``s > 0``: exact, and 1 multiply per token instead of H). Q and w are loaded once per program.
When ``BLOCK_T`` divides the page size a tile lies inside one page: one page id per tile and
contiguous rows; otherwise (small pages) every row finds its own page.

**Work split**: ``TILES`` (tiles per program) is chosen so the grid has about 32 programs per SM,
several waves of resident programs, so the last wave's tail is short (measured on H200 at bs=64,
64K: 4096 programs of 16 tiles 165 µs, 1024 programs of 64 tiles 208 µs), from ``T`` and ``width``
only: no value is read back to the host, so decode is CUDA-graph capturable. Programs past a row's
bound exit at once (or only write ``-inf``). Defaults ``num_warps=4``, ``num_stages=3`` (8 warps
measured ~1.4x slower). Extend batches (on average 4 or more query tokens per request) use the
multi-query program (``TUNING["queries_per_program"]``, 4 by default): 4 consecutive tokens share each key tile.

**Interpreter**: loops have a constexpr trip count plus masks (``RUNTIME_LOOP=False``), because
Triton < 3.7's interpreter fails on runtime loop bounds; compiled, the loop stops at the bound.
FP8 ``tl.dot`` is exact in the interpreter (it widens to fp16 and multiplies in fp32).

**GPUs without FP8** (compute capability < 8.9): the launcher refuses FP8 inputs with a clear
error; ``LightningIndexer(backend="auto")`` then uses the torch path.

Launch knobs are in ``TUNING`` (``sparse_ref.kernels.tuning`` varies them): tiles per program, key
tokens per tile, warps, stages and query tokens per program (None: chosen from the shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import check_int, check_kernel_device, check_tensor, fail, skip_value_checks
from sparse_ref.device import triton_interpreted
from sparse_ref.errors import ShapeError, SparseRefError
from sparse_ref.kernels import Knob, Knobs

FP8 = torch.float8_e4m3fn
BLOCK_T = 64  # key tokens per tile (the page size DeepGEMM and SGLang use on Hopper)
MAX_TILES = 64  # tiles per program, at most
MIN_TILES = 4  # tiles per program, at least, while that still leaves PROGRAMS_PER_SM / 4 programs per SM
PROGRAMS_PER_SM = 32
QUERIES_PER_PROGRAM = 4  # extend / prefill default (measured on H200: 8192 x 64K, 11.95 ms -> 10.16 ms)
# Launch knobs (None: chosen from the shapes; see the module docstring). Vary them with sparse_ref.kernels.tuning.
TUNING = Knobs("dsa", {
    "tiles": Knob(1, 1024, none=True), "block_t": Knob(16, 256, pow2=True), "num_warps": Knob(1, 32, pow2=True),
    "num_stages": Knob(1, 8, none=True), "queries_per_program": Knob(1, 16, pow2=True, none=True),
}, tiles=None, block_t=BLOCK_T, num_warps=4, num_stages=3, queries_per_program=None)


@triton.jit
def _tile_rows(block_table_ptr, bt_row, tile_start, max_pages, num_pages, bound,
               PAGE: tl.constexpr, BLOCK_T: tl.constexpr, PAGE_STRIDE_K: tl.constexpr,
               PAGE_STRIDE_S: tl.constexpr, D: tl.constexpr):
    """Key-row and scale offsets of the ``BLOCK_T`` key tokens starting at ``tile_start``, and their mask."""
    offs = tl.arange(0, BLOCK_T)
    pos = tile_start + offs
    valid = pos < bound
    if PAGE % BLOCK_T == 0:  # the tile lies inside one page: one page id, contiguous rows
        lp = tile_start // PAGE
        page = tl.load(block_table_ptr + bt_row + lp, mask=lp < max_pages, other=0).to(tl.int64)
        in_page = tile_start % PAGE + offs
    else:  # small pages: each row looks up its own page
        lp = pos // PAGE
        page = tl.load(block_table_ptr + bt_row + lp, mask=valid & (lp < max_pages), other=0).to(tl.int64)
        in_page = pos % PAGE
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)  # never read outside the cache
    key_rows = page * PAGE_STRIDE_K + in_page * D
    scale_idx = page * PAGE_STRIDE_S + in_page
    return pos, valid, key_rows, scale_idx


@triton.jit
def _request_row(token_req_ptr, bounds_ptr, t, n_rows, max_pages, width):
    """Query token ``t``'s block-table row offset and key bound; a row outside ``[0, n_rows)`` gets bound 0
    (it reads no key, and its logits are the -inf tail), so a bad ``token_req`` never reads out of bounds."""
    req = tl.load(token_req_ptr + t)
    ok = (req >= 0) & (req < n_rows)
    bound = tl.where(ok, tl.minimum(tl.load(bounds_ptr + t), width), 0)
    return tl.where(ok, req, 0).to(tl.int64) * max_pages, bound


@triton.jit
def _indexer_logits_kernel(q_ptr, w_ptr,  # the queries [T, H, D] and their head weights [T, H]
                           keys_ptr, scales_ptr,  # the key cache of one layer: pages of keys, pages of scales
                           block_table_ptr, token_req_ptr, bounds_ptr,  # pages per request; per token: request, bound
                           out_ptr,  # the logits [T, width]
                           dims,  # (heads H, width, pages per block-table row, pages in the cache, block-table rows)
                           PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_T: tl.constexpr, TILES: tl.constexpr, PAGE_STRIDE_K: tl.constexpr,
                           PAGE_STRIDE_S: tl.constexpr, FILL_TAIL: tl.constexpr, RUNTIME_LOOP: tl.constexpr):
    """One program = one query token x TILES key tiles of its request (pages through the block table):
    per tile, tl.dot(K [BLOCK_T, D], Q^T [D, H]) -> relu * w -> sum over heads -> * k_scale -> logits."""
    H, width, max_pages, num_pages, n_rows = dims[0], dims[1], dims[2], dims[3], dims[4]
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    bt_row, bound = _request_row(token_req_ptr, bounds_ptr, t, n_rows, max_pages, width)
    first = split * (TILES * BLOCK_T)
    out_row = out_ptr + t * width

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + t * H * D + h[:, None] * D + d[None, :], mask=(h[:, None] < H) & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t * H + h, mask=h < H, other=0.0)
    qt = tl.trans(q)  # [BLOCK_D, BLOCK_H]: heads on N

    if RUNTIME_LOOP:  # compiled: stop at the bound
        n_tiles = tl.minimum(tl.maximum(bound - first + BLOCK_T - 1, 0) // BLOCK_T, TILES)
    else:  # interpreter: a constant trip count, masks do the rest
        n_tiles = TILES
    for i in range(0, n_tiles):
        pos, valid, key_rows, scale_idx = _tile_rows(block_table_ptr, bt_row, first + i * BLOCK_T, max_pages,
                                                     num_pages, bound, PAGE, BLOCK_T, PAGE_STRIDE_K, PAGE_STRIDE_S, D)
        k = tl.load(keys_ptr + key_rows[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if keys_ptr.dtype.element_ty.is_fp8():
            s = tl.dot(k, qt)  # [BLOCK_T, BLOCK_H] fp32
        else:  # the full-precision cache: fp32, no TF32
            s = tl.dot(k, qt, input_precision="ieee")
        logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
        logit = logit * tl.load(scales_ptr + scale_idx, mask=valid, other=0.0)
        if FILL_TAIL:
            tl.store(out_row + pos, tl.where(valid, logit, float("-inf")), mask=pos < width)
        else:
            tl.store(out_row + pos, logit, mask=valid)
    if RUNTIME_LOOP and FILL_TAIL:  # the program's tiles past the bound: -inf only, nothing to read
        for i in range(n_tiles, TILES):
            pos = first + i * BLOCK_T + tl.arange(0, BLOCK_T)
            tl.store(out_row + pos, tl.full([BLOCK_T], float("-inf"), tl.float32), mask=pos < width)


@triton.jit
def _indexer_logits_multiq_kernel(q_ptr, w_ptr,  # the queries [T, H, D] and their head weights [T, H]
                                  keys_ptr, scales_ptr,  # the key cache of one layer
                                  block_table_ptr, token_req_ptr, bounds_ptr,  # as _indexer_logits_kernel
                                  out_ptr,  # the logits [T, width]
                                  dims,  # (tokens T, heads H, width, pages per row, pages in the cache, rows)
                                  PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                                  BLOCK_T: tl.constexpr, TILES: tl.constexpr, QB: tl.constexpr,
                                  PAGE_STRIDE_K: tl.constexpr, PAGE_STRIDE_S: tl.constexpr,
                                  FILL_TAIL: tl.constexpr, RUNTIME_LOOP: tl.constexpr):
    """``QB`` query tokens per program share each key tile: one dot with N = QB * heads (prefill).

    Rows of one request form a segment; a program walks its segments (usually one in a prefill)
    and, per segment, the key tiles up to the segment's largest bound.
    """
    T, H, width, max_pages, num_pages, n_rows = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]
    g = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = split * (TILES * BLOCK_T)
    rows = g * QB + tl.arange(0, QB)
    row_ok = rows < T
    reqs = tl.load(token_req_ptr + rows, mask=row_ok, other=-1)
    reqs = tl.where((reqs >= 0) & (reqs < n_rows), reqs, -1)  # a row outside the block table reads nothing
    bnds = tl.where(reqs >= 0, tl.minimum(tl.load(bounds_ptr + rows, mask=row_ok, other=0), width), 0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qrow = rows[:, None] * H + h[None, :]  # [QB, BLOCK_H]
    qmask = row_ok[:, None] & (h[None, :] < H)
    q = tl.load(q_ptr + qrow[:, :, None] * D + d[None, None, :], mask=qmask[:, :, None] & d_ok[None, None, :],
                other=0.0)
    qt = tl.trans(tl.reshape(q, [QB * BLOCK_H, BLOCK_D]))  # [BLOCK_D, QB * BLOCK_H]
    w = tl.load(w_ptr + qrow, mask=qmask, other=0.0)  # [QB, BLOCK_H]
    prev = tl.full([], -2, tl.int32)
    for j in range(0, QB):
        req = tl.load(token_req_ptr + g * QB + j, mask=g * QB + j < T, other=-1)
        # the first row of a segment: process every row of this request
        if (req >= 0) & (req < n_rows) & (req != prev):
            in_seg = reqs == req
            seg_bound = tl.max(tl.where(in_seg, bnds, 0), axis=0)
            bt_row = req.to(tl.int64) * max_pages
            if RUNTIME_LOOP:
                n_tiles = tl.minimum(tl.maximum(seg_bound - first + BLOCK_T - 1, 0) // BLOCK_T, TILES)
            else:
                n_tiles = TILES
            for i in range(0, n_tiles):
                pos, valid, key_rows, scale_idx = _tile_rows(block_table_ptr, bt_row, first + i * BLOCK_T,
                                                             max_pages, num_pages, seg_bound, PAGE, BLOCK_T,
                                                             PAGE_STRIDE_K, PAGE_STRIDE_S, D)
                k = tl.load(keys_ptr + key_rows[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :],
                            other=0.0)
                if keys_ptr.dtype.element_ty.is_fp8():
                    sc = tl.dot(k, qt)  # [BLOCK_T, QB * BLOCK_H]
                else:
                    sc = tl.dot(k, qt, input_precision="ieee")
                sc = tl.reshape(tl.maximum(sc, 0.0), [BLOCK_T, QB, BLOCK_H]) * w[None, :, :]
                logit = tl.sum(sc, axis=2) * tl.load(scales_ptr + scale_idx, mask=valid, other=0.0)[:, None]
                keep = (pos[:, None] < bnds[None, :]) & in_seg[None, :]
                tl.store(out_ptr + rows[None, :] * width + pos[:, None], logit, mask=keep)
        prev = req
    if FILL_TAIL:
        for i in range(0, TILES):
            pos = first + i * BLOCK_T + tl.arange(0, BLOCK_T)
            tail = (pos[:, None] >= bnds[None, :]) & (pos[:, None] < width) & row_ok[None, :]
            tl.store(out_ptr + rows[None, :] * width + pos[:, None], tl.full([BLOCK_T, QB], float("-inf"), tl.float32),
                     mask=tail)


# ----------------------------------------------------------------------------- launch plan
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_tiles(num_tokens: int, width: int, device: torch.device, block_t: int = BLOCK_T) -> int:
    """Tiles per program (a power of two in ``[1, MAX_TILES]``) for about 32 programs per SM.

    Work is estimated from ``num_tokens`` (rows of the grid) and ``width`` alone (no lengths read
    back). At least ``MIN_TILES`` per program while that leaves 8 programs per SM (the fixed cost
    of a program, loading its queries, stays small). At 132 SMs: 64 tokens x 64K keys gives 16
    tiles per program (4096 programs), 64 x 16K and 8 x 64K give 4, 1 x 64K gives 1.
    """
    total = num_tokens * triton.cdiv(max(width, 1), block_t)
    sms = _sm_count(device)
    want = triton.next_power_of_2(triton.cdiv(total, PROGRAMS_PER_SM * sms))
    if total >= MIN_TILES * (PROGRAMS_PER_SM // 4) * sms:
        want = max(want, MIN_TILES)
    return max(1, min(MAX_TILES, want))


def _block_sizes(H: int, D: int) -> tuple[int, int]:
    return max(16, triton.next_power_of_2(H)), max(32, triton.next_power_of_2(D))


def fp8_supported(device: torch.device) -> bool:
    """FP8 e4m3 ``tl.dot`` compiles on compute capability >= 8.9 (and always runs in the interpreter)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def paged_indexer_logits(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor,
                         block_table: torch.Tensor, token_req: torch.Tensor, bounds: torch.Tensor, width: int, *,
                         fill_tail: bool = True, out: torch.Tensor | None = None,
                         check_values: bool = True) -> torch.Tensor:
    """fp32 ``[T, width]`` indexer logits read through the page table (see the module docstring).

    ``check_values=False`` skips the host-side range checks of index values when the caller has made
    them (``LightningIndexer`` does: its token rows come from its own batch). The kernel clamps page
    ids, bounds and ``token_req`` rows (a row outside the block table reads no key), so an unchecked bad
    value gives wrong logits for that token, never an out-of-bounds read.
    """
    T, H, D, page, bs, max_pages, num_pages, width, out = check_indexer_logits(
        q, weights, keys, scales, block_table, token_req, bounds, width, out, check_values, FP8)
    fn, device, fp8 = "paged_indexer_logits", q.device, q.dtype == FP8
    tiles, block_t, qb = TUNING["tiles"], TUNING["block_t"], TUNING["queries_per_program"]  # (ranged there)
    if T == 0 or width == 0:
        return out
    if qb is None:
        qb = QUERIES_PER_PROGRAM if T >= QUERIES_PER_PROGRAM * bs else 1
    if tiles is None:
        tiles = plan_tiles(triton.cdiv(T, qb), width, device, block_t)
    block_h, block_d = _block_sizes(H, D)
    stride_s = scales.stride(0)
    if not fp8 and (keys.data_ptr() % 4 or scales.data_ptr() % 4):
        raise SparseRefError(f"{fn}: misaligned fp32 pages.")
    grid = (T, triton.cdiv(width, tiles * block_t))
    if grid[1] > 65535:
        fail(f"{fn}: tiles", f"at least {triton.cdiv(width, 65535 * block_t)} for width {width}", repr(tiles),
             "leave TUNING['tiles'] at None.", SparseRefError)
    num_stages = TUNING["num_stages"]
    opts = dict(num_warps=TUNING["num_warps"], **({"num_stages": num_stages} if num_stages is not None else {}))
    if qb > 1:
        grid = (triton.cdiv(T, qb), grid[1])
        _indexer_logits_multiq_kernel[grid](q, weights, keys, scales, block_table, token_req, bounds, out,
                                            (T, H, width, max_pages, num_pages, bs), PAGE=page, D=D,
                                            BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_T=block_t, TILES=tiles, QB=qb,
                                            PAGE_STRIDE_K=keys.stride(0), PAGE_STRIDE_S=stride_s,
                                            FILL_TAIL=fill_tail, RUNTIME_LOOP=not triton_interpreted(), **opts)
        return out
    _indexer_logits_kernel[grid](q, weights, keys, scales, block_table, token_req, bounds, out,
                                 (H, width, max_pages, num_pages, bs), PAGE=page, D=D, BLOCK_D=block_d,
                                 BLOCK_H=block_h, BLOCK_T=block_t, TILES=tiles, PAGE_STRIDE_K=keys.stride(0),
                                 PAGE_STRIDE_S=stride_s, FILL_TAIL=fill_tail, RUNTIME_LOOP=not triton_interpreted(),
                                 **opts)
    return out


# ------------------------------ argument checks (each entry point above calls one first)
def check_indexer_logits(q, weights, keys, scales, block_table, token_req, bounds, width, out, check_values,
                         fp8_dtype):
    """``(T, H, D, page, bs, max_pages, num_pages, width, out)`` of ``paged_indexer_logits`` (``out`` allocated)."""
    fn = "paged_indexer_logits"
    check_tensor("q", q, dtype=(fp8_dtype, torch.float32), dims=3, contiguous=True,
                 fix="pass the indexer's queries [T, H, D] (FP8, or fp32 for a full-precision cache).")
    T, H, D = q.shape
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), contiguous=True,
                 fix=f"pass the fp32 head weights [T={T}, H={H}].")
    check_tensor("keys", keys, dtype=q.dtype, dims=3, fix="pass IndexerKeyCache.key_pages(layer_id).")
    num_pages, page, kd = keys.shape
    if kd != D or keys.stride(2) != 1 or keys.stride(1) != D:
        fail(f"{fn}: keys", f"[num_pages, page_size, D={D}] with token-major rows of D contiguous values",
             f"shape {tuple(keys.shape)}, strides {keys.stride()}", "pass IndexerKeyCache.key_pages(layer_id).")
    check_tensor("scales", scales, dtype=torch.float32, shape=(num_pages, page),
                 fix="pass IndexerKeyCache.scale_pages(layer_id).")
    if scales.stride(1) != 1:
        fail(f"{fn}: scales", "one page's scales contiguous", f"strides {scales.stride()}",
             "pass IndexerKeyCache.scale_pages(layer_id).")
    check_tensor("block_table", block_table, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass req_to_token[req_pool_indices, ::page_size] // page_size as int32.")
    bs, max_pages = block_table.shape
    check_tensor("token_req", token_req, dtype=torch.int32, shape=(T,), contiguous=True,
                 fix=f"pass the block-table row of each query token, int32 [T={T}].")
    check_tensor("bounds", bounds, dtype=torch.int32, shape=(T,), contiguous=True,
                 fix=f"pass each query token's position + 1, int32 [T={T}].")
    width = check_int("width", width, low=0, high=2**31 - 1, error=ShapeError)
    if out is None:
        out = torch.empty((T, width), dtype=torch.float32, device=q.device)
    check_tensor("out", out, dtype=torch.float32, shape=(T, width), contiguous=True,
                 fix=f"pass out=None, or torch.empty({T}, {width}) in fp32.")
    device = q.device
    check_kernel_device(f"{fn}: q", q, "move the cache and queries to the GPU, or use "
                        "LightningIndexer(backend='torch').")
    for name, t in (("weights", weights), ("keys", keys), ("scales", scales), ("block_table", block_table),
                    ("token_req", token_req), ("bounds", bounds), ("out", out)):
        if t.device != device:
            fail(f"{fn}: {name}", f"a tensor on {device} (the device of q)", f"one on {t.device}",
                 f"move it with {name}.to({str(device)!r}).")
    fp8 = q.dtype == fp8_dtype
    if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise SparseRefError(f"{fn}: FP8 e4m3 tl.dot needs compute capability >= 8.9, this GPU has "
                             f"{torch.cuda.get_device_capability(device)}. Fix: use "
                             f"LightningIndexer(backend='torch') (dequantised keys), or a Hopper/Ada GPU.")
    if fp8 and (keys.stride(0) % 4 or (scales.data_ptr() - keys.data_ptr()) % 4):
        fail(f"{fn}: keys", "pages whose byte size is a multiple of 4", f"page stride {keys.stride(0)} bytes",
             "use a page_size * head_dim that is a multiple of 4.")
    if T and check_values and not skip_value_checks():  # LightningIndexer checked its batch already
        lo, hi = (int(x) for x in token_req.aminmax())
        if lo < 0 or hi >= bs:
            fail(f"{fn}: token_req", f"rows in [0, {bs}) of block_table", f"min {lo}, max {hi}",
                 "one block-table row per query token's request.")
        lo, hi = (int(x) for x in bounds.aminmax())
        if lo < 0 or hi > min(width, max_pages * page):
            fail(f"{fn}: bounds", f"values in [0, {min(width, max_pages * page)}] (width, and the pages of "
                 "block_table)", f"min {lo}, max {hi}", "bounds are positions + 1, within the row width.")
        if block_table.numel():
            lo, hi = (int(x) for x in block_table.aminmax())
            if lo < 0 or hi >= num_pages:
                fail(f"{fn}: block_table", f"page ids in [0, {num_pages})", f"min {lo}, max {hi}",
                     "build it from req_to_token of the cache's own pools.")
    return T, H, D, page, bs, max_pages, num_pages, width, out
