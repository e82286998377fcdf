"""Exact batched top-k by radix selection over the order-preserving bits of the scores.

Semantics: ``sparse_ref.selection.topk_reference`` (candidates are ``j < length`` whose score
is not NaN and not -inf; ties go to the lower id; -0.0 == +0.0; -1 padding at the end).

The idea, in four steps:

1. **Keys.** Each fp32 score becomes a uint32 key whose *unsigned* order is the float order:
   flip every bit of a negative float, set the sign bit of a positive one. -0.0 is folded
   into +0.0 first. Entries that may not be selected (NaN, -inf, past the row's length) get
   key 0, below every candidate (the smallest candidate, -FLT_MAX, maps to 0x00800000).
2. **Digit histograms.** Four passes of 8-bit digits, most significant first. Pass ``p``
   histograms digit ``p`` of the keys whose higher digits equal the threshold's prefix found
   so far, and walking that histogram from the top says which digit the k-th largest key has.
   After four passes we know the threshold ``T`` (the k-th largest key) exactly, and how many
   keys equal to ``T`` are needed (``k - count(key > T)``).
3. **Ordered compaction.** Every key ``> T`` is kept, plus the lowest-index keys ``== T``
   (ties to the lower id). Positions come from prefix sums, so the output is deterministic
   and comes out in ascending id order with no sort at all.
4. **Small sort** (``order="score"`` only): the <= k winners of a row are sorted inside one
   tile by the packed int64 ``(signed key << 32) | ~id``, descending.

Three launch shapes, one algorithm:

* **split chain** (long rows, or few rows): a row is cut into chunks over several programs
  (``splits``); each pass adds its partial histogram into the row's histogram in global memory
  with atomics, and the launches form a short fixed chain (zero the histograms, 4 passes,
  compaction, optional sort);
* **register row** (rows up to ``TUNING["register_row"]``): one program reads its row once and
  runs the 4 passes and the compaction on keys held in registers, in one launch;
* **tile loop** (an unsplit row too long for registers, e.g. ``splits=1``): one program per row
  loops over tiles for every pass.

Nothing is read back to the host, so a call with an int ``k`` can be captured in a CUDA graph.

The same chain serves the fused page selection (``kernels/page_select.py``): with ``PAGE``
set, each program derives its row's history window, budget and dense/sparse decision from
``seq_lens`` and writes sink + top-k + recent pages and the row length itself.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparse_ref.errors import ShapeError, SparseRefError

RADIX_BITS = 8
NUM_BINS = 1 << RADIX_BITS
NUM_PASSES = 32 // RADIX_BITS
# GPU launch knobs (module-level so benchmarks/profile_topk.py can try variants).
# Measured on H200 (benchmarks/NOTES.md): 8 programs per SM with 512-tiles for many rows; for fewer than
# 8 rows, 4 programs per SM with 1024-tiles and 8 warps. Rows up to ``short_row`` run one program per row,
# held in registers up to ``register_row`` (one read; 128x4096: 21 us vs 34 split, 32x8192: 32 vs 34, but
# 64x16384: 107 vs 49, so 8192 is the cut); longer unsplit rows (forced splits=1) loop over tiles.
TUNING = {"programs_per_sm": 8, "block": 512, "num_warps": 4, "fused_num_warps": 8, "short_row": 8192,
          "min_chunk": 1024, "sort_num_warps": 0, "register_row": 8192}
FEW_ROWS = {"programs_per_sm": 4, "block": 1024, "num_warps": 8}
MAX_SORT_WIDTH = 4096  # order="score" sorts a row's winners inside one tile of at most this many
ORDERS = ("score", "index", "none")


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _sortable_key(x, valid):
    """uint32 key with unsigned order == float order; 0 for entries that may not be selected."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0 before taking bits
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    ok = valid & (x == x) & (x != float("-inf"))
    return tl.where(ok, key, tl.zeros_like(key))


