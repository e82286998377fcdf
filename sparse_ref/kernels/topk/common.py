"""The device helpers shared by the top-k kernels (``__init__.py``, ``rows.py``, ``threshold.py``,
``candidates.py``, ``select.py``, ``sort.py``; the only module they import from each other, but for
``rows.py``, the rows held in registers): order-preserving int32 keys,
8-bit radix rounds and the walk of a 256-bin histogram, window rounds (256 bins over the keys' own range,
``narrow_window``), the exact rank of a few keys, ordered writes by prefix sums, bitmask words, the ranks of
their set bits and those bits as ascending slots, and the layout of the per-row state of the long-row kernels.
No kernel here: everything is a ``@triton.jit`` helper compiled into its callers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_ref.kernels import after_previous_launch  # noqa: F401 (re-exported: the launches' PDL wait)

# Long-row state. ``work`` (int32, fresh each call), one row per score row:
#   [T] threshold  [SHIFT] histogram bin width (log2)  [FLAG] 0 in the slots / 2 tie path / 3 the keys > T in
#   the slots / 1 whole-row radix;
#   then from HEAD, with C_PAD = 2**LOG_C: keys > T per chunk | keys == T per chunk (their sum: the chunk's
#   candidates; they give the bitmask mode's offsets and plan the tie path of a row whose candidates do
#   not fit) | the runs mode's candidates per chunk | the runs mode's first slot per chunk (C_PAD each) | the G
#   delegates | PAIR_SCRATCH ints for the pairwise rank (first, the delegates programs' own thresholds:
#   ``_local_threshold``).
# ``cand``, fresh each call, one row per score row: the runs mode's SLOTS slots (int64, ``key << 32 | id``
#   in runs), or the bitmask mode's bitmask (bit j % 32 of word j // 32 for column j: C * CHUNK / 32 int32
#   words, ``bitmask_words``) then its SLOTS slots (int32 columns, ascending).
# ``sync`` (int32, persistent, kept zeroed by the kernels: CUDA-graph replays need no memset):
#   [0] the row's program counter ("last program of the row": the delegates launch, then the select
#   launch), [MEMBERS] the select program's counter of the keys in its crossing bin, [DHIST, DHIST + 256)
#   the histogram of the top 8 bits of the row's delegates (then of the select program's slots), [CNT] the
#   row's candidates (the runs mode's slot allocator), [CNT2] the slot allocator of an overflowing row's
#   keys above T (runs mode, flag 3); [TMAX] the row max as the unsigned maximum of the unsigned-order
#   keys (zero is its identity: the buffer stays zeroed).
T_, SHIFT, FLAG, HEAD = (tl.constexpr(i) for i in (0, 1, 2, 4))
MEMBERS, DHIST, CNT, CNT2, TMAX, SYNC = (tl.constexpr(i) for i in (1, 2, 258, 259, 260, 261))
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
    """Walk a histogram (256 bins, or the direct plan's value round's) from the top: the bin d holding the
    k_rem-th largest, and the new k_rem (minus the keys in the bins above d). Two block-wide steps: a suffix
    sum, then one max over ``bin << 32 | keys above the bin`` of the bins that k_rem keys reach (a sequential
    step costs more than its arithmetic, so the count rides along with the bin)."""
    bins = tl.arange(0, h.shape[0])
    at_or_above = tl.cumsum(h, axis=0, reverse=True)
    best = tl.max(tl.where(at_or_above >= k_rem, (bins.to(tl.int64) << 32) | (at_or_above - h).to(tl.int64), -1),
                  axis=0)
    return (best >> 32).to(tl.int32), k_rem - (best & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def radix_rounds(key, ut, k_rem, FIRST: tl.constexpr, LAST: tl.constexpr):
    """Radix rounds FIRST..LAST-1 (8 bits each, top first) of the k_rem-th largest key: ``ut`` holds the
    digits found so far (unsigned order, as int32 bits); returns it with the new digits and the new k_rem."""
    u = key ^ -2147483648  # unsigned order, as int32 bits
    for p in tl.static_range(FIRST, LAST):
        match = key != -2147483648
        if p > 0:
            match = match & ((u >> (32 - 8 * p)) == (ut >> (32 - 8 * p)))
        h = tl.histogram((u >> (24 - 8 * p)) & 0xFF, 256, mask=match)
        d, k_rem = walk_histogram(h, k_rem)
        ut = ut | (d << (24 - 8 * p))
    return ut, k_rem


@triton.jit
def key_range(key, member):
    """The min and the max of the ``member`` keys (INT32_MAX and INT32_MIN when there are none)."""
    return tl.min(tl.where(member, key, 2147483647), axis=0), tl.max(tl.where(member, key, -2147483648), axis=0)


@triton.jit
def exact_delegate(dkey, ut, k_rem):
    """The exact k-th delegate (its unsigned-order digits, as ``ut``), given ``ut``/``k_rem`` after radix
    rounds 1-2 (its top 16 bits). When every delegate sharing those 16 bits is the same key (a plateau
    of equal values; clusters of bf16 values, whose 16-bit prefix is the whole value), that key is it:
    a min and a max instead of two more histogram rounds over the delegates. Else rounds 3-4."""
    u = dkey ^ -2147483648
    member = (dkey != -2147483648) & ((u >> 16) == (ut >> 16))
    lo, hi = key_range(dkey, member)
    if lo == hi:
        ut = lo ^ -2147483648
    else:
        ut, k_rem = radix_rounds(dkey, ut, k_rem, 2, 4)
    return ut


@triton.jit
def pairwise_kth(scratch, m, k_rem, PAIR: tl.constexpr):
    """``(t, ties)``: the k_rem-th largest of the m <= PAIR keys at scratch[0:m] (in any order), and how
    many keys equal to ``t`` it takes; a key's rank is the count of keys above it (a [PAIR, PAIR] compare)."""
    i = tl.arange(0, PAIR)
    mk = tl.load(scratch + i, mask=i < m, other=-2147483648)
    above = tl.sum((mk[None, :] > mk[:, None]).to(tl.int32), axis=1)  # keys above each key
    t = tl.min(tl.where((i < m) & (above < k_rem), mk, 2147483647), axis=0)
    return t, k_rem - tl.sum((mk > t).to(tl.int32), axis=0)


