"""The exact fallback of the top-k for rows whose candidates do not fit the slots (plateaus and
clusters of equal values, a period of G, more than half the row wanted), chosen on the device.

Most such rows overflow because many keys EQUAL the threshold ``T``. At least k keys are >= T, so if
fewer than k are > T, ``T`` is the k-th key and the answer is "every key > T, plus the lowest-id keys
== T". The candidates programs (``kernels/topk_select.py``) count both in every chunk; every select
program of an overflowing row turns the counts into its span's offsets (``_plan_tie_path``) and writes
its share (the *tie path*, ``_tie_path_span``), reading only the chunks that hold something to write (a
plateau's answer is its first k ties: the rest of the row is never read again). (``T`` is the lower edge
of a window round's bin, or the k-th delegate cut to 16 bits when a row has many delegates programs, and
the exact k-th delegate when many delegates share the bin or the bits, so that plateaus at any value
have their ties at ``T``.) Rows with k or more keys above ``T`` (scores of a few distinct values, whose
top value has more keys than delegates) copy those keys into the slots when they fit (the runs mode:
``_above_to_slots``; the bitmask mode: the tie path's code with no ties wanted), and the row's last
select program selects among them; when they do not (e.g. a period of G), the row takes the whole-row
radix select (``_radix_select_row``: one program per row, slow). Used by the select launch, and by
``kernels/topk.py`` when k is too wide for the delegates (``_whole_row_kernel``)."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk_common import (
    AOT_PTRS,
    AOT_ROWS,
    CNT2,
    HEAD,
    T_,
    _keys,
    _pad,
    _row_k_len,
    _walk,
    _write_above_and_ties,
    aot_variant,
)


@triton.jit
def _plan_tie_path(work_row, k, C, SLOTS: tl.constexpr, C_PAD: tl.constexpr):
    """The plan of an overflowing row, from the counts every chunk program of the candidates launch
    stored: its keys > T (``above``) and == T (``ties``), per chunk. At least k keys are >= T, so if
    fewer than k are > T, the k-th key IS T and the answer is every key > T plus the ``need`` lowest-id
    keys == T: sums over the chunks give any tile's offsets, no pass over the row. Every program of the
    row computes the plan itself (nothing is written, so no program waits for another). Returns (T, need,
    flag, above, ties). flag 2 = the tie path; 3 = k or more keys > T, and they fit the slots: copy them
    there and select among them (the candidates of the threshold T + 1); 1 = the whole-row radix select
    (more keys > T than slots, or T = NONE: fewer than k delegates)."""
    te = tl.load(work_row + T_)
    ci = tl.arange(0, C_PAD)
    above = tl.load(work_row + HEAD + ci, mask=ci < C, other=0)
    ties = tl.load(work_row + HEAD + C_PAD + ci, mask=ci < C, other=0)
    n_above = tl.sum(above, axis=0)
    flag = tl.where((te != -2147483648) & (k > 0) & (n_above < k), 2, tl.where(n_above <= SLOTS, 3, 1))
    return te, k - n_above, flag, above, ties


@triton.jit
def _busy_columns(busy, f, length, SPAN: tl.constexpr, CHUNK: tl.constexpr, C_PAD: tl.constexpr):
    """The columns [lo, hi) of span f between its first and last chunk flagged ``busy`` (chunk-aligned)."""
    c = tl.arange(0, C_PAD)
    lo = tl.maximum(f * SPAN, tl.min(tl.where(busy, c, C_PAD), axis=0) * CHUNK)
    hi = tl.minimum(tl.minimum((f + 1) * SPAN, length), (tl.max(tl.where(busy, c, -1), axis=0) + 1) * CHUNK)
    return lo, hi


@triton.jit
def _row_histogram(row, length, ut, k_rem, P: tl.constexpr, BLOCK: tl.constexpr):
    """Radix round P over a row in memory (tile loop): the next digit of the k-th key and the new k_rem."""
    h = tl.zeros([256], tl.int32)
    for t in range(0, length, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        key = _keys(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
        u = key ^ -2147483648
        match = key != -2147483648
        if P > 0:
            match = match & ((u >> (32 - 8 * P)) == (ut >> (32 - 8 * P)))
        h += tl.histogram((u >> (24 - 8 * P)) & 0xFF, 256, mask=match)
    d, k_rem = _walk(h, k_rem)
    return ut | (d << (24 - 8 * P)), k_rem


@triton.jit
def _radix_select_row(row, length, k, out_row, W, BLOCK: tl.constexpr):
    """Exact top-k of a row in memory by one program: 4 radix histogram rounds over the whole row, then
    an ordered compaction (the last resort: rows that defeat the delegates, or k too wide for them)."""
    valid_count = tl.zeros([], tl.int32)
    for t in range(0, length, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        valid_count += tl.sum((_keys(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
                               != -2147483648).to(tl.int32), axis=0)
    k_eff = tl.minimum(k, valid_count)
    ut = tl.zeros([], tl.int32)
    k_rem = tl.maximum(k_eff, 1)
    for p in tl.static_range(4):
        ut, k_rem = _row_histogram(row, length, ut, k_rem, p, BLOCK)
    _write_row(row, tl.where(k_eff > 0, length, 0), ut ^ -2147483648, k_rem, out_row, W, BLOCK)
    _pad(out_row, k_eff, W, BLOCK)


@triton.jit
def _write_row(row, length, t, need, out_row, W, BLOCK: tl.constexpr):
    """One program stores, in ascending id order, the ids of a row's keys > t and of its first ``need``
    keys == t (tile loop over the row)."""
    done = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for t0 in range(0, length, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        key = _keys(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
        done += _write_above_and_ties(key, offs, t, need, ties_seen, out_row, done, W)
        ties_seen += tl.sum((key == t).to(tl.int32), axis=0)


@triton.jit
def _tie_path_span(row, length, te, need, above, ties, out_row, f, W, SPAN: tl.constexpr, TILE: tl.constexpr,
                   CHUNK: tl.constexpr, C_PAD: tl.constexpr):
    """Span f (SPAN columns, whole chunks) of a tie-path row: store, tile by tile, its keys > T and its
    share of the lowest-id keys == T at the offsets the plan gives (every tile independent of the others,
    ids ascending). Only the columns between the row's first and last chunk with something to store are
    read: a chunk with no key > T and no tie the row still needs (plateaus need only their first ties)
    is skipped."""
    c = tl.arange(0, C_PAD)
    lo, hi = _busy_columns((above > 0) | ((tl.cumsum(ties, axis=0) - ties < need) & (ties > 0)), f, length, SPAN,
                           CHUNK, C_PAD)
    counts = (above.to(tl.int64) << 32) | ties  # keys > T | keys == T, per chunk: one sum per tile
    for t0 in range(lo, hi, TILE):
        before = tl.sum(tl.where(c * CHUNK < t0, counts, 0), axis=0)
        above_before = (before >> 32).to(tl.int32)
        ties_before = (before & 0xFFFFFFFF).to(tl.int32)
        offs = t0 + tl.arange(0, TILE)
        key = _keys(tl.load(row + offs, mask=offs < hi, other=0.0), offs < hi)
        _write_above_and_ties(key, offs, te, need, ties_before, out_row, above_before + tl.minimum(ties_before, need),
                              W)


@triton.jit
def _above_to_slots(row, length, te, above, cand_row, work_row, sync_row, f, SPAN: tl.constexpr, TILE: tl.constexpr,
                    CHUNK: tl.constexpr, C_PAD: tl.constexpr):
    """Span f of an overflowing row whose keys > T fit the slots (flag 3, runs mode): copy them into the slots
    as the candidates launch copies its candidates (each tile a run of slots from the row's second slot
    counter, ascending ids; every chunk's count and first slot), so that the row's last program can
    select among them. Chunks without keys > T get empty runs and are not read."""
    c = tl.arange(0, C_PAD)
    start = c * CHUNK  # each chunk's first column
    tl.store(work_row + HEAD + 2 * C_PAD + c, 0, mask=(start >= f * SPAN) & (start < (f + 1) * SPAN))
    tl.debug_barrier()  # (the tiles below overwrite some of these zeros)
    lo, hi = _busy_columns(above > 0, f, length, SPAN, CHUNK, C_PAD)
    for t0 in range(lo, hi, TILE):
        offs = t0 + tl.arange(0, TILE)
        key = _keys(tl.load(row + offs, mask=offs < hi, other=0.0), offs < hi)
        is_above = key > te
        n_in = tl.where((start >= t0) & (start < t0 + TILE) & (start < hi), above, 0)  # the tile's chunks
        base = tl.atomic_add(sync_row + CNT2, tl.sum(n_in, axis=0), sem="relaxed")
        tl.store(work_row + HEAD + 2 * C_PAD + c, n_in, mask=n_in > 0)
        tl.store(work_row + HEAD + 3 * C_PAD + c, base + tl.cumsum(n_in, axis=0) - n_in, mask=n_in > 0)
        tl.store(cand_row + base + tl.cumsum(is_above.to(tl.int32), axis=0) - 1,
                 (key.to(tl.int64) << 32) | offs.to(tl.int64), mask=is_above)


@triton.jit
def _whole_row_kernel(scores, stride_r, out, N, W, k, lengths, BLOCK: tl.constexpr):
    """One program = one row: the whole-row radix select (k too wide for the delegates)."""
    r = tl.program_id(0)
    k, length = _row_k_len(r, N, W, k, lengths)
    _radix_select_row(scores + r.to(tl.int64) * stride_r, length, k, out + r.to(tl.int64) * W, W, BLOCK)


AOT_VARIANTS = [
    aot_variant(_whole_row_kernel, dict(**rc, BLOCK=1024), **rt, **AOT_PTRS) for rt, rc in AOT_ROWS]