@triton.jit
def _signed_key(x):
    """int32 key with signed order == float order (for the int64 packed sort)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _walk(hist_row, pass_stride, k_eff, UPTO: tl.constexpr, BITS: tl.constexpr):
    """Threshold prefix (digits of passes < UPTO) and how many keys equal to it are still needed."""
    NB: tl.constexpr = 1 << BITS
    bins = tl.arange(0, NB)
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    for p in tl.static_range(UPTO):
        # Walk the histogram from the top: the digit where the count of keys at or above it
        # first reaches k_rem holds the k_rem-th largest key. (Inlined: nested calls are slow
        # in the interpreter.)
        h = tl.load(hist_row + p * pass_stride + bins)
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        digit = tl.max(tl.where(at_or_above >= k_rem, bins, -1), axis=0)
        k_rem = k_rem - tl.sum(tl.where(bins > digit, h, 0), axis=0)
        prefix = prefix | (digit.to(tl.uint32) << (32 - BITS * (p + 1)))
    return prefix, k_rem


@triton.jit
def _row_plan(r, N, W, k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr,
              HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, PAGE: tl.constexpr,
              page_size, n_recent, n_sink, min_seq, page_budget, USE_TABLE: tl.constexpr):
    """Row r's window [start, end), its k, and (page mode) sink_end, recent_start, n and sparse."""
    if PAGE:
        seq = tl.load(seq_ptr + r).to(tl.int64)
        seq_cap = (tl.full([], 0, tl.int64) + N) * page_size
        seq = tl.minimum(tl.maximum(seq, 0), seq_cap)  # never past the row
        n = ((seq + page_size - 1) // page_size).to(tl.int32)
        recent = tl.minimum(n, n_recent)
        recent_start = n - recent
        sink_end = tl.minimum(recent_start, n_sink)
        history = recent_start - sink_end
        if USE_TABLE:
            k = tl.load(budget_ptr + history)
        else:
            k = tl.minimum(history, page_budget)
        on = tl.load(mask_ptr + r).to(tl.int32) != 0
        sparse = on & (seq >= min_seq) & (n > 0) & (sink_end + k + recent < n)
        k = tl.where(sparse, k, 0)
        start = sink_end
        end = recent_start
    else:
        start = tl.full([], 0, tl.int32)
        if HAS_LEN:
            end = tl.load(len_ptr + r).to(tl.int32)
            end = tl.minimum(tl.maximum(end, 0), N)  # a bad length can never read past the row
        else:
            end = tl.full([], 0, tl.int32) + N
        if HAS_K:
            k = tl.load(k_ptr + r).to(tl.int32)
        else:
            k = tl.full([], 0, tl.int32) + k_scalar
        k = tl.minimum(tl.maximum(k, 0), W)
        sink_end = tl.full([], 0, tl.int32)
        recent_start = sink_end
        n = sink_end
        sparse = True
    return start, end, k, sink_end, recent_start, n, sparse


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _radix_pass_kernel(scores, stride_r, hist, split_buf, R, N, W, CHUNK, S,
                       k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr,
                       page_size, n_recent, n_sink, min_seq, page_budget,
                       PASS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, PAGE: tl.constexpr, USE_TABLE: tl.constexpr):
    """Histogram of digit PASS over the keys of one chunk whose higher digits match the threshold so far."""
    NB: tl.constexpr = 1 << BITS
    LAST: tl.constexpr = 32 // BITS - 1
    r = tl.program_id(0)
    s = tl.program_id(1)
    start, end, k, sink_end, recent_start, n, sparse = _row_plan(
        r, N, W, k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr, HAS_K, HAS_LEN, PAGE,
        page_size, n_recent, n_sink, min_seq, page_budget, USE_TABLE)
    lo = start + s * CHUNK
    hi = tl.minimum(lo + CHUNK, end)
    bins = tl.arange(0, NB)
    hist_row = hist + r * NB
    pass_stride = R * NB
    row = scores + r.to(tl.int64) * stride_r
    acc = tl.zeros([NB], dtype=tl.int32)
    gt_hi = tl.zeros([BLOCK], dtype=tl.int32)  # reduced once at the end (no barrier per tile)
    if PASS == 0:
        nxt = lo + tl.arange(0, BLOCK)  # prefetch: the next tile's load is issued before
        x_next = tl.load(row + nxt, mask=nxt < hi, other=0.0)  # this tile is processed
        for t in range(lo, hi, BLOCK):
            offs = t + tl.arange(0, BLOCK)
            valid = offs < hi
            x = x_next
            nxt = offs + BLOCK
            x_next = tl.load(row + nxt, mask=nxt < hi, other=0.0)
            key = _sortable_key(x.to(tl.float32), valid)
            digit = (key >> (32 - BITS)).to(tl.int32)
            acc += tl.histogram(digit, NB, mask=key != 0)
    else:
        cand = tl.sum(tl.load(hist_row + bins), axis=0)
        k_eff = tl.minimum(k, cand)
        prefix, k_rem = _walk(hist_row, pass_stride, k_eff, PASS, BITS)
        if k_eff == 0:
            hi = lo  # nothing to select in this row: skip the data
        high = prefix >> (32 - BITS * PASS)
        nxt = lo + tl.arange(0, BLOCK)  # prefetch: the next tile's load is issued before
        x_next = tl.load(row + nxt, mask=nxt < hi, other=0.0)  # this tile is processed
        for t in range(lo, hi, BLOCK):
            offs = t + tl.arange(0, BLOCK)
            valid = offs < hi
            x = x_next
            nxt = offs + BLOCK
            x_next = tl.load(row + nxt, mask=nxt < hi, other=0.0)
            key = _sortable_key(x.to(tl.float32), valid)
            top = key >> (32 - BITS * PASS)
            match = (top == high) & (key != 0)
            if PASS == LAST:
                gt_hi += ((top > high) & (key != 0)).to(tl.int32)
            digit = ((key >> (32 - BITS * (PASS + 1))) & (NB - 1)).to(tl.int32)
            if PASS == 1:  # many keys still match: histogram every tile
                acc += tl.histogram(digit, NB, mask=match)
            else:
                if tl.max(match.to(tl.int32), axis=0) > 0:  # late passes: most tiles hold no match
                    acc += tl.histogram(digit, NB, mask=match)
    tl.atomic_add(hist_row + PASS * pass_stride + bins, acc)
    if PASS == LAST:
        # Per chunk: keys above T and keys equal to T, for every possible last digit of T, so
        # that the compaction can place its keys after those of earlier chunks.
        above = tl.sum(gt_hi, axis=0) + tl.sum(acc, axis=0) - tl.cumsum(acc, axis=0)
        base = split_buf + ((r * S + s) * 2) * NB
        tl.store(base + bins, above)
        tl.store(base + NB + bins, acc)


@triton.jit
def _compact_kernel(scores, stride_r, hist, split_buf, out, lengths_out, R, N, W, CHUNK, S,
                    k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr,
                    page_size, n_recent, n_sink, min_seq, page_budget,
                    BITS: tl.constexpr, BLOCK: tl.constexpr, S_PAD: tl.constexpr,
                    HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, PAGE: tl.constexpr, USE_TABLE: tl.constexpr):
    """Write every key > T and the lowest-index keys == T in ascending id order (+ padding, pages)."""
    NB: tl.constexpr = 1 << BITS
    PASSES: tl.constexpr = 32 // BITS
    r = tl.program_id(0)
    s = tl.program_id(1)
    start, end, k, sink_end, recent_start, n, sparse = _row_plan(
        r, N, W, k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr, HAS_K, HAS_LEN, PAGE,
        page_size, n_recent, n_sink, min_seq, page_budget, USE_TABLE)
    bins = tl.arange(0, NB)
    hist_row = hist + r * NB
    cand = tl.sum(tl.load(hist_row + bins), axis=0)
    k_eff = tl.minimum(k, cand)
    T, ties_needed = _walk(hist_row, R * NB, k_eff, PASSES, BITS)
    last_digit = (T & (NB - 1)).to(tl.int32)

    # What the chunks before this one keep: all their keys > T and their share of the ties.
    sp = tl.arange(0, S_PAD)
    earlier = sp < s
    info = split_buf + ((r * S + sp) * 2) * NB + last_digit
    gt_s = tl.load(info, mask=earlier, other=0)
    eq_s = tl.load(info + NB, mask=earlier, other=0)
    eq_before_s = tl.cumsum(eq_s, axis=0) - eq_s
    kept_s = gt_s + tl.minimum(tl.maximum(ties_needed - eq_before_s, 0), eq_s)
    pos0 = tl.sum(kept_s, axis=0)
    eq_seen = tl.sum(eq_s, axis=0)

    out_row = out + r.to(tl.int64) * W
    row = scores + r.to(tl.int64) * stride_r
    lo = start + s * CHUNK
    hi = tl.minimum(lo + CHUNK, end)
    if k_eff == 0:
        hi = lo
    _emit_winners(row, out_row, lo, hi, T, ties_needed, pos0, eq_seen, sink_end, W, BLOCK)
    if s == 0:
        _emit_fixed(out_row, lengths_out, r, k_eff, sink_end, recent_start, n, sparse, W, BLOCK, PAGE)


@triton.jit
def _fused_row_kernel(scores, stride_r, out, lengths_out, N, W,
                      k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr,
                      page_size, n_recent, n_sink, min_seq, page_budget,
                      BITS: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, PAGE: tl.constexpr, USE_TABLE: tl.constexpr):
    """The whole chain for one row in one program (rows that are short, or many): one launch, no atomics."""
    NB: tl.constexpr = 1 << BITS
    PASSES: tl.constexpr = 32 // BITS
    r = tl.program_id(0)
    start, end, k, sink_end, recent_start, n, sparse = _row_plan(
        r, N, W, k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr, HAS_K, HAS_LEN, PAGE,
        page_size, n_recent, n_sink, min_seq, page_budget, USE_TABLE)
    row = scores + r.to(tl.int64) * stride_r
    bins = tl.arange(0, NB)
    k_eff = k
    k_rem = k
    prefix = tl.full([], 0, tl.uint32)
    for p in tl.static_range(PASSES):
        acc = tl.zeros([NB], dtype=tl.int32)
        nxt = start + tl.arange(0, BLOCK)  # prefetch: the next tile's load is issued before
        x_next = tl.load(row + nxt, mask=nxt < end, other=0.0)  # this tile is processed
        for t in range(start, end, BLOCK):
            offs = t + tl.arange(0, BLOCK)
            valid = offs < end
            x = x_next
            nxt = offs + BLOCK
            x_next = tl.load(row + nxt, mask=nxt < end, other=0.0)
            key = _sortable_key(x.to(tl.float32), valid)
            if p == 0:
                match = key != 0
            else:
                match = ((key >> (32 - BITS * p)) == (prefix >> (32 - BITS * p))) & (key != 0)
            if tl.sum(match.to(tl.int32), axis=0) > 0:
                digits = ((key >> (32 - BITS * (p + 1))) & (NB - 1)).to(tl.int32)
                acc += tl.histogram(digits, NB, mask=match)
        if p == 0:
            k_eff = tl.minimum(k, tl.sum(acc, axis=0))
            k_rem = k_eff
            if k_eff == 0:
                end = start  # nothing to select: later passes and the compaction skip the data
        at_or_above = tl.sum(acc, axis=0) - tl.cumsum(acc, axis=0) + acc
        digit = tl.max(tl.where(at_or_above >= k_rem, bins, -1), axis=0)
        k_rem = k_rem - tl.sum(tl.where(bins > digit, acc, 0), axis=0)
        prefix = prefix | (digit.to(tl.uint32) << (32 - BITS * (p + 1)))
    out_row = out + r.to(tl.int64) * W
    zero = tl.full([], 0, tl.int32)
    _emit_winners(row, out_row, start, end, prefix, k_rem, zero, zero, sink_end, W, BLOCK)
    _emit_fixed(out_row, lengths_out, r, k_eff, sink_end, recent_start, n, sparse, W, BLOCK, PAGE)


@triton.jit
def _register_row_kernel(scores, stride_r, out, lengths_out, N, W,
                         k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr,
                         page_size, n_recent, n_sink, min_seq, page_budget,
                         BITS: tl.constexpr, N_PAD: tl.constexpr, BLOCK_OUT: tl.constexpr,
                         HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, PAGE: tl.constexpr, USE_TABLE: tl.constexpr):
    """A row that fits in registers (N <= N_PAD): read it once, then every pass and the compaction work
    on the keys in registers. One launch, one read of the scores."""
    NB: tl.constexpr = 1 << BITS
    PASSES: tl.constexpr = 32 // BITS
    r = tl.program_id(0)
    start, end, k, sink_end, recent_start, n, sparse = _row_plan(
        r, N, W, k_scalar, k_ptr, len_ptr, budget_ptr, seq_ptr, mask_ptr, HAS_K, HAS_LEN, PAGE,
        page_size, n_recent, n_sink, min_seq, page_budget, USE_TABLE)
    j = tl.arange(0, N_PAD)
    valid = (j >= start) & (j < end)
    row = scores + r.to(tl.int64) * stride_r
    key = _sortable_key(tl.load(row + j, mask=valid, other=0.0).to(tl.float32), valid)
    bins = tl.arange(0, NB)
    k_eff = k
    k_rem = k
    prefix = tl.full([], 0, tl.uint32)
    for p in tl.static_range(PASSES):
        if p == 0:
            match = key != 0
        else:
            match = ((key >> (32 - BITS * p)) == (prefix >> (32 - BITS * p))) & (key != 0)
        digits = ((key >> (32 - BITS * (p + 1))) & (NB - 1)).to(tl.int32)
        h = tl.histogram(digits, NB, mask=match)
        if p == 0:
            k_eff = tl.minimum(k, tl.sum(h, axis=0))
            k_rem = k_eff
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        d = tl.max(tl.where(at_or_above >= k_rem, bins, -1), axis=0)
        k_rem = k_rem - tl.sum(tl.where(bins > d, h, 0), axis=0)
        prefix = prefix | (d.to(tl.uint32) << (32 - BITS * (p + 1)))
    gt = key > prefix
    eq = (key == prefix) & valid
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=0) - 1
    keep = (gt | (eq & (eq_rank < k_rem))) & (k_eff > 0)
    dest = sink_end + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    out_row = out + r.to(tl.int64) * W
    tl.store(out_row + dest, j, mask=keep & (dest < W))
    _emit_fixed(out_row, lengths_out, r, k_eff, sink_end, recent_start, n, sparse, W, BLOCK_OUT, PAGE)