@triton.jit
def write_above_and_ties(key, ids, t, need, ties_before, out_row, pos0, W):
    """Store the ids (in the order of ``ids``) of the keys > t and of the keys == t whose rank among the
    row's ties (``ties_before`` of them come earlier in the row) is at most ``need``, from out_row[pos0].
    Returns how many were taken. Two prefix sums, the second over the keys the first lets through (one
    packed sum, or two independent ones, measured faster on the tie path but stored wrong ids on the
    H200 with triton 3.6 at tiles of 8192 keys over 16 warps: docs/performance.md)."""
    eq = key == t
    take = (key > t) | (eq & (ties_before + tl.cumsum(eq.to(tl.int32), axis=0) <= need))
    pos = pos0 + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_row + pos, ids, mask=take & (pos < W))
    return tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def bitmask_words(hit, WORDS: tl.constexpr):
    """A [WORDS * 32] mask as WORDS int32 words, bit i of word w = hit[32 w + i] (the sum of distinct bits is
    their OR). A dense store, unlike a compaction: it costs nothing over the read that computed ``hit``."""
    return tl.sum(tl.reshape(hit.to(tl.int32), [WORDS, 32]) << tl.arange(0, 32)[None, :], axis=1)


@triton.jit
def popcount32(word):
    """Set bits of each int32 word: counts per 2, 4 and 8 bits side by side, then one multiply adds the bytes."""
    u = word.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def hit_ranks(hit, WORDS: tl.constexpr):
    """For each element of a [WORDS * 32] mask, how many hits come before it (a hit's place in an ordered
    compaction), without a prefix sum over the elements: the mask as WORDS bitmask words, one prefix sum
    over the words' bit counts, then each element adds the set bits below it in its own word (a popcount)."""
    lane = tl.arange(0, 32)[None, :]
    word = bitmask_words(hit, WORDS)
    count = popcount32(word)
    first = tl.cumsum(count, axis=0) - count  # hits in the words before
    below = word[:, None] & ~(-1 << lane)  # the word's bits below each lane
    return tl.reshape(first[:, None] + popcount32(below), [WORDS * 32])


