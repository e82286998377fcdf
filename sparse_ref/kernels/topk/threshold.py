"""Launch 1 of the long-row top-k (``sparse_ref.kernels.topk``): the delegates of each row and its threshold T.

Delegate ``j`` of a row is the largest of its strided elements ``j, j + G, j + 2G, ...``: one plain
read of the row, a maximum per column of its ``[N / G, G]`` view. The k-th largest delegate is a row
element with at least k row elements at or above it, so ``T`` (a lower bound of it, found in histogram
rounds over the delegates) keeps the whole top-k among the elements ``>= T``: the candidates of the
next launch. The row's last program to finish (an atomic counter it resets) stores ``T`` and the bin
width of the select program's histogram, so nothing goes back to the host.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk.common import (
    DHIST,
    SHIFT,
    SYNC,
    T_,
    TMAX,
    after_previous_launch,
    bin_shift,
    delegates_of,
    exact_delegate,
    key_range,
    keys_of,
    narrow_window,
    radix_rounds,
    row_k_len,
    walk_histogram,
    work_row_of,
)


@triton.jit
def delegates_kernel(scores, stride_r, work, sync, N, W, k, lengths,
                      G: tl.constexpr, COLS: tl.constexpr,
                      ROWS: tl.constexpr, LOG_C: tl.constexpr, LOCAL: tl.constexpr, PDL: tl.constexpr):
    """One program = COLS delegate columns of one row (max over the strided [N/G, COLS] slice); then T.
    LOCAL (at most ``TUNING["local_threshold"]`` programs per row): each program finds its own threshold
    and T is the highest of them that k delegates reach (``_local_threshold``). Else each program adds
    the histogram of its delegates' top 8 bits to the row's and the row's last program finds the k-th
    delegate (``_row_threshold``). Either way at least k delegates reach T (NONE if the row has fewer than
    k), and the row's last program sets the width 2**SHIFT of the select program's histogram bins (256
    bins cover [T, row max])."""
    after_previous_launch(PDL)
    C_PAD: tl.constexpr = 1 << LOG_C
    S: tl.constexpr = G // COLS  # programs per row
    r = tl.program_id(0) // S  # row-major order: a row's programs run together, the last rows last
    c = tl.program_id(0) % S
    k, length = row_k_len(r, N, W, k, lengths)
    row = scores + r.to(tl.int64) * stride_r
    work_row = work_row_of(work, r, LOG_C, G)
    delegates = delegates_of(work_row, C_PAD)
    cols = c * COLS + tl.arange(0, COLS)
    acc = tl.full([COLS], -2147483648, tl.int32)
    for i in range(0, tl.cdiv(N, G), ROWS):
        offs = (i + tl.arange(0, ROWS))[:, None] * G + cols[None, :]
        x = tl.load(row + offs, mask=offs < length, other=0.0)
        acc = tl.maximum(acc, tl.max(keys_of(x, offs < length), axis=0))
    tl.store(delegates + cols, acc)
    sync_row = sync + r.to(tl.int64) * SYNC
    if LOCAL:  # T from the programs' own thresholds: no histogram round over the G delegates at the end
        _local_threshold(acc, k, c, sync_row, work_row, delegates, G, S)
    else:
        _row_threshold(acc, k, sync_row, work_row, delegates, G, S)


@triton.jit
def _local_threshold(acc, k, c, sync_row, work_row, delegates, G: tl.constexpr, S: tl.constexpr):
    """T from the programs' own delegates (LOCAL), with no histogram round over the G delegates at the end.
    Program c finds T_c, the lower edge of the bin holding the ceil(k / S)-th largest of its delegates, in
    histogram rounds over the delegates' own range (``narrow_window``: one round on random rows; more, up to the
    exact value, while over k / 8 too many delegates share the bin). So it holds ceil(k / S) delegates
    >= T_c, and the lowest T_c is reached by at least S * ceil(k / S) >= k delegates, each a row element:
    T = the lowest T_c would do. The row's last program takes the highest T_c that k delegates reach
    instead (one count over the G delegates per T_c): on a sorted row the programs' T_c differ widely and
    the lowest lets far more keys through; on a row with a cluster of equal values that one program's T_c
    sits on, T is the cluster's value, so the row keeps its ties at T (the tie path). T_c goes through the
    row's pair scratch, the row max through an atomic maximum (``TMAX``)."""
    k_c = tl.cdiv(k, S)
    ok = acc != -2147483648
    n_c = tl.sum(ok.to(tl.int32), axis=0)
    lo, top = key_range(acc, ok)
    t_c, _, _, _ = narrow_window(acc, ok, n_c, tl.maximum(tl.minimum(k_c, n_c), 1), lo, top, k_c // 8, True,
                           4)  # rounds until at most k_c + k_c / 8 delegates reach t_c (or t_c is exact)
    scratch = delegates + G  # (the pair scratch: free until the select launch)
    tl.store(scratch + c, tl.where(n_c >= k_c, t_c, -2147483648))  # (NONE: fewer than k_c here)
    tl.atomic_max((sync_row + TMAX).to(tl.pointer_type(tl.uint32)),
                  (top ^ -2147483648).to(tl.uint32, bitcast=True), sem="relaxed")
    tl.debug_barrier()  # every thread's stores and atomics happen before the counter says "done"
    if tl.atomic_add(sync_row, 1, sem="acq_rel") == S - 1:
        tl.store(sync_row, 0)  # reset the counter and the row max for the next call (CUDA-graph replays)
        top = tl.load(sync_row + TMAX, cache_modifier=".cg")
        tc = tl.load(scratch + tl.arange(0, S), cache_modifier=".cg")
        dkey = tl.load(delegates + tl.arange(0, G), cache_modifier=".cg")
        tl.store(sync_row + TMAX, 0)
        reach = tl.sum((dkey[:, None] >= tc[None, :]).to(tl.int32), axis=0)  # delegates >= each T_c
        T = tl.max(tl.where(reach >= k, tc, -2147483648), axis=0)  # (the lowest T_c always qualifies)
        _store_threshold(work_row, tl.where(k > 0, T, 2147483647), top ^ -2147483648)  # k = 0: no candidates