@triton.jit
def _emit_winners(row, out_row, lo, hi, T, ties_needed, pos0, eq_seen, sink_end, W, BLOCK: tl.constexpr):
    """Ordered compaction of [lo, hi): keys > T, and keys == T while the tie quota lasts, in id order."""
    nxt = lo + tl.arange(0, BLOCK)  # prefetch: the next tile's load is issued before
    x_next = tl.load(row + nxt, mask=nxt < hi, other=0.0)  # this tile is processed
    for t in range(lo, hi, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        valid = offs < hi
        x = x_next
        nxt = offs + BLOCK
        x_next = tl.load(row + nxt, mask=nxt < hi, other=0.0)
        key = _sortable_key(x.to(tl.float32), valid)
        gt = key > T
        eq = (key == T) & valid
        if tl.max((gt | eq).to(tl.int32), axis=0) > 0:  # tiles without a winner skip the scans
            if tl.max(eq.to(tl.int32), axis=0) > 0:  # ties in this tile: rank them (lowest ids first)
                eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
                keep = gt | (eq & (eq_rank < ties_needed))
                eq_seen += tl.sum(eq.to(tl.int32), axis=0)
            else:
                keep = gt
            pos = pos0 + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            dest = sink_end + pos
            tl.store(out_row + dest, offs.to(tl.int32), mask=keep & (dest < W))
            pos0 += tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _emit_fixed(out_row, lengths_out, r, k_eff, sink_end, recent_start, n, sparse, W, BLOCK: tl.constexpr,
                PAGE: tl.constexpr):
    """Everything of a row that is not a history winner: -1 padding; in page mode sink/recent pages + length."""
    if PAGE:
        recent = n - recent_start
        filled = tl.where(sparse, sink_end + k_eff + recent, 0)
        tl.store(lengths_out + r, filled)
        for t in range(0, W, BLOCK):
            j = t + tl.arange(0, BLOCK)
            is_sink = sparse & (j < sink_end)
            rec = j - (sink_end + k_eff)
            is_recent = sparse & (rec >= 0) & (rec < recent)
            val = tl.where(is_sink, j, tl.where(is_recent, recent_start + rec, -1))
            tl.store(out_row + j, val, mask=(j < W) & (is_sink | is_recent | (j >= filled)))
    else:
        for t in range(0, W, BLOCK):
            j = t + tl.arange(0, BLOCK)
            tl.store(out_row + j, tl.full([BLOCK], -1, tl.int32), mask=(j < W) & (j >= k_eff))


@triton.jit
def _sort_winners_kernel(scores, stride_r, out, W, W_PAD: tl.constexpr):
    """Reorder one row's winners by score (descending), ties by ascending id: a sort inside one tile."""
    r = tl.program_id(0)
    j = tl.arange(0, W_PAD)
    out_row = out + r.to(tl.int64) * W
    ids = tl.load(out_row + j, mask=j < W, other=-1)
    valid = ids >= 0
    x = tl.load(scores + r.to(tl.int64) * stride_r + tl.where(valid, ids, 0), mask=valid, other=0.0)
    skey = _signed_key(x.to(tl.float32)).to(tl.int64)
    low = 0xFFFFFFFF - ids.to(tl.int64)  # larger for a lower id: ties go to the lower id
    packed = tl.where(valid, (skey << 32) | low, -9223372036854775807 - 1)
    packed = tl.sort(packed, descending=True)
    back = (0xFFFFFFFF - (packed & 0xFFFFFFFF)).to(tl.int32)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    tl.store(out_row + j, tl.where(j < n_valid, back, -1), mask=j < W)


# --------------------------------------------------------------------------------------------
# Launch helpers (shared with kernels/page_select.py)
# --------------------------------------------------------------------------------------------
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def launch_knobs(R: int) -> dict:
    """TUNING, adjusted for very few rows (measured on H200: wider tiles and warps win there)."""
    knobs = dict(TUNING)
    if R < 8:
        knobs.update(FEW_ROWS)
    return knobs


def plan_splits(R: int, N: int, device: torch.device, splits: int | None) -> tuple[int, int, int]:
    """(programs per row, chunk length, tile length). Rows are split only when rows alone can't fill the GPU."""
    on_gpu = device.type == "cuda"
    knobs = launch_knobs(R)
    if splits is None:
        if on_gpu and N > knobs["short_row"]:
            target = knobs["programs_per_sm"] * _sm_count(device)
            splits = max(1, min(triton.cdiv(N, knobs["min_chunk"]), triton.cdiv(target, max(R, 1)), 256))
        else:
            splits = 1
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise SparseRefError(f"topk: splits must be a positive int or None, got {splits!r}. Fix: pass e.g. splits=4.")
    splits = min(splits, max(N, 1))
    chunk = triton.cdiv(max(N, 1), splits)
    block = knobs["block"] if on_gpu else min(1024, max(16, triton.next_power_of_2(chunk)))
    chunk = triton.cdiv(chunk, block) * block if on_gpu else chunk
    splits = triton.cdiv(max(N, 1), chunk)
    return splits, chunk, block


def launch_select(scores, W, *, k_scalar=0, k_tensor=None, lengths=None, page=None, splits=None,
                  out=None, lengths_out=None):
    """Run the chain (zero histograms, radix passes, compaction) into ``out`` [R, W] int32.

    ``page`` is None for plain top-k, or a dict with the page-selection parameters.
    """
    R, N = scores.shape
    device = scores.device
    S, chunk, block = plan_splits(R, N, device, splits)
    dummy = out  # any tensor: pointers a variant does not read
    p = page or {}
    args = dict(
        k_scalar=int(k_scalar), k_ptr=k_tensor if k_tensor is not None else dummy,
        len_ptr=lengths if lengths is not None else dummy,
        budget_ptr=p.get("budget_table", dummy), seq_ptr=p.get("seq_lens", dummy), mask_ptr=p.get("sparse_mask", dummy),
        page_size=p.get("page_size", 1), n_recent=p.get("num_recent", 0), n_sink=p.get("num_sink", 0),
        min_seq=p.get("min_seq", 0), page_budget=p.get("page_budget", 0),
    )
    flags = dict(HAS_K=k_tensor is not None, HAS_LEN=lengths is not None, PAGE=page is not None,
                 USE_TABLE="budget_table" in p)
    num_warps = launch_knobs(R)["num_warps"] if device.type == "cuda" else 1
    if S == 1 and N <= TUNING["register_row"]:  # the row fits in registers: read it once
        n_pad = max(16, triton.next_power_of_2(N))
        warps = max(1, min(16, n_pad // 512)) if device.type == "cuda" else 1
        _register_row_kernel[(R,)](
            scores, scores.stride(0), out, lengths_out if lengths_out is not None else dummy, N, W, **args,
            BITS=RADIX_BITS, N_PAD=n_pad, BLOCK_OUT=min(1024, max(16, triton.next_power_of_2(W))), **flags,
            num_warps=warps)
        return out
    if S == 1:  # one program per row: the whole chain in one launch, looping over tiles
        _fused_row_kernel[(R,)](
            scores, scores.stride(0), out, lengths_out if lengths_out is not None else dummy, N, W, **args,
            BITS=RADIX_BITS, BLOCK=block, **flags, num_warps=TUNING["fused_num_warps"] if device.type == "cuda" else 1)
        return out
    hist = torch.zeros((NUM_PASSES, R, NUM_BINS), dtype=torch.int32, device=device)
    split_buf = torch.empty((R, S, 2, NUM_BINS), dtype=torch.int32, device=device)
    for pass_id in range(NUM_PASSES):
        _radix_pass_kernel[(R, S)](
            scores, scores.stride(0), hist, split_buf, R, N, W, chunk, S, **args,
            PASS=pass_id, BITS=RADIX_BITS, BLOCK=block, **flags, num_warps=num_warps)
    _compact_kernel[(R, S)](
        scores, scores.stride(0), hist, split_buf, out, lengths_out if lengths_out is not None else dummy,
        R, N, W, chunk, S, **args, BITS=RADIX_BITS, BLOCK=block, S_PAD=max(2, triton.next_power_of_2(S)),
        **flags, num_warps=num_warps)
    return out


def sort_winners(scores, out):
    """Reorder each row of ``out`` (ids, -1 padded) by descending score, ties by ascending id."""
    R, W = out.shape
    if R == 0 or W == 0:
        return out
    w_pad = max(2, triton.next_power_of_2(W))
    if scores.device.type != "cuda":
        num_warps = 1
    elif TUNING["sort_num_warps"]:
        num_warps = TUNING["sort_num_warps"]
    else:
        num_warps = 16 if w_pad >= 2048 else 8 if w_pad >= 512 else 4
    _sort_winners_kernel[(R,)](scores, scores.stride(0), out, W, W_PAD=w_pad, num_warps=num_warps)
    return out


def interpreted() -> bool:
    """True when Triton runs kernels through its interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def capturing() -> bool:
    """True while a CUDA graph is being captured: then no check may read device data."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_scores(name: str, scores, fn: str) -> None:
    """dtype, rank and stride checks for a [rows, N] score matrix."""
    if not isinstance(scores, torch.Tensor):
        raise ShapeError(f"{fn}: {name} must be a torch.Tensor of shape [rows, N], got {type(scores).__name__}. "
                         f"Fix: pass a 2-D float tensor.")
    if scores.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ShapeError(f"{fn}: {name} must have dtype float32, float16 or bfloat16, got {scores.dtype}. "
                         f"Fix: {name}.float().")
    if scores.dim() != 2:
        raise ShapeError(f"{fn}: {name} must be 2-D [rows, N], got shape {tuple(scores.shape)}. "
                         f"Fix: reshape to [rows, N].")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ShapeError(f"{fn}: {name} must have unit stride along its last dim, got strides {scores.stride()}. "
                         f"Fix: pass {name}.contiguous().")
    if scores.device.type != "cuda" and not (scores.device.type == "cpu" and interpreted()):
        raise ShapeError(f"{fn}: {name} must be on a CUDA device (CPU only under the Triton interpreter, "
                         f"TRITON_INTERPRET=1), got {scores.device}. Fix: move it with .cuda().")
    if scores.shape[1] >= 2**31 - 1:
        raise ShapeError(f"{fn}: rows longer than 2**31 - 2 are not supported, got N={scores.shape[1]}.")


def check_same_device(name: str, t: torch.Tensor, scores: torch.Tensor, fn: str) -> None:
    if t.device != scores.device:
        raise ShapeError(f"{fn}: {name} must be on the same device as scores ({scores.device}), got {t.device}. "
                         f"Fix: {name}.to(scores.device).")


# --------------------------------------------------------------------------------------------
# Public launcher
# --------------------------------------------------------------------------------------------
def topk(scores: torch.Tensor, k, lengths: torch.Tensor | None = None, *, order: str = "score",
         width: int | None = None, out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """Exact top-k ids per row: int32 ``[R, width]``, -1 padded; matches ``topk_reference``.

    ``k``: an int (then ``width = k`` and the call never syncs with the host: CUDA-graph safe),
    or an int tensor ``[R]`` (pass ``width``; without it, ``width = k.max()`` is read eagerly).
    ``lengths``: int32/int64 ``[R]`` valid lengths (None: every row is full).
    ``order``: ``"score"`` (descending score, ties by lower id), ``"index"`` (ascending ids) or
    ``"none"`` (the cheapest: here also ascending ids, since the compaction is ordered).
    ``splits``: programs per row (None: chosen from the GPU size; set it to force row splitting).
    """
    fn = "topk"
    check_scores("scores", scores, fn)
    if order not in ORDERS:
        raise SparseRefError(f"{fn}: order must be one of {ORDERS}, got {order!r}. Fix: order='score'.")
    R, N = scores.shape
    k_tensor = None
    if isinstance(k, torch.Tensor):
        if k.dtype not in (torch.int32, torch.int64) or k.dim() != 1 or k.shape[0] != R:
            raise ShapeError(f"{fn}: k as a tensor must be int32/int64 of shape [{R}], got dtype {k.dtype}, "
                             f"shape {tuple(k.shape)}. Fix: pass an int, or one k per row.")
        check_same_device("k", k, scores, fn)
        if width is None:
            if capturing():
                raise SparseRefError(f"{fn}: with a per-row k tensor, width must be given while a CUDA graph "
                                     f"captures (reading k.max() would sync). Fix: pass width=<max k>.")
            width = int(k.max()) if R else 0
        if not capturing() and R and int(k.min()) < 0:
            raise SparseRefError(f"{fn}: k must be >= 0 in every row, got min {int(k.min())}. Fix: clamp k at 0.")
        k_tensor = k.contiguous()
        k_scalar = 0
    else:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SparseRefError(f"{fn}: k must be an int >= 0 (or an int tensor [R]), got {k!r}. "
                                 f"Fix: pass k=min(k, N) or a non-negative int.")
        k_scalar = k
        width = k if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise SparseRefError(f"{fn}: width must be an int >= 0, got {width!r}. Fix: pass width=k.")
    if order == "score" and width > MAX_SORT_WIDTH:
        raise SparseRefError(f"{fn}: order='score' sorts the winners inside one tile of at most {MAX_SORT_WIDTH}, "
                             f"got width {width}. Fix: use order='index', or k <= {MAX_SORT_WIDTH}.")
    if lengths is not None:
        if not isinstance(lengths, torch.Tensor) or lengths.dtype not in (torch.int32, torch.int64) \
                or lengths.dim() != 1 or lengths.shape[0] != R:
            raise ShapeError(f"{fn}: lengths must be an int32/int64 tensor of shape [{R}], got "
                             f"{getattr(lengths, 'dtype', type(lengths).__name__)} "
                             f"{tuple(getattr(lengths, 'shape', ()))}. Fix: one valid length per row, or None.")
        check_same_device("lengths", lengths, scores, fn)
        if R and not capturing():
            lo, hi = int(lengths.min()), int(lengths.max())
            if lo < 0 or hi > N:
                raise SparseRefError(f"{fn}: lengths must lie in [0, {N}] (the row length), got min {lo}, max {hi}. "
                                     f"Fix: clamp lengths to [0, scores.shape[1]].")
        lengths = lengths.contiguous()
    if out is None:
        out = torch.empty((R, width), dtype=torch.int32, device=scores.device)
    elif not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape) != (R, width) \
            or not out.is_contiguous() or out.device != scores.device:
        raise ShapeError(f"{fn}: out must be a contiguous int32 tensor of shape ({R}, {width}) on {scores.device}, "
                         f"got {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}. "
                         f"Fix: pass out=None.")
    if R == 0 or width == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    launch_select(scores, width, k_scalar=k_scalar, k_tensor=k_tensor, lengths=lengths, splits=splits, out=out)
    if order == "score":
        sort_winners(scores, out)
    return out
