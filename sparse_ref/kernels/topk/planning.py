"""The top-k's launch knobs and its plan: how one call runs, from the shapes alone (``docs/topk.md``)."""

from __future__ import annotations

from dataclasses import dataclass

import triton

from sparse_ref.kernels import Knob, Knobs
from sparse_ref.kernels.topk.common import PAIR_SCRATCH
from sparse_ref.kernels.topk.rows import use_direct

W_, P2, OFF = 1 << 20, 1 << 16, True  # launch knobs' declared ranges: powers of two where a kernel tiles by them
RANGES = {
    "register_row": Knob(1, 16384, zero=OFF), "direct_ratio": Knob(1, W_, zero=OFF),
    "short_pair": Knob(16, 1024, pow2=True, zero=OFF),
    "min_delegates": Knob(16, 8192, pow2=True), "max_delegates": Knob(16, 16384, pow2=True),
    "slots": Knob(1, W_, pow2=True, zero=OFF), "chunk": Knob(16, P2, pow2=True),
    "bitmask_programs": Knob(1, 2**31 - 1, zero=OFF), "delegate_cols": Knob(16, P2, pow2=True),
    "num_warps": Knob(1, 32, pow2=True), "candidate_warps": Knob(1, 32, pow2=True), "reverse_rows": Knob(flag=True),
    "select_programs": Knob(1, W_), "tie_tile": Knob(16, P2, pow2=True), "local_threshold": Knob(1, 1024, zero=OFF),
    "block": Knob(16, P2, pow2=True), "sort_run": Knob(16, 4096, pow2=True, zero=OFF),
    "sort_run_warps": Knob(1, 32, pow2=True), "pair_rank": Knob(16, 256, pow2=True, zero=OFF),
    "value_bins": Knob(16, 256, pow2=True, zero=OFF)}
TUNING = Knobs("topk", RANGES, **{  # launch knobs: tests force paths with them (docs/topk.md)
    "register_row": 8192,  # rows up to this many columns: one program per row, row in registers (rows.py)
    "direct_ratio": 8,  # such rows (and page histories): selected directly when N_PAD <= this * G (rows.use_direct)
    "short_pair": 256,  # directly: rounds until the kept bin holds this many per 4096 scores (0: to one value)
    "min_delegates": 256, "max_delegates": 8192,  # G = max(min_delegates, next_pow2(2 k)), at most max_delegates
    "slots": 0,  # if > 0: SLOTS (tests shrink it to force the fallback; else G, ~0.7 G expected)
    "chunk": 2048,  # columns per candidate program
    "bitmask_programs": 1024,  # at least this many candidates programs (rows x chunks): the bitmask mode
    "delegate_cols": 2048,  # delegate columns per delegate program (at most: halved while programs < MIN_PROGRAMS)
    "num_warps": 8,  # register rows by the delegates plan, and the Quest bounds update
    "candidate_warps": 4,  # the candidates launch: a program per chunk, no serial tail
    "reverse_rows": True,  # the candidates launch takes the rows last-first (the delegates launch read them last)
    "select_programs": 256,  # the select launch: about this many programs (at least one per row), each a span
    "tie_tile": 2048,  # columns per load of a flagged row's select program and per tile of its -1 padding
    "local_threshold": 4,  # up to this many delegates programs per row: T from their own thresholds
    "block": 1024,  # tile of the whole-row kernel's loops (k too wide for delegates)
    "sort_run": 512, "sort_run_warps": 4,  # > 0: order="score" sorts runs of this many in parallel, then merges
    "pair_rank": 128,  # > 0: the exact k-th key by a pairwise rank of up to this many keys of one bin
    "value_bins": 128,  # directly: the first round bins the float values in this many bins (0: keys; rows.py)
})
MAX_SORT_WIDTH = 4096  # order="score" sorts a row's winners inside one tile of at most this many
SCORES_PER_WARP = 512  # a register row held directly: warps = N_PAD / this, from 8 to 32
DELEGATE_WARPS, SELECT_WARPS, SORT_WARPS = 8, 16, 16  # the delegates (and whole-row) launch; select; a 2048+ sort
MIN_PROGRAMS = 256  # fewer rows than this fills: smaller chunks / delegate slices per program
DELEGATE_TILE = 8192  # scores per load of a delegates program (ROWS x COLS)


def short_row_warps(n_pad: int) -> int:
    """Warps of a program holding ``n_pad`` scores in registers (``select_direct``): one per 512, 8 to 32."""
    return min(32, max(8, n_pad // SCORES_PER_WARP))


@dataclass(frozen=True)
class Plan:
    """How one call runs, from the shapes alone: a row held in registers (``register``; ``direct`` or the delegates
    plan), or three launches (``G`` delegates per row in ``cols``-column programs, ``chunk``-column candidate programs,
    ``slots`` slots, a pairwise rank of up to ``pair`` keys); ``force_fallback``: k too wide for delegates, the
    whole-row radix select on every row."""

    register: bool
    direct: bool
    n_pad: int
    G: int
    slots: int
    chunk: int
    cols: int
    pair: int
    force_fallback: bool


def plan(R: int, N: int, width: int) -> Plan:
    """The plan for R rows of N columns and at most ``width`` winners."""
    n_pad = max(32, triton.next_power_of_2(N))  # (at least one bitmask word)
    G = max(TUNING["min_delegates"], triton.next_power_of_2(max(2 * width, 1)))
    register = N <= TUNING["register_row"]
    if register:
        G = min(G, n_pad)
    chunk, cols = max(32, min(TUNING["chunk"], n_pad, 1 << 15)), min(TUNING["delegate_cols"], G)  # (chunk: whole
    # bitmask words; < 2**16: two counts packed in one int32)
    while R * triton.cdiv(N, chunk) < MIN_PROGRAMS and chunk > 1024:  # few rows: more, smaller programs per row
        chunk //= 2
    while R * (G // cols) < MIN_PROGRAMS and cols > 64:
        cols //= 2
    slots = min(TUNING["slots"] or G, n_pad, 1 << 14)  # (< 2**15: the select program packs two counts in an int32)
    pair = min(TUNING["pair_rank"], slots, PAIR_SCRATCH.value) if slots >= 16 else 0  # PAIR <= slots
    return Plan(register, register and use_direct(n_pad, G, TUNING["direct_ratio"]), n_pad, G, slots, chunk, cols,
                pair, not register and G > TUNING["max_delegates"])
