"""The exact fallback of the top-k for rows whose candidates do not fit the slots (plateaus and
clusters of equal values, a period of G, more than half the row wanted), chosen on the device.

Most such rows overflow because many keys EQUAL the threshold ``T``. At least k keys are >= T, so if
fewer than k are > T, ``T`` is the k-th key and the answer is "every key > T, plus the lowest-id keys
== T". The candidates programs of ``kernels/topk.py`` count both in every chunk; an overflowing row's
select program turns the counts into offsets (``_plan_tie_path``), then every chunk program of the
finish launch writes its share at those offsets in parallel (the *tie path*, ``_tie_path_span``).
(``T`` is the k-th delegate cut to 16 bits, or exact when many delegates share those bits, so that
plateaus at any value have their ties at ``T``.) Rows with k or more keys above ``T`` (e.g. a period of
G) take the whole-row radix select (``_radix_select_row``). Used by ``kernels/topk.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk_common import (
    AOT_FLAGS,
    AOT_PTRS,
    HEAD,
    NEED,
    T_,
    TE,
    _keys,
    _pad,
    _row_k_len,
    _walk,
    _write_above_and_ties,
    aot_variant,
)


@triton.jit
def _plan_tie_path(work_row, k, C, C_PAD: tl.constexpr):
    """The plan of an overflowing row (its select program), from the counts every chunk program of the
    candidates launch stored: its keys > T and == T. At least k keys are >= T, so if fewer than k are
    > T, the k-th key IS T: a prefix sum over the chunks gives each chunk's offsets, no pass over the
    row. Returns (T, flag): 2 = the tie path, 1 = the whole-row radix select (k or more keys > T, or
    T = NONE: fewer than k delegates)."""
    te = tl.load(work_row + T_)
    ci = tl.arange(0, C_PAD)
    a = tl.load(work_row + HEAD + 2 * C_PAD + ci, mask=ci < C, other=0)
    e = tl.load(work_row + HEAD + 3 * C_PAD + ci, mask=ci < C, other=0)
    above = tl.sum(a, axis=0)
    tl.debug_barrier()  # every thread has read the counts before they become offsets
    tl.store(work_row + HEAD + 2 * C_PAD + ci, tl.cumsum(a, axis=0) - a, mask=ci < C)
    tl.store(work_row + HEAD + 3 * C_PAD + ci, tl.cumsum(e, axis=0) - e, mask=ci < C)
    tl.store(work_row + NEED, k - above)
    return te, tl.where((te != -2147483648) & (k > 0) & (above < k), 2, 1)


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
def _tie_path_span(row, length, k, work_row, out_row, f, W, SPAN: tl.constexpr, CHUNK: tl.constexpr,
                   C_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Span f (SPAN columns, whole chunks) of a tie-path row (flag 2): store its keys > T and its share of
    the lowest-id keys == T at the offsets the select kernel planned for its first chunk (every span
    independent of the others, ids ascending). Every load goes out at once (one round trip per
    program); the program of span 0 also pads the row (the tie path writes exactly k ids)."""
    c = f * (SPAN // CHUNK)  # the span's first chunk
    te = tl.load(work_row + TE)
    need = tl.load(work_row + NEED)
    above_before = tl.load(work_row + HEAD + 2 * C_PAD + c)
    ties_before = tl.load(work_row + HEAD + 3 * C_PAD + c)
    offs = f * SPAN + tl.arange(0, SPAN)
    key = _keys(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
    _write_above_and_ties(key, offs, te, need, ties_before, out_row, above_before + tl.minimum(ties_before, need), W)
    if f == 0:
        _pad(out_row, k, W, BLOCK)


@triton.jit
def _whole_row_kernel(scores, stride_r, out, N, W, k_scalar, k_ptr, len_ptr,
                      HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr):
    """One program = one row: the whole-row radix select (k too wide for the delegates)."""
    r = tl.program_id(0)
    k, length = _row_k_len(r, N, W, k_scalar, k_ptr, len_ptr, HAS_K, HAS_LEN)
    _radix_select_row(scores + r.to(tl.int64) * stride_r, length, k, out + r.to(tl.int64) * W, W, BLOCK)


AOT_VARIANTS = [
    aot_variant(_whole_row_kernel, dict(**f, BLOCK=1024), **AOT_PTRS) for f in AOT_FLAGS]
