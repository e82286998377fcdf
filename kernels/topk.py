"""Exact batched top-k: one read of the row, then exact work on a few thousand candidates only.

Semantics: ``sparse_ref.selection.topk_reference`` (candidates are ``j < length`` whose score is
not NaN and not -inf; ties go to the lower id; -0.0 == +0.0; -1 padding at the end).

The design, in five steps:

1. **Keys.** Each score becomes an int32 key whose *signed* order is the float order
   (``i ^ ((i >> 31) & 0x7FFFFFFF)`` on the float bits, -0.0 folded into +0.0). Entries that may
   not be selected (NaN, -inf, past the row's length) get ``NONE = INT32_MIN``, below every real key.
2. **Delegates.** View the row as ``[N / G, G]`` and take the maximum of every column: delegate
   ``j`` is the largest of the strided elements ``j, j + G, j + 2G, ...`` (strided, so a sorted row
   cannot hide its top in a few columns). With ``G >= 2k`` this is one plain read of the row.
3. **Threshold.** ``T`` = (a lower bound of) the k-th largest delegate. The k delegates at or above
   ``T`` are row elements, so **at least k elements are >= T**: the top-k is inside ``{x >= T}``. For
   random rows that set holds ``~0.7 G`` candidates (a few percent of a long row). ``T`` need not be
   exact, only tight: it is the lower edge of the bin holding the k-th delegate in one 256-bin histogram
   round over the delegates' own range [min, max] (``_narrow``, a *window round*: unlike radix rounds on
   fixed bits, it adapts to values packed within a few percent). More rounds, each over the kept bin's
   own range, run only when too many delegates share the bin (ties, clusters, plateaus: then ``T``
   becomes the exact k-th delegate, so that equal keys *equal* ``T``). With at most
   ``TUNING["local_threshold"]`` delegates programs per row, each program finds that threshold for its
   own delegates and its share ``ceil(k / S)`` of k, and T is the highest of those that k delegates
   reach: no histogram round over the G delegates waits at the end. With more programs per row (few
   rows), the row's last program takes the k-th delegate cut to 16 bits (two radix rounds, the first
   from the programs' merged histograms), exact when many delegates share the cut.
4. **Candidates.** Every element ``>= T`` is a candidate; only candidates are searched for the exact
   k-th key ``t``. Long rows: every chunk program counts its keys > T and == T and adds its candidates
   to the row's count (one atomic add). Then the candidates reach the row's slots in one of two modes,
   chosen by the number of chunk programs (``TUNING["bitmask_programs"]``). **Runs** (few rows: the
   chunk programs are few, and whatever they do costs little): each chunk copies its candidates (key
   and id, ascending id) to the run of slots its atomic add returned, and the select launch's first
   program per row selects among them at once. **Bitmask** (many rows, where the per-chunk prefix sum and
   scattered stores cost 7-28 µs): each chunk only marks them in the row's bitmask (a dense store), the
   select launch's programs each copy their span's set bits into the slots at the offset the chunk counts
   give (``_bits_to_slots``: ascending ids, a store per candidate, no prefix sum over the columns), and
   the row's last program selects. Either way the selecting program bins the slots' keys in a 256-bin
   histogram over ``[T, row max]`` (atomic adds into a zeroed histogram in memory), walks it to the bin
   holding the k-th key, ranks the few keys of that bin pairwise (``TUNING["pair_rank"]``) to get ``t``,
   and stores every ``key > t`` plus the first ``key == t`` (ties to the lower id) at its place in id
   order (one prefix sum over the slots; the runs mode corrects for the order the runs landed in).
   Ascending ids, no sort. A crossing bin of more than ``pair_rank`` keys (ties, bf16 scores) first
   narrows by window rounds over its own range. Register rows do the same in registers: a bitmask word
   per 32 columns gives the slots, window rounds over ``[T, row max]`` and a pairwise rank give ``t``.
5. **Fallback.** A row whose candidates do not fit the slots (plateaus or clusters of equal values,
   a period of G, more than half the row wanted) is flagged on the device and takes an exact
   fallback (``kernels/topk_fallback.py``): the tie path; or, when k or more keys are above ``T`` and
   they fit the slots, the selection again on those keys only; or at worst a whole-row radix select.

``order="score"`` then sorts the <= k winners of each row (``kernels/topk_sort.py``). The device
helpers all of them share (keys, radix and window rounds, ranks, ordered writes, the per-row state) are in
``kernels/topk_common.py``.

Launch shapes: a row of at most ``TUNING["register_row"]`` columns is handled by ONE program that
keeps it in registers (one launch; the tie path runs in registers too). Longer rows use three
launches: delegates (a few programs per row; the last one to finish computes ``T``), candidates (a
light program per chunk, no serial tail) and select (a few programs per row, ``select_programs`` in
all, each a span of the row: in the runs mode the first writes the row's answer while the others return
at once; in the bitmask mode every one copies its span's candidates and the last one selects; on a
flagged row every program writes its span of the fallback). The selection is a launch of its own so
that the wide per-chunk pass runs with few warps and the one serial step per row with many; the
fallback shares the select launch because a launch of its own cost 3-10 µs even when no row needed it.
"Last program of the row" is an atomic counter that the last program resets, and the select launch
resets the row's candidate count, so nothing is read back to the host and the call can be captured in
a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    capturing,
    check_choice,
    check_int,
    check_range,
    check_same_device,
    check_tensor,
    fail,
)
from sparse_ref.device import check_kernel_device
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import topk_fallback, topk_sort
from sparse_ref.kernels.topk_common import (
    AOT_FLAGS,
    AOT_PTRS,
    CNT,
    CNT2,
    DHIST,
    FLAG,
    HEAD,
    MEMBERS,
    PAIR_SCRATCH,
    SHIFT,
    SYNC,
    T_,
    TMAX,
    _after_previous_launch,
    _bin_shift,
    _bins,
    _bitmask_words,
    _bits_to_slots,
    _delegates_of,
    _exact_delegate,
    _key_range,
    _keys,
    _narrow,
    _pad,
    _pairwise_kth,
    _radix_rounds,
    _row_k_len,
    _select_in_registers,
    _walk,
    _work_row,
    aot_variant,
    work_width,
)
from sparse_ref.kernels.topk_fallback import _above_to_slots, _plan_tie_path, _radix_select_row, _tie_path_span

NONE = -2147483648  # key of an entry that may not be selected (INT32_MIN)
# Launch knobs (module level so tests can force paths and benchmarks can try variants).
TUNING = {
    "register_row": 8192,  # rows up to this many columns: one program per row, row in registers
    "min_delegates": 256,  # G = max(this, next_pow2(2 k)), at most max_delegates
    "max_delegates": 8192,
    "slots_per_delegate": 1,  # SLOTS = this * G candidates per row before the fallback (expected: ~0.7 G)
    "slots": 0,  # if > 0: SLOTS (tests shrink it to force the fallback)
    "chunk": 2048,  # columns per candidate program
    "bitmask_programs": 1024,  # at least this many candidates programs (rows x chunks): the bitmask mode
    "delegate_cols": 1024,  # delegate columns per delegate program
    "num_warps": 8,  # register rows (one program per row) and the fused page selection
    "delegate_warps": 8,  # long rows: the delegates launch (and the whole-row radix when k is too wide for delegates)
    "min_programs": 256,  # fewer rows than this fills: smaller chunks / delegate slices per program
    "candidate_warps": 4,  # the candidates launch: a program per chunk, no serial tail
    "reverse_rows": True,  # the candidates launch takes the rows last-first (the delegates launch read them last)
    "select_warps": 16,  # the select launch: the exact selection on a row's slots, or a span of its fallback
    "select_programs": 256,  # the select launch: about this many programs (at least one per row), each a span
    "tie_tile": 2048,  # columns per load of a flagged row's select program (a power of two; at least one chunk)
    "local_threshold": 4,  # up to this many delegates programs per row: T from their own thresholds
    "delegate_tile": 8192,  # scores per load of a delegates program (ROWS x COLS)
    "block": 1024,  # tile of the -1 padding and of the fallback's tile loops
    "sort_warps": 16,  # warps of the order="score" sort when it holds >= 2048 winners
    "sort_run": 512,  # > 0: order="score" sorts runs of this many winners in parallel, then merges them
    "sort_run_warps": 4,
    "pdl": True,  # programmatic dependent launch between the long-row launches (Hopper and later)
    "pair_rank": 128,  # > 0: the exact k-th key by a pairwise rank of up to this many keys of one bin
}
MAX_SORT_WIDTH = 4096  # order="score" sorts a row's winners inside one tile of at most this many
ORDERS = ("score", "index", "none")


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _register_row_kernel(scores, stride_r, out, scratch, flags, N, W, k_scalar, k_ptr, len_ptr,
                         HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, N_PAD: tl.constexpr, G: tl.constexpr,
                         SLOTS: tl.constexpr, PAIR: tl.constexpr, BLOCK_OUT: tl.constexpr):
    """One program = one row of at most N_PAD columns, held in registers: the whole top-k, one launch."""
    r = tl.program_id(0)
    k, length = _row_k_len(r, N, W, k_scalar, k_ptr, len_ptr, HAS_K, HAS_LEN)
    out_row = out + r.to(tl.int64) * W
    k_eff, path = _select_in_registers(scores + r.to(tl.int64) * stride_r, 0, length, k, out_row, 0, W,
                                       scratch + r.to(tl.int64) * SLOTS, N_PAD, G, SLOTS, PAIR)
    tl.store(flags + r, path)
    _pad(out_row, k_eff, W, BLOCK_OUT)


@triton.jit
def _delegates_kernel(scores, stride_r, work, sync, N, W, k_scalar, k_ptr, len_ptr,
                      HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, G: tl.constexpr, COLS: tl.constexpr,
                      ROWS: tl.constexpr, LOG_C: tl.constexpr, LOCAL: tl.constexpr, PDL: tl.constexpr):
    """One program = COLS delegate columns of one row (max over the strided [N/G, COLS] slice); then T.
    LOCAL (at most ``TUNING["local_threshold"]`` programs per row): each program finds its own threshold
    and T is the highest of them that k delegates reach (``_local_threshold``). Else each program adds
    the histogram of its delegates' top 8 bits to the row's and the row's last program finds the k-th
    delegate (``_row_threshold``). Either way at least k delegates reach T (NONE if the row has fewer than
    k), and the row's last program sets the width 2**SHIFT of the select program's histogram bins (256
    bins cover [T, row max])."""
    _after_previous_launch(PDL)
    C_PAD: tl.constexpr = 1 << LOG_C
    S: tl.constexpr = G // COLS  # programs per row
    r = tl.program_id(0) // S  # row-major order: a row's programs run together, the last rows last
    c = tl.program_id(0) % S
    k, length = _row_k_len(r, N, W, k_scalar, k_ptr, len_ptr, HAS_K, HAS_LEN)
    row = scores + r.to(tl.int64) * stride_r
    work_row = _work_row(work, r, LOG_C, G)
    delegates = _delegates_of(work_row, C_PAD)
    cols = c * COLS + tl.arange(0, COLS)
    acc = tl.full([COLS], -2147483648, tl.int32)
    for i in range(0, tl.cdiv(N, G), ROWS):
        offs = (i + tl.arange(0, ROWS))[:, None] * G + cols[None, :]
        x = tl.load(row + offs, mask=offs < length, other=0.0)
        acc = tl.maximum(acc, tl.max(_keys(x, offs < length), axis=0))
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
    histogram rounds over the delegates' own range (``_narrow``: one round on random rows; more, up to the
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
    lo, top = _key_range(acc, ok)
    t_c, _, _, _ = _narrow(acc, ok, n_c, tl.maximum(tl.minimum(k_c, n_c), 1), lo, top, k_c // 8, True,
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
    cut to 16 bits (radix round 2), exact (``_exact_delegate``) when more than k + k/8 delegates reach the
    cut; NONE when there are fewer than k delegates."""
    n = tl.sum(h, axis=0)  # valid delegates
    d, k_rem = _walk(h, tl.maximum(tl.minimum(k, n), 1))
    ut, k_rem = _radix_rounds(dkey, d << 24, k_rem, 1, 2)
    if tl.sum((dkey >= (ut ^ -2147483648)).to(tl.int32), axis=0) > k + k // 8:  # many share its 16 bits:
        ut = _exact_delegate(dkey, ut, k_rem)  # T = the exact k-th delegate
    return tl.where(n >= k, ut ^ -2147483648, -2147483648)


