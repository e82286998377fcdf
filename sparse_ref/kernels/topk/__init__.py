"""Exact batched top-k: one read of the row, then exact work on a few thousand candidates only.

Semantics: ``selection.topk_reference``; the design: ``docs/topk.md``. This module checks the inputs and launches in
order what ``planning.py`` decided from the shapes: a row of up to ``register_row`` scores in one program (``rows.py``),
a longer one in three launches (``threshold.py``, ``candidates.py``, ``select.py``), then ``sort.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from sparse_ref.checks import (
    INDEX_DTYPES,
    capturing,
    check_choice,
    check_int,
    check_range,
    check_same_device,
    check_scores,
    check_tensor,
    fail,
)
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import pdl_options
from sparse_ref.kernels.topk import candidates, rows, select, sort, threshold
from sparse_ref.kernels.topk.common import FLAG, HEAD, PAIR_SCRATCH, SYNC, T_
from sparse_ref.kernels.topk.planning import (
    DELEGATE_TILE,
    DELEGATE_WARPS,
    MAX_SORT_WIDTH,
    SELECT_WARPS,
    SORT_WARPS,
    TUNING,
    Plan,
    plan,
    short_row_warps,
)
from sparse_ref.kernels.topk.rows import direct_mode

ORDERS = ("score", "index")
_SYNC: dict = {}  # per device: the zeroed per-row counters and histograms [R, SYNC] the kernels leave at zero


def _sync_buffer(device: torch.device, R: int) -> torch.Tensor:
    key = str(device)
    buf = _SYNC.get(key)
    if buf is None or buf.shape[0] < R:
        buf = torch.zeros((max(R, 64), SYNC.value), dtype=torch.int32, device=device)
        if not capturing():  # a buffer made during a capture belongs to that graph's memory pool
            _SYNC[key] = buf
    return buf


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call, its grid computed once: ``programs`` and ``warps`` are what a GPU runs (the
    interpreter runs one warp)."""

    name: str
    kernel: object
    grid: tuple
    warps: int
    args: tuple
    constexprs: dict

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    def __call__(self) -> None:
        gpu = self.args[0].device.type == "cuda"
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.warps if gpu else 1)


@dataclass
class TopkRun:
    """One call: its plan, its ``launches`` in order (``launch`` runs them) and the buffers they leave for a reader:
    each row's path ``flags`` (0 exact select on the candidates or directly, 2 tie path, 3 the keys above T selected
    again, 1 whole-row radix) and, on long rows, the ``threshold`` keys, each chunk's keys ``above`` it and equal to it
    (``ties``), the candidates' ``bits`` (keys >= T), the mode (``bitmask``), the ``slots`` (bitmask mode, and an
    overflowing row's keys > T) or the ``runs`` with each chunk's ``counts`` and ``run_starts``."""

    plan: Plan
    launches: tuple
    flags: torch.Tensor
    sync: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    above: torch.Tensor | None = None
    ties: torch.Tensor | None = None
    bitmask: bool = False
    slots: torch.Tensor | None = None
    bits: torch.Tensor | None = None
    runs: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    run_starts: torch.Tensor | None = None
    span: int = 0  # columns per select program

    @property
    def names(self) -> tuple:
        return tuple(step.name for step in self.launches)

    @property
    def grids(self) -> dict:
        """Each launch's ``(programs, warps)`` on a GPU."""
        return {step.name: (step.programs, step.warps) for step in self.launches}

    def launch(self) -> TopkRun:
        for step in self.launches:
            step()
        return self


