"""The device helpers the top-k kernels share (``docs/topk.md``): order-preserving int32 keys, window rounds over
256-bin histograms, the exact rank of a few keys, ordered writes by prefix sums, bitmask words and their set bits
as ascending slots, the per-row state's layout. ``@triton.jit`` helpers only, compiled into their callers."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels import after_previous_launch  # noqa: F401 (re-exported: the launches' PDL wait)

# The per-row state of the long rows: ``work`` (fresh each call), ``cand`` (fresh), ``sync`` (persistent, zero
# between calls). Offsets below; the layout is in docs/topk.md.
T_, SHIFT, FLAG, HEAD = (tl.constexpr(i) for i in (0, 1, 2, 4))
MEMBERS, DHIST, CNT, TMAX, SYNC = (tl.constexpr(i) for i in (1, 2, 258, 259, 260))
PAIR_SCRATCH = tl.constexpr(256)


@triton.jit
def keys_of(x, valid):
    """int32 keys, signed order == float order; NONE where the entry may not be selected."""
    x = x.to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0
    i = x.to(tl.int32, bitcast=True)
    key = i ^ ((i >> 31) & 0x7FFFFFFF)
    ok = valid & (x == x) & (x != float("-inf"))
    return tl.where(ok, key, -2147483648)


@triton.jit
def walk_histogram(h, k_rem):
    """The bin d holding the k_rem-th largest of a histogram walked from the top, and the new k_rem: a suffix sum, then
    one max over ``bin << 32 | keys above the bin`` (the count rides along with the bin)."""
    bins = tl.arange(0, h.shape[0])
    at_or_above = tl.cumsum(h, axis=0, reverse=True)
    best = tl.max(tl.where(at_or_above >= k_rem, (bins.to(tl.int64) << 32) | (at_or_above - h).to(tl.int64), -1),
                  axis=0)
    return (best >> 32).to(tl.int32), k_rem - (best & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def key_range(key, member):
    """The min and the max of the ``member`` keys (INT32_MAX and INT32_MIN when there are none)."""
    return tl.min(tl.where(member, key, 2147483647), axis=0), tl.max(tl.where(member, key, -2147483648), axis=0)


@triton.jit
def pairwise_kth(scratch, m, k_rem, PAIR: tl.constexpr):
    """``(t, ties)``: the k_rem-th largest of the m <= PAIR keys at scratch[0:m] and how many keys equal to ``t`` it
    takes; a key's rank is the count of keys above it (a [PAIR, PAIR] compare)."""
    i = tl.arange(0, PAIR)
    mk = tl.load(scratch + i, mask=i < m, other=-2147483648)
    above = tl.sum((mk[None, :] > mk[:, None]).to(tl.int32), axis=1)  # keys above each key
    t = tl.min(tl.where((i < m) & (above < k_rem), mk, 2147483647), axis=0)
    return t, k_rem - tl.sum((mk > t).to(tl.int32), axis=0)


@triton.jit
def write_above_and_ties(key, ids, t, need, ties_before, out_row, pos0, W):
    """Store the ids (order of ``ids``) of the keys > t and of the keys == t whose rank among the row's ties
    (``ties_before`` come earlier) is at most ``need``, from out_row[pos0]; returns how many. Two dependent prefix sums
    (one packed sum stored wrong ids on the H200: docs/performance.md)."""
    eq = key == t
    take = (key > t) | (eq & (ties_before + tl.cumsum(eq.to(tl.int32), axis=0) <= need))
    pos = pos0 + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_row + pos, ids, mask=take & (pos < W))
    return tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def bitmask_words(hit, WORDS: tl.constexpr):
    """A [WORDS * 32] mask as WORDS int32 words, bit i of word w = hit[32 w + i]: a dense store."""
    return tl.sum(tl.reshape(hit.to(tl.int32), [WORDS, 32]) << tl.arange(0, 32)[None, :], axis=1)


@triton.jit
def popcount32(word):
    """Set bits of each int32 word (counts per 2, 4, 8 bits, then one multiply adds the bytes)."""
    u = word.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def hit_ranks(hit, WORDS: tl.constexpr):
    """For each element of a [WORDS * 32] mask, how many hits come before it, with no prefix sum over the elements: one
    over the words' bit counts, plus a popcount of the bits below it in its word."""
    lane = tl.arange(0, 32)[None, :]
    word = bitmask_words(hit, WORDS)
    count = popcount32(word)
    first = tl.cumsum(count, axis=0) - count  # hits in the words before
    below = word[:, None] & ~(-1 << lane)  # the word's bits below each lane
    return tl.reshape(first[:, None] + popcount32(below), [WORDS * 32])


@triton.jit
def words_to_slots(word, w, done, dst, col0):
    """Store the columns of the set bits of ``word`` (bit i of word w is column ``col0 + 32 w + i``) at dst[done:],
    ascending; returns the new ``done``. Each word's first slot from one prefix sum over the bit counts; round j stores
    every word's lowest remaining bit: a store per set bit, no search."""
    count = popcount32(word)
    first = done + tl.cumsum(count, axis=0) - count  # the slot of each word's lowest set bit
    for j in range(0, tl.max(count, axis=0)):
        low = word & -word  # the lowest set bit (two's complement; bit 31 is -2**31, and -(-2**31) wraps to it)
        tl.store(dst + first + j, col0 + w * 32 + popcount32(low - 1), mask=j < count)  # (bits below it)
        word = word ^ low
    return done + tl.sum(count, axis=0)