@triton.jit
def _row_threshold(acc, k, sync_row, work_row, delegates, G: tl.constexpr, S: tl.constexpr):
    """T from all G delegates of the row: each program adds its delegates' histogram of radix round 1 to
    the row's; the row's last program walks it and finishes (``_kth_delegate``)."""
    h = tl.histogram(((acc ^ -2147483648) >> 24) & 0xFF, 256, mask=acc != -2147483648)  # radix round 1
    tl.atomic_add(sync_row + DHIST + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")
    tl.debug_barrier()  # every thread's store happens before the counter says "done"
    if tl.atomic_add(sync_row, 1, sem="acq_rel") == S - 1:
        tl.store(sync_row, 0)  # reset the counter and the histogram for the next call (CUDA-graph replays)
        h = tl.load(sync_row + DHIST + tl.arange(0, 256), cache_modifier=".cg")
        tl.store(sync_row + DHIST + tl.arange(0, 256), tl.zeros([256], tl.int32))
        dkey = tl.load(delegates + tl.arange(0, G), cache_modifier=".cg")
        T = tl.where(k > 0, _kth_delegate(h, dkey, k), 2147483647)  # k = 0: no candidates at all
        _store_threshold(work_row, T, tl.max(dkey, axis=0))  # (the row max is the largest delegate)


@triton.jit
def _kth_delegate(h, dkey, k):
    """T from the G delegates ``dkey`` and the histogram ``h`` of their top 8 bits: the k-th delegate
    cut to 16 bits (radix round 2), exact (``exact_delegate``) when more than k + k/8 delegates reach the
    cut; NONE when there are fewer than k delegates."""
    n = tl.sum(h, axis=0)  # valid delegates
    d, k_rem = walk_histogram(h, tl.maximum(tl.minimum(k, n), 1))
    ut, k_rem = radix_rounds(dkey, d << 24, k_rem, 1, 2)
    if tl.sum((dkey >= (ut ^ -2147483648)).to(tl.int32), axis=0) > k + k // 8:  # many share its 16 bits:
        ut = exact_delegate(dkey, ut, k_rem)  # T = the exact k-th delegate
    return tl.where(n >= k, ut ^ -2147483648, -2147483648)


@triton.jit
def _store_threshold(work_row, T, row_max):
    """Store T and the width 2**SHIFT of the select program's histogram bins (256 bins cover [T, row max])."""
    tl.store(work_row + T_, T)
    tl.store(work_row + SHIFT, bin_shift(T, row_max))