def prepare(scores, k_scalar, k_tensor, lengths, out) -> TopkRun:
    """The plan, buffers and launches of one checked call; nothing launched (``launch`` runs it)."""
    R, N = scores.shape
    W, device = out.shape[1], scores.device
    p = plan(R, N, W)
    k = k_tensor if k_tensor is not None else min(k_scalar, N)
    row = (scores, scores.stride(0))  # every launch reads the rows; then (N, W, k, lengths)
    if p.register:  # one program per row, the row in registers (rows.py)
        pair = TUNING["short_pair"] * max(1, p.n_pad // 4096) if p.direct else p.pair  # (direct: 512 at 8192)
        work = torch.empty((R, max(pair, 1) if p.direct else p.slots), dtype=torch.int32, device=device)
        flags = torch.empty(R, dtype=torch.int32, device=device)
        short_row = Launch("short_row", rows.short_row_kernel, (R,),
                           short_row_warps(p.n_pad) if p.direct else TUNING["num_warps"],
                           (*row, out, work, flags, N, W, k, lengths),
                           dict(N_PAD=p.n_pad, G=p.G, SLOTS=p.slots, PAIR=pair,
                                BLOCK_OUT=min(1024, max(16, triton.next_power_of_2(W))),
                                DIRECT=direct_mode(p.direct, TUNING["value_bins"]),
                                ALL=p.direct and k_tensor is None and k_scalar >= N))  # (every valid key wins)
        return TopkRun(p, (short_row,), flags)
    if p.force_fallback:  # every row takes the whole-row radix: flag 1
        block = TUNING["block"] if device.type == "cuda" else min(TUNING["block"], p.n_pad)
        whole_row = Launch("whole_row", select.whole_row_kernel, (R,), DELEGATE_WARPS,
                           (*row, out, N, W, k, lengths), dict(BLOCK=block))
        return TopkRun(p, (whole_row,), torch.ones(R, dtype=torch.int32, device=device))
    C = triton.cdiv(N, p.chunk)
    log_c = max(1, (C - 1).bit_length())
    head = [HEAD.value + i * (1 << log_c) for i in range(4)]  # (the work layout: docs/topk.md)
    work = torch.empty((R, head[3] + (1 << log_c) + p.G + PAIR_SCRATCH.value), dtype=torch.int32, device=device)
    bitmask = R * C >= TUNING["bitmask_programs"]
    n_words = C * (p.chunk // 32)
    cand = torch.empty((R, 2 * n_words + p.slots), dtype=torch.int32, device=device)  # (layout: docs/topk.md)
    runs = torch.empty((R, p.slots) if not bitmask else (1,), dtype=torch.int64, device=device)
    tile = max(p.chunk, min(TUNING["tie_tile"], p.n_pad))  # a flagged row: its select programs' loads
    spans = max(1, min(triton.cdiv(N, tile), TUNING["select_programs"] // R))  # select programs per row
    span = max(tile, triton.next_power_of_2(triton.cdiv(N, spans)))  # (a power of two: whole tiles, chunks and
    # bitmask words, and bits_to_slots' blocks of words must be a power of two)
    assert span % p.chunk == 0 and p.chunk % 32 == 0
    sync, pdl = _sync_buffer(device, R), pdl_options(device)
    rows_per = max(1, min(DELEGATE_TILE // p.cols, triton.next_power_of_2(triton.cdiv(N, p.G))))
    tail = (N, W, k, lengths)
    launches = (
        Launch("delegates", threshold.delegates_kernel, (R * (p.G // p.cols),), DELEGATE_WARPS,
               (*row, work, sync, *tail), dict(G=p.G, COLS=p.cols, ROWS=rows_per, LOG_C=log_c,
                                               LOCAL=p.G // p.cols <= TUNING["local_threshold"], **pdl)),
        Launch("candidates", candidates.candidates_kernel, (R * C,), TUNING["candidate_warps"],
               (*row, cand, runs, work, sync, *tail),
               dict(G=p.G, CHUNK=p.chunk, SLOTS=p.slots, LOG_C=log_c, BITMASK=bitmask, REVERSE=TUNING["reverse_rows"],
                    **pdl)),
        Launch("select", select.select_kernel, (R, triton.cdiv(N, span)), SELECT_WARPS,
               (*row, out, cand, runs, work, sync, *tail),
               dict(G=p.G, CHUNK=p.chunk, SLOTS=p.slots, LOG_C=log_c, BITMASK=bitmask, PAIR=p.pair, SPAN=span,
                    TILE=tile, **pdl)))
    return TopkRun(p, launches, work[:, FLAG.value], sync=sync, threshold=work[:, T_.value],
                   above=work[:, head[0]:head[0] + C], ties=work[:, head[1]:head[1] + C], bitmask=bitmask,
                   slots=cand[:, 2 * n_words:], bits=cand[:, :n_words], runs=None if bitmask else runs,
                   counts=None if bitmask else work[:, head[2]:head[2] + C],
                   run_starts=None if bitmask else work[:, head[3]:head[3] + C], span=span)


def launch_topk(scores, k_scalar, k_tensor, lengths, out) -> TopkRun:
    """``prepare(...).launch()``: each row's winners' ids, ascending, written into ``out``."""
    return prepare(scores, k_scalar, k_tensor, lengths, out).launch()


def topk(scores: torch.Tensor, k, lengths: torch.Tensor | None = None, *, order: str = "score",
         width: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-k ids per row: int32 ``[R, width]``, -1 padded; matches ``topk_reference``.

    ``k``: an int (then ``width = k`` and the call never syncs with the host: CUDA-graph safe),
    or an int tensor ``[R]`` (pass ``width``; without it, ``width = k.max()`` is read eagerly).
    ``lengths``: int32/int64 ``[R]`` valid lengths (None: every row is full).
    ``order``: ``"score"`` (descending score, ties by lower id) or ``"index"`` (ascending ids, the cheaper).
    """
    k_scalar, k_tensor, lengths, width, out = check_topk(scores, k, lengths, order, width, out,
                                                                ORDERS, MAX_SORT_WIDTH)
    R, N = scores.shape
    if R == 0 or width == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    launch_topk(scores, k_scalar, k_tensor, lengths, out)
    if order == "score":
        sort.sort_winners(scores, out, TUNING["sort_run"], TUNING["sort_run_warps"], SORT_WARPS,
                          pdl_options(out.device))
    return out


# ------------------------------ argument checks (each entry point above calls one first)
def check_topk(scores, k, lengths, order, width, out, orders, max_sort_width):
    """``(k_scalar, k_tensor, lengths, width, out)`` of a ``topk`` call (``k`` an int, or a clamped int32 tensor)."""
    fn = "topk"
    check_scores(fn, "scores", scores)
    check_choice(f"{fn}: order", order, orders, "order='score' or order='index'.", error=SparseRefError)
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
    if order == "score" and width > max_sort_width:
        fail(f"{fn}: width", f"at most {max_sort_width} with order='score' (the winners are sorted in one tile)",
             str(width), f"use order='index', or k <= {max_sort_width}.", SparseRefError)
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
    return k_scalar, k_tensor, lengths, width, out