@triton.jit
def bits_to_slots(words, n_words, dst, col0, WB: tl.constexpr):
    """``words_to_slots`` over ``n_words`` words in memory, in blocks of WB (loads past L1: the previous launch wrote
    them); returns how many."""
    done = tl.zeros([], tl.int32)
    for w0 in range(0, n_words, WB):
        w = w0 + tl.arange(0, WB)
        done = words_to_slots(tl.load(words + w, mask=w < n_words, other=0, cache_modifier=".cg"), w, done, dst,
                               col0)
    return done


@triton.jit
def key_bins(key, lo, shift):
    """A key's bin among 256 bins of width 2**shift from ``lo`` (the difference as uint32: exact for key >= lo; smaller
    keys, which callers mask, land in bin 255)."""
    return tl.minimum((key - lo).to(tl.uint32, bitcast=True) >> shift.to(tl.uint32), 255).to(tl.int32)


@triton.jit
def bin_shift(lo, hi):
    """The smallest shift whose 256 bins of width 2**shift from ``lo`` cover [lo, hi] (the exponent of ``span >> 8`` as
    a float32). Each window round's shift is at least 8 below the last: four rounds end on one key value."""
    span = hi.to(tl.int64) - lo.to(tl.int64)
    exponent = ((((span >> 8).to(tl.float32)).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2)
    return tl.where(span > 255, exponent + 1, 0)


@triton.jit
def _window_round(key, member, k_rem, lo, hi):
    """One round of ``narrow_window`` over [lo, hi]: the kept bin's lower edge, its keys, their count, and how many of
    them the k_rem-th largest takes."""
    shift = bin_shift(lo, hi)
    b = key_bins(key, lo, shift)
    d, k_rem = walk_histogram(tl.histogram(b, 256, mask=member), k_rem)
    member = member & (b == d)
    edge = (lo.to(tl.int64) + (d.to(tl.int64) << shift.to(tl.int64))).to(tl.int32)
    return edge, member, tl.sum(member.to(tl.int32), axis=0), k_rem


@triton.jit
def narrow_window(key, member, m, k_rem, lo, hi, limit, EXCESS: tl.constexpr, ROUNDS: tl.constexpr):
    """Up to ROUNDS window rounds toward the k_rem-th largest of the ``member`` keys (``m`` of them) in [lo, hi]: each
    bins them in 256 bins over the window, keeps the bin of the k_rem-th, and the next window is the kept keys' own
    range. Stops when the bin holds at most ``limit`` keys (EXCESS: at most ``limit`` more than k_rem) or one value.
    Returns ``(lo, member, m, k_rem)``: a lower bound that the original k_rem keys reach (the k-th key itself when the
    kept keys are one value), the kept keys, their count and how many of them the k-th takes."""
    m, k_rem = m + tl.zeros([], tl.int32), k_rem + tl.zeros([], tl.int32)  # (scalars, even from an int arg of 1,
    # which arrives as a constexpr: the rounds below redefine them, and a branch may not change their type)
    over = m - k_rem if EXCESS else m
    if (over > limit) & (lo < hi):
        lo, member, m, k_rem = _window_round(key, member, k_rem, lo, hi)
    for _ in range(1, ROUNDS):
        over = m - k_rem if EXCESS else m
        if over > limit:
            lo, hi = key_range(key, member)  # the window: the kept keys' own range
            if lo < hi:
                lo, member, m, k_rem = _window_round(key, member, k_rem, lo, hi)
    return lo, member, m, k_rem


@triton.jit
def pad_row(out_row, start, W, BLOCK: tl.constexpr):
    """-1 in out_row[start:W]."""
    for t in range(0, W, BLOCK):
        j = t + tl.arange(0, BLOCK)
        tl.store(out_row + j, tl.full([BLOCK], -1, tl.int32), mask=(j >= start) & (j < W))


@triton.jit
def row_k_len(r, N, W, k, lengths):
    """Row r's k (an int, or a pointer to one a row; clamped to [0, W]) and valid length (``lengths`` a pointer, or
    None: full; clamped to [0, N])."""
    k = k + tl.zeros([], tl.int32)  # (an int becomes a scalar tensor; a pointer stays a pointer)
    if k.dtype.is_ptr():
        k = tl.load(k + r)
    if lengths is None:
        length = tl.full([], 0, tl.int32) + N
    else:
        length = tl.minimum(tl.maximum(tl.load(lengths + r).to(tl.int64), 0), N).to(tl.int32)  # no int32 wrap
    return tl.minimum(tl.maximum(k, 0), W), length


@triton.jit
def work_row_of(work, r, LOG_C: tl.constexpr, G: tl.constexpr):
    """Row r of the ``work`` buffer (layout above)."""
    C_PAD: tl.constexpr = 1 << LOG_C
    return work + r.to(tl.int64) * (HEAD + 4 * C_PAD + G + PAIR_SCRATCH)


@triton.jit
def delegates_of(work_row, C_PAD: tl.constexpr):
    """Where a row's G delegates sit in its ``work`` row."""
    return work_row + HEAD + 4 * C_PAD
