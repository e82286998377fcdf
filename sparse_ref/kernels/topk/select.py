"""Launch 3 of the long-row top-k: the exact selection on the candidates, or the exact fallback.

**Select** (a few programs per row, each a span of the row's columns): when the candidates fit the
slots, the row's exact top-k is found among them alone: a 256-bin histogram over ``[T, row max]``, the
bin of the k-th key, a pairwise rank of that bin's few keys gives the k-th key ``t``, and one prefix
sum places every winner at its place in ascending id order. The row's last program to finish resets
its counters for the next call (CUDA graphs).

**Fallback** (rows whose candidates do not fit the slots: plateaus and clusters of equal values, a
period of G, more than half the row wanted), chosen on the device. Most such rows overflow because
many keys EQUAL the threshold ``T``. At least k keys are >= T, so if fewer than k are > T, ``T`` is the
k-th key and the answer is "every key > T, plus the lowest-id keys == T": the *tie path*. Every select
program of the row turns the chunk counts into its span's offsets (``_plan_tie_path``) and writes its
share: in the bitmask mode from the candidates launch's words of keys >= T and == T (``_tie_bits_span``,
no key read again), in the runs mode from the keys of the chunks that hold something to write
(``_tie_path_span``). Rows with k or more
keys above ``T`` copy those keys into the slots when they fit and select among them (flag 3); when
they do not (e.g. a period of G), the row takes the whole-row radix select (``_radix_select_row``:
one program per row, slow; also ``whole_row_kernel``, when k is too wide for the delegates).
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk.common import (
    CNT,
    CNT2,
    DHIST,
    FLAG,
    HEAD,
    MEMBERS,
    SHIFT,
    SYNC,
    T_,
    after_previous_launch,
    bits_to_slots,
    delegates_of,
    key_bins,
    key_range,
    keys_of,
    narrow_window,
    pad_row,
    pairwise_kth,
    popcount32,
    row_k_len,
    walk_histogram,
    words_to_slots,
    work_row_of,
    write_above_and_ties,
)


# ----------------------------------------------------------------------------- the fallback
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
        key = keys_of(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
        u = key ^ -2147483648
        match = key != -2147483648
        if P > 0:
            match = match & ((u >> (32 - 8 * P)) == (ut >> (32 - 8 * P)))
        h += tl.histogram((u >> (24 - 8 * P)) & 0xFF, 256, mask=match)
    d, k_rem = walk_histogram(h, k_rem)
    return ut | (d << (24 - 8 * P)), k_rem


@triton.jit
def _radix_select_row(row, length, k, out_row, W, BLOCK: tl.constexpr):
    """Exact top-k of a row in memory by one program: 4 radix histogram rounds over the whole row, then
    an ordered compaction (the last resort: rows that defeat the delegates, or k too wide for them)."""
    valid_count = tl.zeros([], tl.int32)
    for t in range(0, length, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        valid_count += tl.sum((keys_of(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
                               != -2147483648).to(tl.int32), axis=0)
    k_eff = tl.minimum(k, valid_count)
    ut = tl.zeros([], tl.int32)
    k_rem = tl.maximum(k_eff, 1)
    for p in tl.static_range(4):
        ut, k_rem = _row_histogram(row, length, ut, k_rem, p, BLOCK)
    _write_row(row, tl.where(k_eff > 0, length, 0), ut ^ -2147483648, k_rem, out_row, W, BLOCK)
    pad_row(out_row, k_eff, W, BLOCK)


@triton.jit
def _write_row(row, length, t, need, out_row, W, BLOCK: tl.constexpr):
    """One program stores, in ascending id order, the ids of a row's keys > t and of its first ``need``
    keys == t (tile loop over the row)."""
    done = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for t0 in range(0, length, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        key = keys_of(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
        done += write_above_and_ties(key, offs, t, need, ties_seen, out_row, done, W)
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
        key = keys_of(tl.load(row + offs, mask=offs < hi, other=0.0), offs < hi)
        write_above_and_ties(key, offs, te, need, ties_before, out_row, above_before + tl.minimum(ties_before, need),
                              W)


@triton.jit
def _tie_bits_span(bits_row, n_words, work_row, need, above, ties, dst, f, SPAN: tl.constexpr, CHUNK: tl.constexpr,
                   C_PAD: tl.constexpr, WB: tl.constexpr):
    """``_tie_path_span`` in the bitmask mode, from the candidates launch's words (keys >= T; keys == T where
    a chunk has any), not the keys: every key > T and the ``need`` lowest-id ties, ids ascending, at the
    chunk counts' offsets; no key is read again. need = 0: the keys > T alone (flag 3, into the slots)."""
    c = tl.arange(0, C_PAD)
    ties_before = tl.sum(tl.where(c < f * (SPAN // CHUNK), ties, 0), axis=0)
    done = tl.sum(tl.where(c < f * (SPAN // CHUNK), above, 0), axis=0) + tl.minimum(ties_before, need)
    first = f * (SPAN // 32)
    for w0 in range(0, tl.minimum(n_words - first, SPAN // 32), WB):
        w = w0 + tl.arange(0, WB)
        ok = first + w < n_words
        ge = tl.load(bits_row + first + w, mask=ok, other=0, cache_modifier=".cg")
        has_ties = tl.load(work_row + HEAD + C_PAD + (first + w) // (CHUNK // 32), mask=ok, other=0) > 0
        eq = tl.load(bits_row + n_words + first + w, mask=ok & has_ties, other=0, cache_modifier=".cg")
        n_eq = popcount32(eq)
        take = tl.minimum(tl.maximum(need - (ties_before + tl.cumsum(n_eq, axis=0) - n_eq), 0), n_eq)
        keep, rest = tl.where(take == n_eq, eq, 0), tl.where(take < n_eq, eq, 0)  # whole words; the cut one:
        for j in range(0, tl.max(tl.where(take < n_eq, take, 0), axis=0)):
            low = rest & -rest  # its lowest tie not yet taken
            keep = keep | tl.where(j < take, low, 0)
            rest = rest ^ low
        done = words_to_slots((ge & ~eq) | keep, w, done, dst, f * SPAN)
        ties_before += tl.sum(n_eq, axis=0)


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
        key = keys_of(tl.load(row + offs, mask=offs < hi, other=0.0), offs < hi)
        is_above = key > te
        n_in = tl.where((start >= t0) & (start < t0 + TILE) & (start < hi), above, 0)  # the tile's chunks
        base = tl.atomic_add(sync_row + CNT2, tl.sum(n_in, axis=0), sem="relaxed")
        tl.store(work_row + HEAD + 2 * C_PAD + c, n_in, mask=n_in > 0)
        tl.store(work_row + HEAD + 3 * C_PAD + c, base + tl.cumsum(n_in, axis=0) - n_in, mask=n_in > 0)
        tl.store(cand_row + base + tl.cumsum(is_above.to(tl.int32), axis=0) - 1,
                 (key.to(tl.int64) << 32) | offs.to(tl.int64), mask=is_above)


# ----------------------------------------------------------------------------- the selection
@triton.jit
def _kth_candidate(key, ok, k_eff, T, shift, work_row, sync_row, G: tl.constexpr, C_PAD: tl.constexpr,
                   PAIR: tl.constexpr):
    """``(t, need)``: the k_eff-th largest of the candidate keys ``key`` (``ok``: a real slot) and how many
    keys == t the row takes. Bin them (256 bins of width 2**shift over [T, row max]: L2 atomic adds into the
    row's zeroed histogram in memory; ``tl.histogram``, a ballot per key bit and a loop over the bins per
    key, was the select program's largest step), walk the histogram to the bin of the k-th key, and rank
    that bin's keys pairwise when they are few (random rows: a few dozen). When they are more (ties,
    clusters, bf16 scores), window rounds over their own range first (``narrow_window``: none at all when they
    are one value)."""
    bins = key_bins(key, T, shift)
    tl.atomic_add(sync_row + DHIST + bins, 1, mask=ok, sem="relaxed")
    tl.debug_barrier()  # every thread's adds are done before anyone reads the counts
    b = tl.arange(0, 256)
    hist = tl.load(sync_row + DHIST + b, cache_modifier=".cg")
    d, k_rem = walk_histogram(hist, tl.maximum(k_eff, 1))
    tl.store(sync_row + DHIST + b, tl.zeros([256], tl.int32))  # zero again (every thread has read it)
    member = ok & (bins == d)
    m = tl.sum(tl.where(b == d, hist, 0), axis=0)  # keys in bin d
    t = T
    if m > PAIR:
        lo, hi = key_range(key, member)
        t, member, m, k_rem = narrow_window(key, member, m, k_rem, lo, hi, PAIR, False, 3)
    if PAIR > 0:
        if m <= PAIR:  # copy them to the scratch, at places an atomic counter hands out (no prefix sum); rank
            scratch = delegates_of(work_row, C_PAD) + G  # (the pair scratch)
            at = tl.atomic_add(sync_row + MEMBERS + tl.zeros_like(key), 1, mask=member, sem="relaxed")
            tl.store(scratch + at, key, mask=member)
            tl.debug_barrier()
            t, k_rem = pairwise_kth(scratch, m, k_rem, PAIR)
            tl.store(sync_row + MEMBERS, 0)  # zero again for the next call
    return tl.where(k_eff > 0, t, 2147483647), tl.where(k_eff > 0, k_rem, 0)


@triton.jit
def select_from_ids(row, slots_row, work_row, sync_row, out_row, total, k, W, G: tl.constexpr,
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
    key = keys_of(tl.load(row + ids, mask=ok, other=0.0), ok)
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
    pad_row(out_row, k_eff, W, BLOCK)


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
    pad_row(out_row, k_eff, W, BLOCK)


@triton.jit
def select_kernel(scores, stride_r, out, cand, work, sync, N, W, k, lengths,
                   G: tl.constexpr, CHUNK: tl.constexpr,
                   SLOTS: tl.constexpr, LOG_C: tl.constexpr, BITMASK: tl.constexpr, PAIR: tl.constexpr,
                   SPAN: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    """One program = one SPAN of a row's columns (whole chunks). Every program reads the row's candidate
    count first.

    When the candidates fit the slots: BITMASK, every program copies its span's candidate columns from
    the bitmask into the slots, at the offset the chunks before it give (``bits_to_slots``), and the
    row's last program to finish (an atomic counter) selects among them (``select_from_ids``); else the
    program of span 0 selects among the runs at once (``_select_from_runs``) and the others return.
    When they do not (the row is flagged), every program writes its span's share of the tie path, or
    copies its span's keys > T into the slots for the row's last program to select among (flag 3), or
    the program of span 0 runs the whole-row radix select (the plan decides). The program that selects
    last resets the row's candidate count (and the counter) for the next call: the others have read it."""
    after_previous_launch(PDL)
    C_PAD: tl.constexpr = 1 << LOG_C
    WB: tl.constexpr = SPAN // 32 if SPAN // 32 < 2048 else 2048  # bitmask words per block of bits_to_slots
    r = tl.program_id(0)
    f = tl.program_id(1)
    C = tl.cdiv(N, CHUNK)
    n_words = C * (CHUNK // 32)
    k, length = row_k_len(r, N, W, k, lengths)
    work_row = work_row_of(work, r, LOG_C, G)
    sync_row = sync + r.to(tl.int64) * SYNC
    out_row = out + r.to(tl.int64) * W
    row = scores + r.to(tl.int64) * stride_r
    if BITMASK:  # (per row: the words of keys >= T, those of keys == T, the slots)
        bits_row = cand + r.to(tl.int64) * (2 * n_words + SLOTS)
        slots_row = bits_row + 2 * n_words
    else:
        slots_row = cand + r.to(tl.int64) * SLOTS
    total = tl.load(sync_row + CNT)
    flag = tl.zeros([], tl.int32)
    if total <= SLOTS:
        if BITMASK:  # this span's candidates into the slots, after those of the chunks before it
            ci = tl.arange(0, C_PAD)
            n = (tl.load(work_row + HEAD + ci, mask=ci < C, other=0)
                 + tl.load(work_row + HEAD + C_PAD + ci, mask=ci < C, other=0))
            bits_to_slots(bits_row + f * (SPAN // 32), tl.minimum(n_words - f * (SPAN // 32), SPAN // 32),
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
            if BITMASK:
                _tie_bits_span(bits_row, n_words, work_row, need, above, ties, out_row, f, SPAN, CHUNK, C_PAD, WB)
            else:
                _tie_path_span(row, length, te, need, above, ties, out_row, f, W, SPAN, TILE, CHUNK, C_PAD)
        elif flag == 3:  # every key > T into the slots, for the row's last program
            total = k - need
            if BITMASK:  # (the tie path with no ties wanted: ascending ids)
                _tie_bits_span(bits_row, n_words, work_row, 0, above, ties, slots_row, f, SPAN, CHUNK, C_PAD, WB)
            else:
                _above_to_slots(row, length, te, above, slots_row, work_row, sync_row, f, SPAN, TILE, CHUNK, C_PAD)
        elif f == 0:
            _radix_select_row(row, length, k, out_row, W, TILE)
        if (f == 0) & (flag == 2):
            pad_row(out_row, k, W, TILE)  # (the tie path writes exactly k ids)
    if BITMASK | (total > SLOTS) | (flag == 3):  # (flag 3: total is now the keys > T)
        tl.debug_barrier()  # every thread's reads of the counts and writes to the slots are done
        if tl.atomic_add(sync_row, 1, sem="acq_rel") == tl.num_programs(1) - 1:  # the row's last program
            tl.store(sync_row, 0)
            tl.store(sync_row + CNT, 0)
            tl.store(sync_row + CNT2, 0)
            tl.store(work_row + FLAG, flag)
            if (flag == 0) | (flag == 3):
                if BITMASK:
                    select_from_ids(row, slots_row, work_row, sync_row, out_row, total, k, W, G, SLOTS, C_PAD,
                                     PAIR, TILE)
                else:
                    _select_from_runs(slots_row, work_row, sync_row, out_row, total, k, C, W, G, CHUNK, SLOTS,
                                      C_PAD, PAIR, TILE)


@triton.jit
def whole_row_kernel(scores, stride_r, out, N, W, k, lengths, BLOCK: tl.constexpr):
    """One program = one row: the whole-row radix select (k too wide for the delegates)."""
    r = tl.program_id(0)
    k, length = row_k_len(r, N, W, k, lengths)
    _radix_select_row(scores + r.to(tl.int64) * stride_r, length, k, out + r.to(tl.int64) * W, W, BLOCK)
