"""The whole top-k of one row held in registers by one program: the short rows of the top-k (``short_row_kernel``) and
the page histories of ``sparse_ref.kernels.page_select``. Two plans, chosen on the host (``use_direct``):
``select_direct`` (window rounds over the whole row, cost nearly independent of k: rows where k is a large share) and
``select_in_registers`` (the long rows' delegate threshold, in registers: cheaper when k is small against the row).
``docs/topk.md`` has the design."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk.common import (
    bitmask_words,
    key_range,
    keys_of,
    narrow_window,
    pad_row,
    pairwise_kth,
    row_k_len,
    walk_histogram,
    words_to_slots,
    write_above_and_ties,
)


def use_direct(n_pad: int, G: int, ratio: int) -> bool:
    """Whether a row of ``n_pad`` scores takes ``select_direct`` (else the delegates plan with ``G`` delegates): when
    the delegates would keep at least 1/ratio of the row they save little."""
    return n_pad <= ratio * G


def direct_mode(direct: bool, value_bins: int) -> int:
    """The DIRECT constexpr: 0 the delegates plan, else ``select_direct`` with a first round of DIRECT value bins
    (1: none)."""
    return max(1, value_bins) if direct else 0


@triton.jit
def value_round(x, ok, n, k_rem, BINS: tl.constexpr):
    """The direct plan's first round on the float values: BINS equal-width bins over [min, max] of the ``ok`` values,
    walked to the bin of the k_rem-th largest; returns ``(member, m, k_rem)``. Key bins are coarse where a row spans
    both signs; value bins keep a few hundredths of the row. Halves, a difference and a positive scale round
    monotonically, so a larger key never gets a lower bin. Skipped (every ok key kept) on +inf, all-equal rows, or a
    span below 2**-99 (the scale would overflow)."""
    lo = tl.min(tl.where(ok, x, float("inf")), axis=0)
    hi = tl.max(tl.where(ok, x, float("-inf")), axis=0)
    finite = (hi <= 3.4028234663852886e38) & (lo <= hi)  # (-inf is never ok; no ok key: lo > hi)
    lo, hi = tl.where(finite, lo, 0.0), tl.where(finite, hi, 0.0)
    half = hi * 0.5 - lo * 0.5  # half the span: no overflow, even from -FLT_MAX to FLT_MAX
    usable = finite & (half >= 7.888609052210118e-31)  # 2**-100
    member, m = ok, n + tl.zeros([], tl.int32)
    k_rem = k_rem + tl.zeros([], tl.int32)
    if usable:
        scale = (BINS / 2) / half
        b = tl.minimum(((tl.where(ok, x, lo) * 0.5 - lo * 0.5) * scale).to(tl.int32), BINS - 1)  # (0 to BINS)
        d, k_rem = walk_histogram(tl.histogram(b, BINS, mask=ok), k_rem)
        member = ok & (b == d)
        m = tl.sum(member.to(tl.int32), axis=0)
    return member, m, k_rem


@triton.jit
def _gather_hits(row, hit, count, scratch, N_PAD: tl.constexpr, SLOTS: tl.constexpr):
    """``(ids, keys)`` [SLOTS] of the ``count`` <= SLOTS columns where ``hit`` is set, ascending (then NONE keys): ids
    through bitmask words into ``scratch`` (no prefix sum over the row), keys from ``row``."""
    words_to_slots(bitmask_words(hit, N_PAD // 32), tl.arange(0, N_PAD // 32), tl.zeros([], tl.int32), scratch, 0)
    tl.debug_barrier()
    s = tl.arange(0, SLOTS)
    ids = tl.load(scratch + s, mask=s < count, other=0, cache_modifier=".cg")
    return ids, keys_of(tl.load(row + ids, mask=s < count, other=0.0), s < count)


@triton.jit
def _kth_key(key, member, m, k_rem, lo, hi, scratch, PAIR: tl.constexpr):
    """``(t, ties)``: the k_rem-th largest of the m ``member`` keys in [lo, hi] and how many keys equal to ``t`` it
    takes: window rounds until at most PAIR remain (else they ran to one key value: t is it), then a pairwise rank of
    those (``scratch``: PAIR free int32)."""
    t, member, m, k_rem = narrow_window(key, member, m, k_rem, lo, hi, PAIR, False, 4)
    if PAIR > 0:
        if m <= PAIR:
            tl.debug_barrier()  # every thread's reads of the scratch are done
            tl.store(scratch + tl.cumsum(member.to(tl.int32), axis=0) - 1, key, mask=member)
            tl.debug_barrier()
            t, k_rem = pairwise_kth(scratch, m, k_rem, PAIR)
    return t, k_rem


@triton.jit
def _kth_in_bin(row, member, m, k_rem, scratch, N_PAD: tl.constexpr, PAIR: tl.constexpr):
    """``_kth_key`` of the m <= PAIR ``member`` keys of a row in registers: their keys gathered (``_gather_hits``), then
    window rounds on those few down to 16 and a pairwise rank of the 16."""
    s = tl.arange(0, PAIR)
    _, key = _gather_hits(row, member, m, scratch, N_PAD, PAIR)
    lo, hi = key_range(key, s < m)
    return _kth_key(key, s < m, m, k_rem, lo, hi, scratch, 16)


@triton.jit
def select_direct(row, lo, hi, k, out_row, base, W, scratch_row, N_PAD: tl.constexpr, PAIR: tl.constexpr,
                  VALUE_BINS: tl.constexpr, ALL: tl.constexpr = False):
    """The k largest among columns [lo, hi) of a row held in registers, ids ascending at out_row[base:], ties to the
    lower id; returns min(k, valid keys). The exact k-th key ``t``: a value round (VALUE_BINS > 1), window rounds over
    the kept keys' own range until at most PAIR remain (or one key value), then ``_kth_in_bin``. One prefix sum of
    ``(key > t) << 16 | (key == t)`` then gives every key both of its ranks (N_PAD <= 2**14 keeps it below 2**31): its
    place is the keys > t before it plus the ties before it, capped at the ties the row takes. ALL (k at least the
    row's width: every valid key wins) skips the rounds."""
    tl.static_assert(N_PAD <= 16384)  # (the packed prefix sum: no int32 overflow)
    j = tl.arange(0, N_PAD)
    valid = (j >= lo) & (j < hi)
    x = tl.load(row + j, mask=valid, other=0.0).to(tl.float32)
    key = keys_of(x, valid)
    ok = key != -2147483648
    n = tl.sum(ok.to(tl.int32), axis=0)
    k_eff = tl.minimum(k, n)
    if ALL:  # every valid key wins: all are above NONE, no ties wanted
        t, k_rem = tl.full([], -2147483648, tl.int32), tl.zeros([], tl.int32)
    else:
        if VALUE_BINS > 1:
            member, m, k_rem = value_round(x, ok, n, tl.maximum(k_eff, 1), VALUE_BINS)
        else:
            member, m, k_rem = ok, n, tl.maximum(k_eff, 1) + tl.zeros([], tl.int32)
        t = tl.zeros([], tl.int32)
        if m > PAIR:  # key rounds over the kept keys' own range until at most PAIR remain (or one key value: t)
            key_lo, key_hi = key_range(key, member)
            t, member, m, k_rem = narrow_window(key, member, m, k_rem, key_lo, key_hi, PAIR, False, 4)
        if PAIR > 0:
            if m <= PAIR:
                t, k_rem = _kth_in_bin(row, member, m, k_rem, scratch_row, N_PAD, PAIR)
    t = tl.where(k_eff > 0, t, 2147483647)  # k_eff = 0: nothing is above INT32_MAX, no ties wanted
    ties = tl.where(k_eff > 0, k_rem, 0)
    gt, eq = key > t, key == t
    c = tl.cumsum((gt.to(tl.int32) << 16) | eq.to(tl.int32), axis=0)
    eq_upto = c & 0xFFFF
    pos = ((c >> 16) & 0xFFFF) - gt.to(tl.int32) + tl.minimum(eq_upto - eq.to(tl.int32), ties)
    tl.store(out_row + base + pos, j, mask=(gt | (eq & (eq_upto <= ties))) & (base + pos < W))
    return k_eff


@triton.jit
def _write_top_in_window(key, ids, count, k, lo, hi, out_row, base, W, scratch, PAIR: tl.constexpr):
    """Store the ids (order of ``ids``) of the k largest of the ``count`` valid keys, all in [lo, hi], at
    out_row[base:], ties to the lower id (``_kth_key``); returns min(k, count). PAIR = 0: four window rounds run to the
    k-th key itself."""
    k_eff = tl.minimum(k, count)
    t, ties = _kth_key(key, key != -2147483648, count, tl.maximum(k_eff, 1), lo, hi, scratch, PAIR)
    t = tl.where(k_eff > 0, t, 2147483647)  # k_eff = 0: nothing is above INT32_MAX, no ties wanted
    write_above_and_ties(key, ids, t, tl.where(k_eff > 0, ties, 0), 0, out_row, base, W)
    return k_eff


@triton.jit
def select_in_registers(row, lo, hi, k, out_row, base, W, scratch_row,
                         N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr):
    """The k largest among columns [lo, hi) of a row held in registers, ids ascending at out_row[base:]
    (``scratch_row``: SLOTS free int32). Returns ``(k_eff, path)``: 0 candidates in the slots, 2 tie path, 1 the k-th
    key of the whole row. Steps 2-5 of ``docs/topk.md`` in registers: the max of G strided sub-ranges, T from window
    rounds over them (the exact k-th delegate when the bin's edge lets more keys through than the slots hold), the
    candidates through bitmask words into the slots, the exact selection among them; when even the exact T overflows,
    the tie path or the whole row."""
    j = tl.arange(0, N_PAD)
    valid = (j >= lo) & (j < hi)
    key = keys_of(tl.load(row + j, mask=valid, other=0.0), valid)
    dkey = tl.max(tl.reshape(key, [N_PAD // G, G]), axis=0)
    dok = dkey != -2147483648
    n_valid = tl.sum(dok.to(tl.int32), axis=0)
    usable = (n_valid >= k) & (k > 0)  # at least k delegates: at least k keys reach the k-th delegate
    dlo, top = key_range(dkey, dok)  # (top: the row max)
    T, dmember, dm, k_rem = narrow_window(dkey, dok, n_valid, tl.maximum(tl.minimum(k, n_valid), 1), dlo, top, k // 8,
                                    True, 4)  # the edge of the k-th delegate's bin, at most k / 8 extra delegates
    T = tl.where(usable, T, -2147483648)
    T = tl.where(k > 0, T, 2147483647)  # k = 0: no candidates at all
    count = tl.sum(((key >= T) & (key != -2147483648)).to(tl.int32), axis=0)
    if usable & (count > SLOTS):  # too many through the bin's edge: T = Te, the exact k-th delegate
        dlo, dhi = key_range(dkey, dmember)
        T, dmember, dm, k_rem = narrow_window(dkey, dmember, dm, k_rem, dlo, dhi, -1, True, 4)
        count = tl.sum(((key >= T) & (key != -2147483648)).to(tl.int32), axis=0)
    cand = (key >= T) & (key != -2147483648)
    path = tl.zeros([], tl.int32)
    if count <= SLOTS:  # the candidates' ids, ascending, into the scratch row (a bitmask word per 32 columns)
        ids, skey = _gather_hits(row, cand, count, scratch_row, N_PAD, SLOTS)
        k_eff = _write_top_in_window(skey, ids, count, k, T, top, out_row, base, W, scratch_row, PAIR)
    else:  # overflow even at T = Te (or fewer than k delegates)
        above = tl.sum((key > T).to(tl.int32), axis=0)
        if usable & (above < k):  # the k-th key is Te: keys > Te plus the first k - above keys == Te
            k_eff = write_above_and_ties(key, j, T, k - above, 0, out_row, base, W)
            path = path + 2
        else:  # the exact k-th key of the whole register row by window rounds
            key_lo, key_hi = key_range(key, key != -2147483648)
            k_eff = _write_top_in_window(key, j, tl.sum((key != -2147483648).to(tl.int32), axis=0), k, key_lo, key_hi,
                                         out_row, base, W, scratch_row, PAIR)
            path = path + 1
    return k_eff, path


@triton.jit
def short_row_kernel(scores, stride_r, out, scratch, flags, N, W, k, lengths,
                     N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                     BLOCK_OUT: tl.constexpr, DIRECT: tl.constexpr, ALL: tl.constexpr):
    """One program = one row of at most N_PAD columns in registers: DIRECT (> 1, the value bins) ``select_direct``
    (``scratch``: PAIR int32 a row; ALL: k >= N), 0 ``select_in_registers`` (SLOTS int32 a row, its path in
    ``flags``)."""
    r = tl.program_id(0)
    k, length = row_k_len(r, N, W, k, lengths)
    out_row = out + r.to(tl.int64) * W
    row = scores + r.to(tl.int64) * stride_r
    if DIRECT:
        k_eff = select_direct(row, 0, length, k, out_row, 0, W, scratch + r.to(tl.int64) * PAIR, N_PAD, PAIR,
                              DIRECT, ALL)
        tl.store(flags + r, 0)
    else:
        k_eff, path = select_in_registers(row, 0, length, k, out_row, 0, W, scratch + r.to(tl.int64) * SLOTS, N_PAD,
                                           G, SLOTS, PAIR)
        tl.store(flags + r, path)
    pad_row(out_row, k_eff, W, BLOCK_OUT)
