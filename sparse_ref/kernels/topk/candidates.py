"""Launch 2 of the long-row top-k (``docs/topk.md``, step 4): the candidates, every element ``>= T``."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels.topk.common import (
    CNT,
    HEAD,
    SYNC,
    T_,
    after_previous_launch,
    bitmask_words,
    hit_ranks,
    keys_of,
    row_k_len,
    work_row_of,
)


@triton.jit
def candidates_kernel(scores, stride_r, cand, runs, work, sync, N, W, k, lengths,
                       G: tl.constexpr, CHUNK: tl.constexpr,
                       SLOTS: tl.constexpr, LOG_C: tl.constexpr, BITMASK: tl.constexpr, REVERSE: tl.constexpr,
                       PDL: tl.constexpr):
    """One light program = one CHUNK of a row (no tail, few warps). It stores its counts of keys > T and == T, adds its
    candidates to the row's count (one atomic add) and marks them in the row's bitmask (a dense store), its keys == T in
    a second one when it has any (an overflowing row's fallback reads them). Not BITMASK (the runs mode): it also copies
    them (``key << 32 | id``, ascending, placed by ``hit_ranks``) to the run of ``runs`` its atomic add returned.
    REVERSE: the last rows first (the delegates launch read them last: more of them in L2)."""
    after_previous_launch(PDL)
    C_PAD: tl.constexpr = 1 << LOG_C
    WORDS: tl.constexpr = CHUNK // 32
    C = tl.cdiv(N, CHUNK)
    r = tl.program_id(0) // C
    if REVERSE:
        r = tl.num_programs(0) // C - 1 - r
    c = tl.program_id(0) % C
    k, length = row_k_len(r, N, W, k, lengths)
    work_row = work_row_of(work, r, LOG_C, G)
    T = tl.load(work_row + T_)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    key = keys_of(tl.load(scores + r.to(tl.int64) * stride_r + offs, mask=offs < length, other=0.0), offs < length)
    is_cand = (key >= T) & (key != -2147483648)
    both = tl.sum(is_cand.to(tl.int32) + ((key > T).to(tl.int32) << 16), axis=0)  # two counts (CHUNK < 2**16)
    n_c = both & 0xFFFF
    tl.store(work_row + HEAD + c, both >> 16)  # keys > T
    tl.store(work_row + HEAD + C_PAD + c, n_c - (both >> 16))  # keys == T
    base = tl.atomic_add(sync + r.to(tl.int64) * SYNC + CNT, n_c, sem="relaxed")  # (runs: [base, base + n_c))
    # the words of keys >= T (both modes: an overflowing row's fallback reads them); then, where the chunk has any,
    # those of keys == T
    bits = cand + r.to(tl.int64) * (2 * C * WORDS + SLOTS) + c * WORDS
    tl.store(bits + tl.arange(0, WORDS), bitmask_words(is_cand, WORDS))
    if n_c > (both >> 16):
        tl.store(bits + C * WORDS + tl.arange(0, WORDS), bitmask_words(is_cand & (key == T), WORDS))
    if not BITMASK:
        tl.store(work_row + HEAD + 2 * C_PAD + c, n_c)
        tl.store(work_row + HEAD + 3 * C_PAD + c, base)
        if base + n_c <= SLOTS:  # (their ranks from bitmask words: no prefix sum over the chunk)
            tl.store(runs + r.to(tl.int64) * SLOTS + base + hit_ranks(is_cand, WORDS),
                     (key.to(tl.int64) << 32) | offs.to(tl.int64), mask=is_cand)