@triton.jit
def words_to_slots(word, w, done, dst, col0):
    """Store the columns of the set bits of the bitmask words ``word`` (bit i of word w is column
    ``col0 + 32 w + i``) at dst[done:], ascending; returns ``done`` plus how many. One prefix sum over the
    words' bit counts gives each word its first slot; then round j stores every word's j-th set bit (its
    lowest, which the round then clears) at that slot + j, for as many rounds as the fullest word has bits
    (a few on random rows). No prefix sum over the columns and no search: a store per set bit."""
    count = popcount32(word)
    first = done + tl.cumsum(count, axis=0) - count  # the slot of each word's lowest set bit
    for j in range(0, tl.max(count, axis=0)):
        low = word & -word  # the lowest set bit (two's complement; bit 31 is -2**31, and -(-2**31) wraps to it)
        tl.store(dst + first + j, col0 + w * 32 + popcount32(low - 1), mask=j < count)  # (bits below it)
        word = word ^ low
    return done + tl.sum(count, axis=0)


@triton.jit
def bits_to_slots(words, n_words, dst, col0, WB: tl.constexpr):
    """Store the columns of the set bits of ``n_words`` bitmask words in memory (bit 0 of the first word is
    column ``col0``) at dst[0:], ascending; returns how many. Blocks of WB words (``words_to_slots``). The
    loads go past L1 (.cg): the previous launch wrote the words."""
    done = tl.zeros([], tl.int32)
    for w0 in range(0, n_words, WB):
        w = w0 + tl.arange(0, WB)
        done = words_to_slots(tl.load(words + w, mask=w < n_words, other=0, cache_modifier=".cg"), w, done, dst,
                               col0)
    return done


@triton.jit
def key_bins(key, lo, shift):
    """A key's bin among 256 bins of width 2**shift from ``lo``: (key - lo) >> shift, in [0, 256) for lo <= key
    < lo + 256 << shift (the difference taken as uint32: exact for key >= lo, in 32-bit arithmetic; smaller
    keys, which callers mask, land in bin 255)."""
    return tl.minimum((key - lo).to(tl.uint32, bitcast=True) >> shift.to(tl.uint32), 255).to(tl.int32)


@triton.jit
def bin_shift(lo, hi):
    """The smallest ``shift`` whose 256 bins of width 2**shift from ``lo`` cover the keys [lo, hi]: the bit
    length of the span minus 8, from the exponent of ``span >> 8`` as a float32 (below 2**24: exact).
    Scalar arithmetic, no reduction. So each window round's shift is at least 8 below the last one's, and
    four rounds always end on a single key value."""
    span = hi.to(tl.int64) - lo.to(tl.int64)
    exponent = ((((span >> 8).to(tl.float32)).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2)
    return tl.where(span > 255, exponent + 1, 0)


@triton.jit
def _window_round(key, member, k_rem, lo, hi):
    """One histogram round of ``narrow_window`` over the window [lo, hi]: the kept bin's lower edge, its keys,
    their count, and how many of them the k_rem-th largest takes."""
    shift = bin_shift(lo, hi)
    b = key_bins(key, lo, shift)
    d, k_rem = walk_histogram(tl.histogram(b, 256, mask=member), k_rem)
    member = member & (b == d)
    edge = (lo.to(tl.int64) + (d.to(tl.int64) << shift.to(tl.int64))).to(tl.int32)
    return edge, member, tl.sum(member.to(tl.int32), axis=0), k_rem


@triton.jit
def narrow_window(key, member, m, k_rem, lo, hi, limit, EXCESS: tl.constexpr, ROUNDS: tl.constexpr):
    """Up to ROUNDS histogram rounds in a shrinking window toward the k_rem-th largest of the ``member``
    keys (``m`` of them), all in [lo, hi]. A round (``_window_round``) bins them in 256 bins over the
    window, walks the histogram from the top to the bin holding the k_rem-th and keeps that bin's keys; the
    next round's window is their own range (a min and a max), so it stops at once when they are all one
    value. It stops once the bin holds at most ``limit`` keys (EXCESS: at most ``limit`` more than the
    k_rem it must give), or a single key value.

    Unlike radix rounds on fixed bit positions, the window is the keys' own range: on random, sorted or
    tightly packed values (page scores within ~2%) one round already leaves a handful of keys per bin. So
    the first round is written out, and the others (ties, clusters) run in a loop: one copy of their code.
    Returns ``(lo, member, m, k_rem)``: a lower bound of the kept keys (at least the original k_rem keys are
    >= it: the bin's lower edge, or their min), the kept keys, their count, and how many of them the k-th
    takes. When they are one value, ``lo`` is the k-th key itself."""
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
    """Row r's k (clamped to [0, W]) and valid length (clamped to [0, N]). ``k``: an int, or a pointer to
    one k per row; ``lengths``: a pointer to one length per row, or None (every row is full)."""
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
