"""Launches 2 and 3 of the long-row top-k (``kernels/topk.py``): the candidates, then the exact selection.

**Candidates** (one light program per chunk of a row): every element ``>= T`` is a candidate. Each
chunk program counts its keys above and equal to ``T`` and adds them to the row's count; then, in the
*bitmask* mode (many rows), it marks its candidates in the row's bitmask (a dense store), or, in the
*runs* mode (few rows), copies them as ``key << 32 | id`` to a run of the row's slots.

**Select** (a few programs per row, each a span of the row's columns): when the candidates fit the
slots, the row's exact top-k is found among them alone: a 256-bin histogram over ``[T, row max]``, the
bin of the k-th key, a pairwise rank of that bin's few keys gives the k-th key ``t``, and one prefix
sum places every winner at its place in ascending id order. When they do not fit (plateaus, clusters,
periodic rows), the row takes an exact fallback (``kernels/topk_fallback.py``), spread over its
programs. The row's last program to finish resets its counters for the next call (CUDA graphs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk_common import (
    AOT_PTRS,
    AOT_ROWS,
    CNT,
    CNT2,
    DHIST,
    FLAG,
    HEAD,
    MEMBERS,
    SHIFT,
    SYNC,
    T_,
    _after_previous_launch,
    _bins,
    _bitmask_words,
    _bits_to_slots,
    _delegates_of,
    _hit_ranks,
    _key_range,
    _keys,
    _narrow,
    _pad,
    _pairwise_kth,
    _row_k_len,
    _walk,
    _work_row,
    aot_variant,
)
from sparse_ref.kernels.topk_fallback import _above_to_slots, _plan_tie_path, _radix_select_row, _tie_path_span


@triton.jit
def _candidates_kernel(scores, stride_r, cand, work, sync, N, W, k, lengths,
                       G: tl.constexpr, CHUNK: tl.constexpr,
                       SLOTS: tl.constexpr, LOG_C: tl.constexpr, BITMASK: tl.constexpr, REVERSE: tl.constexpr,
                       PDL: tl.constexpr):
    """One program = one CHUNK of a row: its elements >= T are the candidates. It adds their count to the
    row's (one atomic add) and stores its counts of keys > T and == T (the select launch's offsets, and the
    tie path's plan if the row overflows). Then, BITMASK: it marks them in the row's bitmask (CHUNK / 32
    words, a dense store: nothing over the read); else it copies them (``key << 32 | id``, ascending id)
    to the run of the row's slots that its atomic add returned (each at its rank from bitmask words,
    ``_hit_ranks``, and a store per candidate: with few rows there are few programs and this costs
    little; with many, several µs).
    No tail and no histogram, so this one runs with light programs. Row-major order, the last rows first
    when REVERSE: the delegates launch read those last, so more of them are still in L2."""
    _after_previous_launch(PDL)
    C_PAD: tl.constexpr = 1 << LOG_C
    WORDS: tl.constexpr = CHUNK // 32
    C = tl.cdiv(N, CHUNK)
    r = tl.program_id(0) // C
    if REVERSE:
        r = tl.num_programs(0) // C - 1 - r
    c = tl.program_id(0) % C
    k, length = _row_k_len(r, N, W, k, lengths)
    work_row = _work_row(work, r, LOG_C, G)
    T = tl.load(work_row + T_)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    key = _keys(tl.load(scores + r.to(tl.int64) * stride_r + offs, mask=offs < length, other=0.0), offs < length)
    is_cand = (key >= T) & (key != -2147483648)
    both = tl.sum(is_cand.to(tl.int32) + ((key > T).to(tl.int32) << 16), axis=0)  # two counts (CHUNK < 2**16)
    n_c = both & 0xFFFF
    tl.store(work_row + HEAD + c, both >> 16)  # keys > T
    tl.store(work_row + HEAD + C_PAD + c, n_c - (both >> 16))  # keys == T
    base = tl.atomic_add(sync + r.to(tl.int64) * SYNC + CNT, n_c, sem="relaxed")  # (runs: [base, base + n_c))
    if BITMASK:
        tl.store(cand + r.to(tl.int64) * (C * WORDS + SLOTS) + c * WORDS + tl.arange(0, WORDS),
                 _bitmask_words(is_cand, WORDS))
    else:
        tl.store(work_row + HEAD + 2 * C_PAD + c, n_c)
        tl.store(work_row + HEAD + 3 * C_PAD + c, base)
        if base + n_c <= SLOTS:  # (their ranks from bitmask words: no prefix sum over the chunk)
            tl.store(cand + r.to(tl.int64) * SLOTS + base + _hit_ranks(is_cand, WORDS),
                     (key.to(tl.int64) << 32) | offs.to(tl.int64), mask=is_cand)



@triton.jit
def _kth_candidate(key, ok, k_eff, T, shift, work_row, sync_row, G: tl.constexpr, C_PAD: tl.constexpr,
                   PAIR: tl.constexpr):
    """``(t, need)``: the k_eff-th largest of the candidate keys ``key`` (``ok``: a real slot) and how many
    keys == t the row takes. Bin them (256 bins of width 2**shift over [T, row max]: L2 atomic adds into the
    row's zeroed histogram in memory; ``tl.histogram``, a ballot per key bit and a loop over the bins per
    key, was the select program's largest step), walk the histogram to the bin of the k-th key, and rank
    that bin's keys pairwise when they are few (random rows: a few dozen). When they are more (ties,
    clusters, bf16 scores), window rounds over their own range first (``_narrow``: none at all when they
    are one value)."""
    bins = _bins(key, T, shift)
    tl.atomic_add(sync_row + DHIST + bins, 1, mask=ok, sem="relaxed")
    tl.debug_barrier()  # every thread's adds are done before anyone reads the counts
    b = tl.arange(0, 256)
    hist = tl.load(sync_row + DHIST + b, cache_modifier=".cg")
    d, k_rem = _walk(hist, tl.maximum(k_eff, 1))
    tl.store(sync_row + DHIST + b, tl.zeros([256], tl.int32))  # zero again (every thread has read it)
    member = ok & (bins == d)
    m = tl.sum(tl.where(b == d, hist, 0), axis=0)  # keys in bin d
    t = T
    if m > PAIR:
        lo, hi = _key_range(key, member)
        t, member, m, k_rem = _narrow(key, member, m, k_rem, lo, hi, PAIR, False, 3)
    if PAIR > 0:
        if m <= PAIR:  # copy them to the scratch, at places an atomic counter hands out (no prefix sum); rank
            scratch = _delegates_of(work_row, C_PAD) + G  # (the pair scratch)
            at = tl.atomic_add(sync_row + MEMBERS + tl.zeros_like(key), 1, mask=member, sem="relaxed")
            tl.store(scratch + at, key, mask=member)
            tl.debug_barrier()
            t, k_rem = _pairwise_kth(scratch, m, k_rem, PAIR)
            tl.store(sync_row + MEMBERS, 0)  # zero again for the next call
    return tl.where(k_eff > 0, t, 2147483647), tl.where(k_eff > 0, k_rem, 0)


@triton.jit
def _select_from_ids(row, slots_row, work_row, sync_row, out_row, total, k, W, G: tl.constexpr,
                     SLOTS: tl.constexpr, C_PAD: tl.constexpr, PAIR: tl.constexpr, BLOCK: tl.constexpr):
    """The exact selection of a row whose ``total`` <= SLOTS candidates' columns sit in its slots in
    ascending order (the bitmask mode): gather their keys from the row (in L2), find ``t`` and ``need``
    (``_kth_candidate``), then store every winner at its place in the ascending output: the keys > t
    before it, plus the keys == t before it up to ``need`` (one prefix sum over the slots)."""
    s = tl.arange(0, SLOTS)
    ok = s < total
    ids = tl.load(slots_row + s, mask=ok, other=0, cache_modifier=".cg")  # (other programs wrote them)
    T = tl.load(work_row + T_, cache_modifier=".cg")
    shift = tl.load(work_row + SHIFT, cache_modifier=".cg")
    key = _keys(tl.load(row + ids, mask=ok, other=0.0), ok)
    k_eff = tl.minimum(k, total)
    t, need = _kth_candidate(key, ok, k_eff, T, shift, work_row, sync_row, G, C_PAD, PAIR)
    above = ok & (key > t)
    tie = ok & (key == t)
    # One prefix sum counts both kinds (keys > t in the high 16 bits, == t in the low; SLOTS < 2**15).
    flags = (above.to(tl.int32) << 16) | tie.to(tl.int32)
    before = tl.cumsum(flags, axis=0) - flags
    ties_before = before & 0xFFFF
    pos = (before >> 16) + tl.minimum(ties_before, need)
    tl.store(out_row + pos, ids, mask=(above | (tie & (ties_before < need))) & (pos < W))
    _pad(out_row, k_eff, W, BLOCK)


@triton.jit
def _select_from_runs(cand_row, work_row, sync_row, out_row, total, k, C, W, G: tl.constexpr, CHUNK: tl.constexpr,
                      SLOTS: tl.constexpr, C_PAD: tl.constexpr, PAIR: tl.constexpr, BLOCK: tl.constexpr):
    """The exact selection of a row whose ``total`` <= SLOTS candidates sit in its slots as ``key << 32 |
    id`` in runs, one per chunk, ascending ids inside a run, the runs in any order (the runs mode): find
    ``t`` and ``need`` (``_kth_candidate``), then store every winner at its place in the ascending output.
    A slot's place is its rank in id order among the keys > t, plus its rank among the keys == t (capped
    at ``need``). Both ranks are "the same keys in the chunks before mine" plus "the same keys before me
    in my run": one prefix sum over the slots gives both, read at the first and last slot of every run
    (``tl.gather``; the runs landed in any order)."""
    s = tl.arange(0, SLOTS)
    ci = tl.arange(0, C_PAD)
    # Every load goes out together, past L1 (.cg: on a flag-3 row other programs of this launch wrote the slots).
    packed = tl.load(cand_row + s, cache_modifier=".cg")  # every slot (not masked by total)
    n = tl.load(work_row + HEAD + 2 * C_PAD + ci, mask=ci < C, other=0, cache_modifier=".cg")
    first = tl.minimum(tl.load(work_row + HEAD + 3 * C_PAD + ci, mask=ci < C, other=0, cache_modifier=".cg"),
                       SLOTS - 1)
    T = tl.load(work_row + T_, cache_modifier=".cg")
    shift = tl.load(work_row + SHIFT, cache_modifier=".cg")
    ok = s < total
    key = tl.where(ok, (packed >> 32).to(tl.int32), -2147483648)
    k_eff = tl.minimum(k, total)
    t, need = _kth_candidate(key, ok, k_eff, T, shift, work_row, sync_row, G, C_PAD, PAIR)
    ids = packed.to(tl.int32)  # the low 32 bits
    above = ok & (key > t)
    tie = ok & (key == t)
    # One prefix sum over the slots counts both kinds (keys > t in the high 16 bits, == t in the low;
    # SLOTS < 2**15): for each slot, those stored before it.
    flags = (above.to(tl.int32) << 16) | tie.to(tl.int32)
    before = tl.cumsum(flags, axis=0) - flags
    # Per chunk, from its run [first, first + n): its own counts (the prefix sum after its last slot minus
    # before its first), then its offset: the keys of the chunks before it minus those stored before its
    # run. The offsets go through one prefix sum and one gather as int64 (kind 1 << 32 | kind 2); their
    # fields may be negative, but each slot's sum with its own "before" is not.
    last = tl.minimum(tl.maximum(first + n - 1, 0), SLOTS - 1)
    at_first = tl.gather(before, first, 0)
    in_run = tl.where(n > 0, tl.gather(before + flags, last, 0) - at_first, 0)
    run2 = ((in_run >> 16).to(tl.int64) << 32) + (in_run & 0xFFFF)
    off2 = tl.cumsum(run2, axis=0) - run2 - (((at_first >> 16).to(tl.int64) << 32) + (at_first & 0xFFFF))
    rank2 = tl.gather(off2, tl.where(ok, ids // CHUNK, 0), 0) + (((before >> 16).to(tl.int64) << 32)
                                                                 + (before & 0xFFFF))
    above_rank = (rank2 >> 32).to(tl.int32)
    tie_rank = (rank2 & 0xFFFFFFFF).to(tl.int32)
    pos = above_rank + tl.minimum(tie_rank, need)
    tl.store(out_row + pos, ids, mask=(above | (tie & (tie_rank < need))) & (pos < W))
    _pad(out_row, k_eff, W, BLOCK)


@triton.jit
def _select_kernel(scores, stride_r, out, cand, work, sync, N, W, k, lengths,
                   G: tl.constexpr, CHUNK: tl.constexpr,
                   SLOTS: tl.constexpr, LOG_C: tl.constexpr, BITMASK: tl.constexpr, PAIR: tl.constexpr,
                   SPAN: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    """One program = one SPAN of a row's columns (whole chunks). Every program reads the row's candidate
    count first.

    When the candidates fit the slots: BITMASK, every program copies its span's candidate columns from
    the bitmask into the slots, at the offset the chunks before it give (``_bits_to_slots``), and the
    row's last program to finish (an atomic counter) selects among them (``_select_from_ids``); else the
    program of span 0 selects among the runs at once (``_select_from_runs``) and the others return.
    When they do not (the row is flagged), every program writes its span's share of the tie path, or
    copies its span's keys > T into the slots for the row's last program to select among (flag 3), or
    the program of span 0 runs the whole-row radix select (the plan decides). The program that selects
    last resets the row's candidate count (and the counter) for the next call: the others have read it."""
    _after_previous_launch(PDL)
    C_PAD: tl.constexpr = 1 << LOG_C
    WB: tl.constexpr = SPAN // 32 if SPAN // 32 < 2048 else 2048  # bitmask words per block of _bits_to_slots
    r = tl.program_id(0)
    f = tl.program_id(1)
    C = tl.cdiv(N, CHUNK)
    n_words = C * (CHUNK // 32)
    k, length = _row_k_len(r, N, W, k, lengths)
    work_row = _work_row(work, r, LOG_C, G)
    sync_row = sync + r.to(tl.int64) * SYNC
    out_row = out + r.to(tl.int64) * W
    row = scores + r.to(tl.int64) * stride_r
    if BITMASK:
        bits_row = cand + r.to(tl.int64) * (n_words + SLOTS)
        slots_row = bits_row + n_words
    else:
        slots_row = cand + r.to(tl.int64) * SLOTS
    total = tl.load(sync_row + CNT)
    flag = tl.zeros([], tl.int32)
    if total <= SLOTS:
        if BITMASK:  # this span's candidates into the slots, after those of the chunks before it
            ci = tl.arange(0, C_PAD)
            n = (tl.load(work_row + HEAD + ci, mask=ci < C, other=0)
                 + tl.load(work_row + HEAD + C_PAD + ci, mask=ci < C, other=0))
            _bits_to_slots(bits_row + f * (SPAN // 32), tl.minimum(n_words - f * (SPAN // 32), SPAN // 32),
                           slots_row + tl.sum(tl.where(ci < f * (SPAN // CHUNK), n, 0), axis=0), f * SPAN, WB)
        elif f == 0:  # the runs: select at once, no waiting for the others
            tl.store(work_row + FLAG, 0)
            _select_from_runs(slots_row, work_row, sync_row, out_row, total, k, C, W, G, CHUNK, SLOTS, C_PAD, PAIR,
                              TILE)
            tl.debug_barrier()  # every thread has read the count
            tl.store(sync_row + CNT, 0)
    else:  # the candidates overflowed the slots: the fallback, spread over the row's programs
        te, need, flag, above, ties = _plan_tie_path(work_row, k, C, SLOTS, C_PAD)
        if flag == 2:
            _tie_path_span(row, length, te, need, above, ties, out_row, f, W, SPAN, TILE, CHUNK, C_PAD)
        elif flag == 3:  # every key > T into the slots, for the row's last program
            total = k - need
            if BITMASK:  # (the tie path's code with no ties wanted: ascending ids)
                _tie_path_span(row, length, te, 0, above, ties, slots_row, f, SLOTS, SPAN, TILE, CHUNK, C_PAD)
            else:
                _above_to_slots(row, length, te, above, slots_row, work_row, sync_row, f, SPAN, TILE, CHUNK, C_PAD)
        elif f == 0:
            _radix_select_row(row, length, k, out_row, W, TILE)
        if (f == 0) & (flag == 2):
            _pad(out_row, k, W, TILE)  # (the tie path writes exactly k ids)
    if BITMASK | (total > SLOTS) | (flag == 3):  # (flag 3: total is now the keys > T)
        tl.debug_barrier()  # every thread's reads of the counts and writes to the slots are done
        if tl.atomic_add(sync_row, 1, sem="acq_rel") == tl.num_programs(1) - 1:  # the row's last program
            tl.store(sync_row, 0)
            tl.store(sync_row + CNT, 0)
            tl.store(sync_row + CNT2, 0)
            tl.store(work_row + FLAG, flag)
            if (flag == 0) | (flag == 3):
                if BITMASK:
                    _select_from_ids(row, slots_row, work_row, sync_row, out_row, total, k, W, G, SLOTS, C_PAD,
                                     PAIR, TILE)
                else:
                    _select_from_runs(slots_row, work_row, sync_row, out_row, total, k, C, W, G, CHUNK, SLOTS,
                                      C_PAD, PAIR, TILE)


AOT_VARIANTS = [
    *[aot_variant(_candidates_kernel, dict(**rc, G=g, CHUNK=ch, SLOTS=g, LOG_C=c, BITMASK=bm, REVERSE=rv),
                  {"num_warps": nw}, cand="*i32" if bm else "*i64", work="*i32", sync="*i32", **rt, **AOT_PTRS)
      for (rt, rc), g, ch, c, nw, rv, bm in zip(AOT_ROWS * 2, (4096, 8192, 4096, 4096), (2048, 1024, 8192, 4096),
                                                (5, 7, 3, 5), (4, 8, 16, 8), (True, False, True, False),
                                                (True, False, False, True), strict=True)],
    *[aot_variant(_select_kernel, dict(**rc, G=g, CHUNK=ch, SLOTS=g, LOG_C=c, BITMASK=bm, PAIR=pr, SPAN=sp,
                                       TILE=tl_), {"num_warps": nw}, cand="*i32" if bm else "*i64", work="*i32",
                  sync="*i32", **rt, **AOT_PTRS)
      for (rt, rc), g, ch, c, nw, pr, sp, tl_, bm in zip(AOT_ROWS * 2, (4096, 8192, 4096, 4096),
                                                         (2048, 1024, 8192, 4096), (5, 7, 3, 5), (16, 8, 16, 16),
                                                         (0, 128, 128, 128), (16384, 2048, 65536, 8192),
                                                         (8192, 2048, 8192, 8192), (True, False, True, False),
                                                         strict=True)],
]
