"""Launch 3 of the long-row top-k (``docs/topk.md``, steps 4-5): a few programs a row, each a span of its columns. When
the candidates fit the slots, the exact selection among them alone (runs mode: the first program at once; bitmask mode:
every program copies its span's candidates into the slots, the last one selects). When they do not, the fallback the
row's counts choose: the tie path (flag 2) or the keys above T selected again (flag 3), both from the candidates'
bitmask words, or the whole-row radix select (flag 1, also ``whole_row_kernel``). The row's last program resets its
counters for the next call (CUDA graphs)."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk.common import (
    CNT,
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
    """The fallback of an overflowing row, from the chunk counts of keys > T (``above``) and == T (``ties``); every
    program of the row computes it itself. Returns ``(need, flag, above, ties)``: flag 2 when fewer than k keys are > T
    (the answer is those plus the ``need`` lowest-id keys == T), 3 when k or more are and they fit the slots, 1
    otherwise (or T = NONE: fewer than k delegates)."""
    te = tl.load(work_row + T_)
    ci = tl.arange(0, C_PAD)
    above = tl.load(work_row + HEAD + ci, mask=ci < C, other=0)
    ties = tl.load(work_row + HEAD + C_PAD + ci, mask=ci < C, other=0)
    n_above = tl.sum(above, axis=0)
    flag = tl.where((te != -2147483648) & (k > 0) & (n_above < k), 2, tl.where(n_above <= SLOTS, 3, 1))
    return k - n_above, flag, above, ties


@triton.jit
def _row_histogram(row, length, ut, P: tl.constexpr, BLOCK: tl.constexpr):
    """The histogram of radix round P over a row in memory (tile loop): the digits of the keys that match ``ut``'s
    digits so far."""
    h = tl.zeros([256], tl.int32)
    for t in range(0, length, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        key = keys_of(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
        u = key ^ -2147483648
        match = key != -2147483648
        if P > 0:
            match = match & ((u >> (32 - 8 * P)) == (ut >> (32 - 8 * P)))
        h += tl.histogram((u >> (24 - 8 * P)) & 0xFF, 256, mask=match)
    return h


@triton.jit
def _radix_select_row(row, length, k, out_row, W, BLOCK: tl.constexpr):
    """Exact top-k of a row in memory by one program: 4 radix rounds over the row (the first also counts its valid
    keys), then an ordered compaction (the last resort)."""
    ut = tl.zeros([], tl.int32)
    h = _row_histogram(row, length, ut, 0, BLOCK)
    k_eff = tl.minimum(k, tl.sum(h, axis=0))
    k_rem = tl.maximum(k_eff, 1)
    for p in tl.static_range(4):
        if p > 0:
            h = _row_histogram(row, length, ut, p, BLOCK)
        d, k_rem = walk_histogram(h, k_rem)
        ut = ut | (d << (24 - 8 * p))
    _write_row(row, tl.where(k_eff > 0, length, 0), ut ^ -2147483648, k_rem, out_row, W, BLOCK)
    pad_row(out_row, k_eff, W, BLOCK)


@triton.jit
def _write_row(row, length, t, need, out_row, W, BLOCK: tl.constexpr):
    """Store, ids ascending, a row's keys > t and its first ``need`` keys == t (tile loop, one program)."""
    done = tl.zeros([], tl.int32)
    ties_seen = tl.zeros([], tl.int32)
    for t0 in range(0, length, BLOCK):
        offs = t0 + tl.arange(0, BLOCK)
        key = keys_of(tl.load(row + offs, mask=offs < length, other=0.0), offs < length)
        done += write_above_and_ties(key, offs, t, need, ties_seen, out_row, done, W)
        ties_seen += tl.sum((key == t).to(tl.int32), axis=0)


@triton.jit
def _tie_bits_span(bits_row, n_words, work_row, need, above, ties, dst, f, SPAN: tl.constexpr, CHUNK: tl.constexpr,
                   C_PAD: tl.constexpr, WB: tl.constexpr):
    """Span f of a tie-path row (flag 2): its keys > T and its share of the lowest-id keys == T, at the offsets the
    chunk counts give, from the candidates launch's words (keys >= T; keys == T where a chunk has any): no key is read
    again. need = 0: the keys > T alone (flag 3, into the slots)."""
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