@triton.jit
def _store_threshold(work_row, T, row_max):
    """Store T and the width 2**SHIFT of the select program's histogram bins (256 bins cover [T, row max])."""
    tl.store(work_row + T_, T)
    tl.store(work_row + SHIFT, _bin_shift(T, row_max))


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
def _candidates_kernel(scores, stride_r, cand, work, sync, N, W, k_scalar, k_ptr, len_ptr,
                       HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, G: tl.constexpr, CHUNK: tl.constexpr,
                       SLOTS: tl.constexpr, LOG_C: tl.constexpr, BITMASK: tl.constexpr, REVERSE: tl.constexpr,
                       PDL: tl.constexpr):
    """One program = one CHUNK of a row: its elements >= T are the candidates. It adds their count to the
    row's (one atomic add) and stores its counts of keys > T and == T (the select launch's offsets, and the
    tie path's plan if the row overflows). Then, BITMASK: it marks them in the row's bitmask (CHUNK / 32
    words, a dense store: nothing over the read); else it copies them (``key << 32 | id``, ascending id)
    to the run of the row's slots that its atomic add returned (a prefix sum over the chunk and a store
    per candidate: with few rows there are few programs and this costs little; with many, several µs).
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
    k, length = _row_k_len(r, N, W, k_scalar, k_ptr, len_ptr, HAS_K, HAS_LEN)
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
        if base + n_c <= SLOTS:
            tl.store(cand + r.to(tl.int64) * SLOTS + base + tl.cumsum(is_cand.to(tl.int32), axis=0) - 1,
                     (key.to(tl.int64) << 32) | offs.to(tl.int64), mask=is_cand)


@triton.jit
def _select_kernel(scores, stride_r, out, cand, work, sync, N, W, k_scalar, k_ptr, len_ptr,
                   HAS_K: tl.constexpr, HAS_LEN: tl.constexpr, G: tl.constexpr, CHUNK: tl.constexpr,
                   SLOTS: tl.constexpr, LOG_C: tl.constexpr, BITMASK: tl.constexpr, PAIR: tl.constexpr,
                   SPAN: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
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
    k, length = _row_k_len(r, N, W, k_scalar, k_ptr, len_ptr, HAS_K, HAS_LEN)
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
                              BLOCK)
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
            _radix_select_row(row, length, k, out_row, W, BLOCK)
        if (f == 0) & (flag == 2):
            _pad(out_row, k, W, BLOCK)  # (the tie path writes exactly k ids)
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
                                     PAIR, BLOCK)
                else:
                    _select_from_runs(slots_row, work_row, sync_row, out_row, total, k, C, W, G, CHUNK, SLOTS,
                                      C_PAD, PAIR, BLOCK)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
_SYNC: dict = {}


def _sync_buffer(device: torch.device, R: int) -> torch.Tensor:
    """Zeroed per-row counters and histograms [R, SYNC]; the kernels leave them at zero again.

    One buffer per device: two top-k calls running at the same time on different streams would
    share it (not supported)."""
    key = str(device)
    buf = _SYNC.get(key)
    if buf is None or buf.shape[0] < R:
        buf = torch.zeros((max(R, 64), SYNC.value), dtype=torch.int32, device=device)
        if not capturing():  # a buffer made during a capture belongs to that graph's memory pool
            _SYNC[key] = buf
    return buf


def pdl_options(device: torch.device) -> dict:
    """Launch options for programmatic dependent launch (``_after_previous_launch``): the constexpr and
    ``launch_pdl`` on a Hopper-or-later GPU when ``TUNING["pdl"]``; off on the CPU interpreter."""
    on = (TUNING["pdl"] and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


def plan(R: int, N: int, width: int) -> dict:
    """Launch constants for R rows of N columns and at most ``width`` winners (see TUNING)."""
    n_pad = max(32, triton.next_power_of_2(N))  # (at least one bitmask word)
    G = max(TUNING["min_delegates"], triton.next_power_of_2(max(2 * width, 1)))
    register = N <= TUNING["register_row"]
    if register:
        G = min(G, n_pad)
    slots = TUNING["slots"] or TUNING["slots_per_delegate"] * G
    chunk, cols = max(32, min(TUNING["chunk"], n_pad, 1 << 15)), min(TUNING["delegate_cols"], G)  # (chunk: whole
    # bitmask words; < 2**16: two counts packed in one int32)
    while R * triton.cdiv(N, chunk) < TUNING["min_programs"] and chunk > 1024:  # few rows: more, smaller
        chunk //= 2  # programs per row
    while R * (G // cols) < TUNING["min_programs"] and cols > 64:
        cols //= 2
    slots = min(slots, n_pad, 1 << 14)  # (< 2**15: the select program packs two counts in one int32)
    pair = min(TUNING["pair_rank"], slots, PAIR_SCRATCH.value) if slots >= 16 else 0  # PAIR <= slots
    return dict(register=register, n_pad=n_pad, G=G, slots=slots, chunk=chunk, cols=cols, pair=pair,
                force_fallback=not register and G > TUNING["max_delegates"])


def launches(scores, k_scalar, k_tensor, lengths, out, stats: dict | None = None) -> list:
    """The kernel launches of one top-k call (no checks), as ``[(name, fn), ...]``: calling every ``fn``
    in order writes the ids of each row's winners in ascending order into ``out``. Separate so that a
    benchmark can time each launch on its own (``benchmarks/gpu_topk.py``).

    ``stats`` (a dict) receives the plan, the per-row path ``flags`` (0 = exact select on the candidates,
    2 = tie path, 3 = exact select on the keys above the threshold, copied again, 1 = whole-row radix
    select) and on the long-row path the ``threshold`` keys, the per-chunk counts of keys ``above`` it and
    equal to it (``ties``; their sum is the chunk's candidates), the mode (``bitmask``), the candidate
    ``slots``, the select programs' ``span`` of columns, and the bitmask (``bits``) or each chunk's run
    (``counts``, ``run_starts``), valid after the launches ran.
    """
    R, N = scores.shape
    W = out.shape[1]
    device = scores.device
    p = plan(R, N, W)
    stats = {} if stats is None else stats
    stats["plan"] = p
    nw = TUNING["num_warps" if p["register"] else "delegate_warps"] if device.type == "cuda" else 1
    row_args = dict(k_scalar=min(k_scalar, N), k_ptr=k_tensor if k_tensor is not None else out,
                    len_ptr=lengths if lengths is not None else out, HAS_K=k_tensor is not None,
                    HAS_LEN=lengths is not None)
    stride = scores.stride(0)
    if p["register"]:
        scratch = torch.empty((R, p["slots"]), dtype=torch.int32, device=device)
        stats["flags"] = flags = torch.empty((R,), dtype=torch.int32, device=device)
        return [("register_row", lambda: _register_row_kernel[(R,)](
            scores, stride, out, scratch, flags, N, W, **row_args, N_PAD=p["n_pad"], G=p["G"], SLOTS=p["slots"],
            PAIR=p["pair"], BLOCK_OUT=min(1024, max(16, triton.next_power_of_2(W))), num_warps=nw))]
    block = TUNING["block"] if device.type == "cuda" else min(TUNING["block"], p["n_pad"])
    G, cols, chunk = p["G"], p["cols"], p["chunk"]
    C = triton.cdiv(N, chunk)
    log_c = max(1, (C - 1).bit_length())
    if p["force_fallback"]:  # every row takes the whole-row radix: flag 1, as the stats report it
        stats["flags"] = torch.ones((R,), dtype=torch.int32, device=device)
        return [("whole_row", lambda: topk_fallback._whole_row_kernel[(R,)](
            scores, stride, out, N, W, **row_args, BLOCK=block, num_warps=nw))]

    def warps(knob):
        return TUNING[knob] if device.type == "cuda" else 1

    pdl = pdl_options(device)

    sync = _sync_buffer(device, R)
    work = torch.empty((R, work_width(1 << log_c, G)), dtype=torch.int32, device=device)
    bitmask = R * C >= TUNING["bitmask_programs"]
    n_words = C * (chunk // 32) if bitmask else 0
    cand = torch.empty((R, n_words + p["slots"]), dtype=torch.int32 if bitmask else torch.int64, device=device)
    head = [HEAD.value + i * (1 << log_c) for i in range(4)]  # (the work layout: kernels/topk_common.py)
    stats.update(above=work[:, head[0]:head[0] + C], ties=work[:, head[1]:head[1] + C], threshold=work[:, T_.value],
                 flags=work[:, FLAG.value], bitmask=bitmask, slots=cand[:, n_words:])
    if bitmask:
        stats["bits"] = cand[:, :n_words]
    else:
        stats.update(counts=work[:, head[2]:head[2] + C], run_starts=work[:, head[3]:head[3] + C])
    rows = max(1, min(TUNING["delegate_tile"] // cols, triton.next_power_of_2(triton.cdiv(N, G))))
    shape = dict(G=G, CHUNK=chunk, SLOTS=p["slots"], LOG_C=log_c, BITMASK=bitmask)
    tile = max(chunk, min(TUNING["tie_tile"], p["n_pad"]))  # a flagged row: its select programs' loads
    spans = max(1, min(triton.cdiv(N, tile), TUNING["select_programs"] // R))  # select programs per row
    span = max(tile, triton.next_power_of_2(triton.cdiv(N, spans)))  # (a power of two: whole tiles, chunks and
    # bitmask words, and _bits_to_slots' blocks of words must be a power of two)
    assert span % chunk == 0 and chunk % 32 == 0
    stats["span"] = span
    return [
        ("delegates", lambda: _delegates_kernel[(R * (G // cols),)](
            scores, stride, work, sync, N, W, **row_args, G=G, COLS=cols, ROWS=rows, LOG_C=log_c,
            LOCAL=G // cols <= TUNING["local_threshold"], num_warps=nw, **pdl)),
        ("candidates", lambda: _candidates_kernel[(R * C,)](
            scores, stride, cand, work, sync, N, W, **row_args, **shape, REVERSE=TUNING["reverse_rows"],
            num_warps=warps("candidate_warps"), **pdl)),
        ("select", lambda: _select_kernel[(R, triton.cdiv(N, span))](
            scores, stride, out, cand, work, sync, N, W, **row_args, **shape, PAIR=p["pair"], SPAN=span, TILE=tile,
            BLOCK=block, num_warps=warps("select_warps"), **pdl)),
    ]


def launch_topk(scores, k_scalar, k_tensor, lengths, out, stats: dict | None = None):
    """Run the kernels (no checks; see ``launches``). Returns the per-row path flags, for tests."""
    stats = {} if stats is None else stats
    for _, fn in launches(scores, k_scalar, k_tensor, lengths, out, stats):
        fn()
    return stats.get("flags")


def sort_winners(scores, out):
    """Reorder each row of ``out`` (ids, -1 padded) by descending score, ties by ascending id. Rows wider
    than ``TUNING["sort_run"]``: runs of that many sorted by parallel programs, then merged (two launches).

    The first sort launch waits for the selection the plain way, without programmatic dependent launch:
    launched early, its programs would be placed while the selection's long programs still hold most
    SMs, crowd onto the free ones, and then sort there (measured on an H200: PDL there made score order
    6.5 µs slower at 64 x 65536)."""
    R, W = out.shape
    w_pad = max(16, triton.next_power_of_2(W))
    run = TUNING["sort_run"]
    if 0 < run < w_pad:
        runs = torch.empty((R, w_pad), dtype=torch.int64, device=out.device)
        nw = TUNING["sort_run_warps"] if scores.is_cuda else 1
        pdl = pdl_options(out.device)
        topk_sort._sort_runs_kernel[(R, w_pad // run)](scores, scores.stride(0), out, runs, W, RUN=run, W_PAD=w_pad,
                                                       num_warps=nw, PDL=False)
        topk_sort._merge_runs_kernel[(R, w_pad // run)](runs, out, W, RUN=run, W_PAD=w_pad, num_warps=nw, **pdl)
        return out
    num_warps = (TUNING["sort_warps"] if w_pad >= 2048 else 8 if w_pad >= 512 else 4) if scores.is_cuda else 1
    topk_sort._sort_winners_kernel[(R,)](scores, scores.stride(0), out, W, W_PAD=w_pad, num_warps=num_warps,
                                         PDL=False)
    return out


def check_scores(fn: str, name: str, scores) -> None:
    """dtype, rank, stride, device and size checks for a [rows, N] score matrix."""
    check_tensor(f"{fn}: {name}", scores, dtype=FLOAT_DTYPES, dims=2, fix="pass a 2-D float tensor [rows, N].")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        fail(f"{fn}: {name}", "unit stride along the last dim", f"strides {scores.stride()}",
             f"pass {name}.contiguous().")
    check_kernel_device(f"{fn}: {name}", scores, "move it with .cuda().")
    if scores.shape[1] >= 2**31 - 1:
        fail(f"{fn}: {name}", "rows shorter than 2**31 - 1", f"N={scores.shape[1]}", "split the rows.")


def topk(scores: torch.Tensor, k, lengths: torch.Tensor | None = None, *, order: str = "score",
         width: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-k ids per row: int32 ``[R, width]``, -1 padded; matches ``topk_reference``.

    ``k``: an int (then ``width = k`` and the call never syncs with the host: CUDA-graph safe),
    or an int tensor ``[R]`` (pass ``width``; without it, ``width = k.max()`` is read eagerly).
    ``lengths``: int32/int64 ``[R]`` valid lengths (None: every row is full).
    ``order``: ``"score"`` (descending score, ties by lower id), ``"index"`` (ascending ids) or
    ``"none"`` (the cheapest: here also ascending ids).
    """
    fn = "topk"
    check_scores(fn, "scores", scores)
    check_choice(f"{fn}: order", order, ORDERS, "order='score' or order='index'.", error=SparseRefError)
    R, N = scores.shape
    k_tensor = None
    if isinstance(k, torch.Tensor):
        check_tensor(f"{fn}: k", k, dtype=INDEX_DTYPES, shape=(R,), fix="pass an int, or one int k per row.")
        check_same_device(fn, "scores", {"scores": scores, "k": k})
        check_range(f"{fn}: k", k, 0, 2**63 - 1, "clamp k at 0.", error=SparseRefError)
        if width is None:
            if capturing():
                fail(f"{fn}: width", "an int while a CUDA graph captures (reading k.max() would sync)", "None",
                     "pass width=<max k>.", SparseRefError)
            width = int(k.max()) if R else 0
        k_tensor = k.clamp(0, N).to(torch.int32).contiguous()  # k >= 2**31 must not wrap around
        k_scalar = 0
    else:
        k_scalar = check_int(f"{fn}: k", k, low=0, fix="pass a non-negative int (or an int tensor [R]).",
                             error=SparseRefError)
        width = k_scalar if width is None else width
    width = check_int(f"{fn}: width", width, low=0, fix="pass width=k.", error=SparseRefError)
    if order == "score" and width > MAX_SORT_WIDTH:
        fail(f"{fn}: width", f"at most {MAX_SORT_WIDTH} with order='score' (the winners are sorted in one tile)",
             str(width), f"use order='index', or k <= {MAX_SORT_WIDTH}.", SparseRefError)
    if lengths is not None:
        check_tensor(f"{fn}: lengths", lengths, dtype=INDEX_DTYPES, shape=(R,), fix="one length per row, or None.")
        check_same_device(fn, "scores", {"scores": scores, "lengths": lengths})
        check_range(f"{fn}: lengths", lengths, 0, N, "clamp lengths to [0, scores.shape[1]].")
        lengths = lengths.contiguous()
    if out is None:
        out = torch.empty((R, width), dtype=torch.int32, device=scores.device)
    else:
        check_tensor(f"{fn}: out", out, dtype=torch.int32, shape=(R, width), contiguous=True, fix="pass out=None.")
        check_same_device(fn, "scores", {"scores": scores, "out": out})
    if R == 0 or width == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    launch_topk(scores, k_scalar, k_tensor, lengths, out)
    if order == "score":
        sort_winners(scores, out)
    return out


AOT_VARIANTS = [
    *[aot_variant(_register_row_kernel, dict(**f, N_PAD=8192, G=g, SLOTS=g, PAIR=pr, BLOCK_OUT=b), scratch="*i32",
                  flags="*i32", **AOT_PTRS)
      for f, g, b, pr in zip(AOT_FLAGS, (4096, 256), (1024, 128), (0, 128), strict=True)],
    *[aot_variant(_delegates_kernel, dict(**f, G=g, COLS=1024, ROWS=8, LOG_C=c, LOCAL=lc), {"num_warps": nw},
                  work="*i32", sync="*i32", **AOT_PTRS)
      for f, g, c, nw, lc in zip(AOT_FLAGS * 2, (4096, 8192) * 2, (4, 7) * 2, (16, 8) * 2, (True, True, False, False),
                                 strict=True)],
    *[aot_variant(_candidates_kernel, dict(**f, G=g, CHUNK=ch, SLOTS=g, LOG_C=c, BITMASK=bm, REVERSE=rv),
                  {"num_warps": nw}, cand="*i32" if bm else "*i64", work="*i32", sync="*i32", **AOT_PTRS)
      for f, g, ch, c, nw, rv, bm in zip(AOT_FLAGS * 2, (4096, 8192, 4096, 4096), (2048, 1024, 8192, 4096),
                                         (5, 7, 3, 5), (4, 8, 16, 8), (True, False, True, False),
                                         (True, False, False, True), strict=True)],
    *[aot_variant(_select_kernel, dict(**f, G=g, CHUNK=ch, SLOTS=g, LOG_C=c, BITMASK=bm, PAIR=pr, SPAN=sp, TILE=tl_,
                                       BLOCK=1024), {"num_warps": nw}, cand="*i32" if bm else "*i64", work="*i32",
                  sync="*i32", **AOT_PTRS)
      for f, g, ch, c, nw, pr, sp, tl_, bm in zip(AOT_FLAGS * 2, (4096, 8192, 4096, 4096), (2048, 1024, 8192, 4096),
                                                  (5, 7, 3, 5), (16, 8, 16, 16), (0, 128, 128, 128),
                                                  (16384, 2048, 65536, 8192), (8192, 2048, 8192, 8192),
                                                  (True, False, True, False), strict=True)],
    aot_variant(_register_row_kernel, dict(HAS_K=False, HAS_LEN=False, N_PAD=1024, G=256, SLOTS=256, PAIR=0,
                                           BLOCK_OUT=16), {"num_warps": 4}, scratch="*i32", flags="*i32",
                **{**AOT_PTRS, "scores": "*bf16"}),
]
