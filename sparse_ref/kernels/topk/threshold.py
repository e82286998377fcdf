"""Launch 1 of the long-row top-k (``docs/topk.md``, steps 2-3): the delegates of each row (the maximum of every column
of its ``[N / G, G]`` view, one plain read) and its threshold T, which at least k row elements reach. The row's last
program stores T and the select histogram's bin width: nothing goes back to the host."""

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
    key_range,
    keys_of,
    narrow_window,
    row_k_len,
    walk_histogram,
    work_row_of,
)


@triton.jit
def delegates_kernel(scores, stride_r, work, sync, N, W, k, lengths,
                      G: tl.constexpr, COLS: tl.constexpr,
                      ROWS: tl.constexpr, LOG_C: tl.constexpr, LOCAL: tl.constexpr, PDL: tl.constexpr):
    """One program = COLS delegate columns of one row; then T. LOCAL (few programs a row): each finds its own threshold
    (``_local_threshold``); else each adds its delegates' top-8-bit histogram to the row's and the last program finds
    the k-th delegate (``_row_threshold``). T is NONE when the row has fewer than k delegates."""
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
    """T from the programs' own delegates: program c finds T_c, the edge of the bin holding the ceil(k / S)-th of its
    delegates (window rounds). The lowest T_c is reached by at least k delegates; the row's last program takes the
    highest T_c that k delegates reach (tighter on sorted rows; on a cluster, the cluster's value, so its ties sit at
    T). T_c passes through the pair scratch, the row max through an atomic maximum (``TMAX``)."""
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
    """T from all G delegates: each program adds the histogram of its delegates' top 8 bits to the row's; the last
    program walks it to the bin of the k-th delegate, then window rounds over that bin's delegates stop at an edge that
    at most k/8 delegates beyond the k-th reach (the k-th itself on a plateau). NONE: fewer than k delegates."""
    h = tl.histogram(((acc ^ -2147483648) >> 24) & 0xFF, 256, mask=acc != -2147483648)
    tl.atomic_add(sync_row + DHIST + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")
    tl.debug_barrier()  # every thread's store happens before the counter says "done"
    if tl.atomic_add(sync_row, 1, sem="acq_rel") == S - 1:
        tl.store(sync_row, 0)  # reset the counter and the histogram for the next call (CUDA-graph replays)
        h = tl.load(sync_row + DHIST + tl.arange(0, 256), cache_modifier=".cg")
        tl.store(sync_row + DHIST + tl.arange(0, 256), tl.zeros([256], tl.int32))
        dkey = tl.load(delegates + tl.arange(0, G), cache_modifier=".cg")
        n = tl.sum(h, axis=0)  # valid delegates
        d, k_rem = walk_histogram(h, tl.maximum(tl.minimum(k, n), 1))
        member = (dkey != -2147483648) & ((((dkey ^ -2147483648) >> 24) & 0xFF) == d)
        lo, hi = key_range(dkey, member)
        T, _, _, _ = narrow_window(dkey, member, tl.sum(member.to(tl.int32), axis=0), k_rem, lo, hi, k // 8, True, 3)
        T = tl.where(n >= k, T, -2147483648)
        _store_threshold(work_row, tl.where(k > 0, T, 2147483647), tl.max(dkey, axis=0))  # k = 0: no candidates


@triton.jit
def _store_threshold(work_row, T, row_max):
    """Store T and the width 2**SHIFT of the select histogram's 256 bins over [T, row max]."""
    tl.store(work_row + T_, T)
    tl.store(work_row + SHIFT, bin_shift(T, row_max))