# ----------------------------------------------------------------------------- the selection
@triton.jit
def _kth_candidate(key, ok, k_eff, T, shift, work_row, sync_row, G: tl.constexpr, C_PAD: tl.constexpr,
                   PAIR: tl.constexpr):
    """``(t, need)``: the k_eff-th largest candidate key and how many keys == t the row takes. 256 bins of width
    2**shift over [T, row max] by L2 atomic adds into the row's zeroed histogram (``tl.histogram`` was the select
    program's largest step), the walk to the k-th key's bin, window rounds when the bin holds more than PAIR keys, then
    a pairwise rank of the bin's keys."""
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
    """The exact selection among ``total`` <= SLOTS candidate columns in the slots, ascending (the bitmask mode): their
    keys from the row (in L2), ``t`` and ``need``, then one prefix sum over the slots places every winner in the
    ascending output."""
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
    """The exact selection among ``total`` <= SLOTS candidates stored as ``key << 32 | id`` in runs (one per chunk,
    ascending ids inside a run, the runs in any order: the runs mode). A slot's place is its rank in id order among the
    keys > t plus its rank among the keys == t (capped at ``need``): one prefix sum over the slots, read at the first
    and last slot of every run (``tl.gather``), gives both."""
    s = tl.arange(0, SLOTS)
    ci = tl.arange(0, C_PAD)
    # Every load goes out together, past L1 (.cg: the candidates launch wrote the runs, under PDL).
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
def select_kernel(scores, stride_r, out, cand, runs, work, sync, N, W, k, lengths,
                   G: tl.constexpr, CHUNK: tl.constexpr,
                   SLOTS: tl.constexpr, LOG_C: tl.constexpr, BITMASK: tl.constexpr, PAIR: tl.constexpr,
                   SPAN: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    """One program = one SPAN of a row's columns (whole chunks); the module docstring says what each does. The program
    that selects last resets the row's candidate count and counter: the others have read it."""
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
    bits_row = cand + r.to(tl.int64) * (2 * n_words + SLOTS)  # (per row: the words of keys >= T, those of
    slots_row = bits_row + 2 * n_words  # keys == T, the slots)
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
            _select_from_runs(runs + r.to(tl.int64) * SLOTS, work_row, sync_row, out_row, total, k, C, W, G, CHUNK,
                              SLOTS, C_PAD, PAIR, TILE)
            tl.debug_barrier()  # every thread has read the count
            tl.store(sync_row + CNT, 0)
    else:  # the candidates overflowed the slots: the fallback, spread over the row's programs
        need, flag, above, ties = _plan_tie_path(work_row, k, C, SLOTS, C_PAD)
        if flag == 2:
            _tie_bits_span(bits_row, n_words, work_row, need, above, ties, out_row, f, SPAN, CHUNK, C_PAD, WB)
        elif flag == 3:  # every key > T into the slots (the tie path with no ties wanted: ascending ids)
            total = k - need
            _tie_bits_span(bits_row, n_words, work_row, 0, above, ties, slots_row, f, SPAN, CHUNK, C_PAD, WB)
        elif f == 0:
            _radix_select_row(row, length, k, out_row, W, TILE)
        if (f == 0) & (flag == 2):
            pad_row(out_row, k, W, TILE)  # (the tie path writes exactly k ids)
    if BITMASK | (flag != 0):
        tl.debug_barrier()  # every thread's reads of the counts and writes to the slots are done
        if tl.atomic_add(sync_row, 1, sem="acq_rel") == tl.num_programs(1) - 1:  # the row's last program
            tl.store(sync_row, 0)
            tl.store(sync_row + CNT, 0)
            tl.store(work_row + FLAG, flag)
            if (flag == 0) | (flag == 3):  # (flag 3: total is now the keys > T)
                select_from_ids(row, slots_row, work_row, sync_row, out_row, total, k, W, G, SLOTS, C_PAD, PAIR, TILE)


@triton.jit
def whole_row_kernel(scores, stride_r, out, N, W, k, lengths, BLOCK: tl.constexpr):
    """One program = one row: the whole-row radix select (k too wide for the delegates)."""
    r = tl.program_id(0)
    k, length = row_k_len(r, N, W, k, lengths)
    _radix_select_row(scores + r.to(tl.int64) * stride_r, length, k, out + r.to(tl.int64) * W, W, BLOCK)
