"""Fused page selection: sink pages + history top-k + recent pages, ascending, -1 padded, lengths.

Semantics: ``sparse_ref.selection.select_pages`` (and so ``retrieve_topk_loop``). One launch,
one program per request row, the row's page scores held in registers:

1. **Plan.** From ``seq_lens`` the program derives its row's pages ``n = ceil(seq_len / P)``, the
   recent window ``[n - recent, n)``, the sink window ``[0, sink)``, the history between them and
   the history budget ``k`` (read from a table computed once by ``SparseConfig.history_budget_tensor``), and
   whether the row goes sparse at all.
2. **History top-k** with the delegate threshold of ``kernels/topk.py`` (delegates, threshold,
   candidates, exact select on the candidates; ``topk_common._select_in_registers``, shared with the
   short rows of the top-k: a threshold from window rounds over the delegates' own range, which adapt
   to page scores packed within ~2%; the exact k-th delegate when even that lets more pages through
   than the slots hold; an exact select over the whole register row only when that overflows too),
   winners written in ascending page order.
3. **Merge.** Sink ids < history ids < recent ids, so "ascending" is a concatenation: the sink
   pages go before the winners, the recent pages after them, then -1 padding and the length.
4. **Page table** (``select_pages_to_table`` only): the program reads its row back and writes the
   adaptor's page table row and KV length (``kernels/page_table.py``'s rule); the last program to
   finish writes the cumulative lengths. At bs=1 each launch costs microseconds of latency.

No value is read back to the host, so the call can be captured in a CUDA graph. Rows longer
than ``MAX_REGISTER_PAGES`` are refused here; ``retrieve_topk`` sends them to the torch
``select_pages``. The selection rules (history budget, static width) have one home,
``SparseConfig``; this module imports only the leaf modules of the package, ``config`` and the
kernel helpers of ``kernels/topk.py``, ``kernels/topk_common.py`` and ``kernels/page_table.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import INDEX_DTYPES, capturing, check_int, check_range, check_same_device, check_tensor, fail
from sparse_ref.config import SparseConfig
from sparse_ref.device import check_kernel_device, triton_interpreted
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels.page_table import _running_sum, _table_row, page_table_from_selection
from sparse_ref.kernels.topk import TUNING, check_scores
from sparse_ref.kernels.topk_common import _select_in_registers

MAX_REGISTER_PAGES = 16384  # one program holds the row in registers up to this many pages
# Candidate slots per delegate. Quest scores are packed (~2% spread); a threshold cut to 16 bits let ~350 of 2048
# pages through at k=123 (~260 of 8192), hence 2 G slots. The window threshold adapts to the packed range (fewer
# candidates); the slots stay, and the exact k-th delegate is needed only beyond them. kernels/topk.py's
# TUNING["slots"] still overrides (tests force overflows).
SLOTS_PER_DELEGATE = 2


@triton.jit
def _plan_row(r, seq_lens, sparse_mask, budget, N, page_size, n_recent, n_sink, min_seq):
    """Row r's windows: ``(n, recent_start, sink_end, k, sparse)`` (see the module docstring, step 1)."""
    seq = tl.load(seq_lens + r).to(tl.int64)
    seq = tl.minimum(tl.maximum(seq, 0), (tl.zeros([], tl.int64) + N) * page_size)  # never past the row
    n = ((seq + page_size - 1) // page_size).to(tl.int32)
    recent_start = n - tl.minimum(n, n_recent)
    sink_end = tl.minimum(recent_start, n_sink)
    k = tl.load(budget + recent_start - sink_end)
    on = tl.load(sparse_mask + r).to(tl.int32) != 0
    sparse = on & (seq >= min_seq) & (n > 0) & (sink_end + k + n - recent_start < n)  # else: stays dense
    return n, recent_start, sink_end, tl.where(sparse, k, 0), sparse


@triton.jit
def _write_sink_recent_padding(out_row, W, sparse, n, recent_start, sink_end, k_eff, BLOCK_OUT: tl.constexpr):
    """Step 3: sink ids before the winners, recent ids after them, then -1. Returns the row's length."""
    filled = tl.where(sparse, sink_end + k_eff + n - recent_start, 0)
    for t in range(0, W, BLOCK_OUT):
        j = t + tl.arange(0, BLOCK_OUT)
        is_sink = sparse & (j < sink_end)
        rec = j - (sink_end + k_eff)
        is_recent = sparse & (rec >= 0) & (rec < n - recent_start)
        val = tl.where(is_sink, j, tl.where(is_recent, recent_start + rec, -1))
        tl.store(out_row + j, val, mask=(j < W) & (is_sink | is_recent | (j >= filled)))
    return filled


@triton.jit
def _select_row(r, scores, stride_r, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                N, W, page_size, n_recent, n_sink, min_seq,
                N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                BLOCK_OUT: tl.constexpr):
    """Steps 1-3 for request row r: plan its windows, select its history top-k (ids ascending, after the
    sink pages), write sink, recent and padding, store its length. Returns (its output row, its length)."""
    n, recent_start, sink_end, k, sparse = _plan_row(r, seq_lens, sparse_mask, budget, N, page_size, n_recent,
                                                     n_sink, min_seq)
    out_row = selected + r.to(tl.int64) * W
    k_eff, _ = _select_in_registers(scores + r.to(tl.int64) * stride_r, sink_end, recent_start, k, out_row,
                                    sink_end, W, scratch + r.to(tl.int64) * SLOTS, N_PAD, G, SLOTS, PAIR)
    filled = _write_sink_recent_padding(out_row, W, sparse, n, recent_start, sink_end, k_eff, BLOCK_OUT)
    tl.store(lengths + r, filled)
    return out_row, filled


@triton.jit
def _page_select_kernel(scores, stride_r, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                        N, W, page_size, n_recent, n_sink, min_seq,
                        N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                        BLOCK_OUT: tl.constexpr):
    """One program = one request row: plan its windows, select its history top-k, write the full row."""
    _select_row(tl.program_id(0), scores, stride_r, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                N, W, page_size, n_recent, n_sink, min_seq, N_PAD, G, SLOTS, PAIR, BLOCK_OUT)


@triton.jit
def _select_to_table_kernel(scores, stride_r, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                            rows, req_to_token, page_table, kv_lens, cu_kv_lens, counter,
                            N, W, out_width, r2t_rows, r2t_width, page_size, n_recent, n_sink, min_seq,
                            N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                            BLOCK_OUT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program = one request row: ``_page_select_kernel``, then the row's page table and KV length
    (``kernels/page_table.py``'s rule) from the row it just wrote; the last program to finish writes
    ``cu_kv_lens`` (a counter it resets, so CUDA-graph replays start from zero again)."""
    r = tl.program_id(0)
    row = tl.minimum(tl.maximum(tl.load(rows + r).to(tl.int64), 0), r2t_rows - 1)  # loaded before the selection
    on = tl.load(sparse_mask + r).to(tl.int32) != 0
    seq_raw = tl.load(seq_lens + r).to(tl.int64)
    out_row, filled = _select_row(r, scores, stride_r, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                                  N, W, page_size, n_recent, n_sink, min_seq, N_PAD, G, SLOTS, PAIR, BLOCK_OUT)
    tl.debug_barrier()  # the row's ids are stored before the table reads them back
    kv_len = _table_row(out_row, filled, W, seq_raw, on,
                        req_to_token + row * r2t_width, r2t_width, page_size,
                        page_table + r.to(tl.int64) * out_width, out_width, BLOCK_T)
    tl.store(kv_lens + r, kv_len.to(tl.int32))
    if tl.num_programs(0) == 1:  # bs=1: no other row to wait for
        tl.store(cu_kv_lens, 0)
        tl.store(cu_kv_lens + 1, kv_len.to(tl.int32))
    else:
        tl.debug_barrier()  # every thread's stores happen before the counter says "done"
        if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.store(counter, 0)  # reset for the next call
            _running_sum(kv_lens, cu_kv_lens, tl.num_programs(0), BLOCK_B)


_TABLES: dict = {}


def budget_table(max_pages: int, config: SparseConfig, device: torch.device) -> torch.Tensor:
    """table[h] = the config's history budget for h history pages (``sparse_ref.selection``'s rule),
    cached per (device, size, budget); never cached from inside a graph capture."""
    key = (str(device), max_pages, config.keep_ratio, config.page_budget)
    if key not in _TABLES:
        table = config.history_budget_tensor(torch.arange(max_pages + 1, device=device)).to(torch.int32)
        if capturing():
            return table
        _TABLES[key] = table
    return _TABLES[key]


def _check_selection(fn, scores, seq_lens, sparse_mask, page_size, config, width, check_values):
    """The selection's input checks; returns ``(page_size, W)``."""
    check_scores(fn, "scores", scores)
    bs, max_pages = scores.shape
    check_tensor(f"{fn}: seq_lens", seq_lens, dtype=INDEX_DTYPES, shape=(bs,), fix="pass forward_batch.seq_lens.")
    check_tensor(f"{fn}: sparse_mask", sparse_mask, dtype=torch.bool, shape=(bs,), fix="one bool per request.")
    check_same_device(fn, "scores", {"scores": scores, "seq_lens": seq_lens, "sparse_mask": sparse_mask})
    page_size = check_int(f"{fn}: page_size", page_size, low=1, fix="pass the KV pool's page size.")
    if not isinstance(config, SparseConfig):
        fail(f"{fn}: config", "a sparse_ref.SparseConfig", type(config).__name__, "pass SparseConfig(...).",
             SparseRefError)
    if check_values:  # retrieve_topk checked the lengths already
        check_range(f"{fn}: seq_lens", seq_lens, 0, max_pages * page_size,
                    "score every page of the longest request (scores cover max_pages * page_size tokens).")
    W = config.selection_width(max_pages)
    if width is not None:  # wider is allowed (extra -1 padding); narrower would cut rows off
        width = check_int(f"{fn}: width", width, low=W, fix="leave width=None (a narrower output would cut rows "
                          "off).", error=SparseRefError)
        W = min(width, max_pages)  # as select_pages: a row never keeps more pages than it has
    if max_pages > MAX_REGISTER_PAGES:
        fail(f"{fn}: scores", f"at most {MAX_REGISTER_PAGES} pages per row (one program holds a row in registers)",
             f"{max_pages} pages", "use sparse_ref.selection.select_pages for longer rows (retrieve_topk does).",
             SparseRefError)
    return page_size, W


def _launch_args(scores, seq_lens, sparse_mask, page_size, config, W):
    """The selection kernels' shared arguments (scratch and budget table included) and constexprs."""
    bs, max_pages = scores.shape
    device = scores.device
    n_pad = max(32, triton.next_power_of_2(max_pages))  # (at least one bitmask word)
    k_max = config.history_budget(max_pages)  # no row keeps more history pages than this
    G = min(n_pad, max(TUNING["min_delegates"], triton.next_power_of_2(max(2 * k_max, 1))))
    slots = min(n_pad, TUNING["slots"] or SLOTS_PER_DELEGATE * G)
    pair = min(TUNING["pair_rank"], slots) if slots >= 16 else 0  # see kernels/topk.py plan()
    scratch = torch.empty((bs, slots), dtype=torch.int32, device=device)
    args = (scores, scores.stride(0), seq_lens.contiguous(), sparse_mask.contiguous(),
            budget_table(max_pages, config, device), scratch)
    scalars = (page_size, config.num_recent_pages, config.num_sink_pages, config.min_sparse_seq_len)
    constexprs = dict(N_PAD=n_pad, G=G, SLOTS=slots, PAIR=pair, BLOCK_OUT=min(1024, max(16, triton.next_power_of_2(W))),
                      num_warps=TUNING["num_warps"] if device.type == "cuda" else 1)
    return args, scalars, constexprs


def select_pages_triton(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                        config: SparseConfig, width: int | None = None, *, check_values: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pages`` in one Triton launch: ``(selected int32 [bs, W], lengths int32 [bs])``.

    ``check_values=False`` skips the host-side range checks of index values when the caller has made
    them (one host sync per call, not two); the kernel still clamps every index it reads.
    """
    page_size, W = _check_selection("select_pages_triton", scores, seq_lens, sparse_mask, page_size, config, width,
                                    check_values)
    bs, max_pages = scores.shape
    selected = torch.empty((bs, W), dtype=torch.int32, device=scores.device)
    lengths = torch.empty((bs,), dtype=torch.int32, device=scores.device)
    if bs == 0:
        return selected, lengths
    if max_pages == 0:  # no pages at all: every row is dense
        return selected.fill_(-1), lengths.zero_()
    (scores, stride, seq_lens, sparse_mask, budget, scratch), scalars, ce = _launch_args(
        scores, seq_lens, sparse_mask, page_size, config, W)
    _page_select_kernel[(bs,)](scores, stride, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                               max_pages, W, *scalars, **ce)
    return selected, lengths


_COUNTERS: dict = {}


def _counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 "last program" counter, one per device; the kernel leaves it at zero again.
    Two calls running at the same time on different streams would share it (not supported)."""
    buf = _COUNTERS.get(str(device))
    if buf is None:
        buf = torch.zeros(1, dtype=torch.int32, device=device)
        if not capturing():  # a buffer made during a capture belongs to that graph's memory pool
            _COUNTERS[str(device)] = buf
    return buf


def select_pages_to_table(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                          config: SparseConfig, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, *,
                          out=None, check_values: bool = True):
    """``select_pages_triton`` and ``page_table_from_selection`` in ONE launch.

    Returns ``(selected, lengths, page_table, kv_lens, cu_kv_lens)``, exactly what
    ``selected, lengths = select_pages_triton(scores, seq_lens, sparse_mask, page_size, config)``
    followed by ``page_table_from_selection(selected, lengths, sparse_mask, seq_lens,
    req_pool_indices, req_to_token, page_size)`` return. At bs=1 each launch is a few microseconds
    of latency, so the page table is written by the program that has just selected the row.
    ``out``: optional ``(page_table, kv_lens, cu_kv_lens)`` int32 buffers (contiguous, shapes
    ``[bs, W_out]``, ``[bs]``, ``[bs + 1]``) written in place. ``check_values=False``: the caller
    checked the index values (the kernel clamps every index it reads anyway).
    """
    fn = "select_pages_to_table"
    page_size, W = _check_selection(fn, scores, seq_lens, sparse_mask, page_size, config, None, check_values)
    bs, max_pages = scores.shape
    check_tensor(f"{fn}: req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, shape=(bs,),
                 fix="pass forward_batch.req_pool_indices.")
    check_tensor(f"{fn}: req_to_token", req_to_token, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass the req_to_token table of the ReqToTokenPool.")
    r2t_rows, r2t_width = req_to_token.shape
    if r2t_rows == 0 or r2t_width == 0:
        fail(f"{fn}: req_to_token", "at least one row and one column", f"shape {tuple(req_to_token.shape)}",
             "pass the req_to_token table of the ReqToTokenPool.")
    out_width = max(W, -(-r2t_width // page_size))
    shapes = ((bs, out_width), (bs,), (bs + 1,))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail(f"{fn}: out", "a tuple (page_table, kv_lens, cu_kv_lens) of int32 buffers", repr(type(out)))
        for name, t, shape in zip(("page_table", "kv_lens", "cu_kv_lens"), out, shapes, strict=True):
            check_tensor(f"{fn}: out {name}", t, dtype=torch.int32, shape=shape, contiguous=True,
                         fix=f"preallocate torch.zeros({shape}, dtype=torch.int32) on the device of scores.")
    check_same_device(fn, "scores", {"scores": scores, "req_pool_indices": req_pool_indices,
                                     "req_to_token": req_to_token,
                                     **({} if out is None else {"out page_table": out[0], "out kv_lens": out[1],
                                                                "out cu_kv_lens": out[2]})})
    check_kernel_device(f"{fn}: scores", scores, "use select_pages and adaptor.to_attention_metadata on CPU.")
    if check_values:
        check_range(f"{fn}: req_pool_indices", req_pool_indices, 0, r2t_rows - 1, "pass rows of req_to_token.")
        check_range(f"{fn}: seq_lens", seq_lens, 0, r2t_width, "every request fits in req_to_token.")
    device = scores.device
    if out is None:
        out = tuple(torch.empty(shape, dtype=torch.int32, device=device) for shape in shapes)
    selected = torch.empty((bs, W), dtype=torch.int32, device=device)
    lengths = torch.empty((bs,), dtype=torch.int32, device=device)
    if bs == 0:
        out[2].zero_()
        return selected, lengths, *out
    if max_pages == 0:  # no pages scored: run the plain table kernel on an all-dense selection
        selected.fill_(-1)
        lengths.zero_()
        return selected, lengths, *page_table_from_selection(selected, lengths, sparse_mask, seq_lens,
                                                             req_pool_indices, req_to_token, page_size, out=out,
                                                             check_values=False)
    (scores, stride, seq_lens, sparse_mask, budget, scratch), scalars, ce = _launch_args(
        scores, seq_lens, sparse_mask, page_size, config, W)
    _select_to_table_kernel[(bs,)](scores, stride, selected, lengths, seq_lens, sparse_mask, budget, scratch,
                                   req_pool_indices.contiguous(), req_to_token, out[0], out[1], out[2],
                                   _counter(device), max_pages, W, out_width, r2t_rows, r2t_width, *scalars,
                                   BLOCK_T=min(1024, max(16, triton.next_power_of_2(out_width))),
                                   BLOCK_B=64 if triton_interpreted() else 1024, **ce)
    return selected, lengths, out[0], out[1], out[2]


# Ahead-of-time compile list (tests/test_aot_compile.py): the decode-step shapes (2048 and 8192 pages, k ~ 128)
_SELECT_SIG = {"scores": "*fp32", "stride_r": "i32", "selected": "*i32", "lengths": "*i32", "seq_lens": "*i64",
               "sparse_mask": "*i1", "budget": "*i32", "scratch": "*i32"}
_SCALARS = {"N": "i32", "W": "i32", "page_size": "i32", "n_recent": "i32", "n_sink": "i32", "min_seq": "i32"}
_TABLE_SIG = {**_SELECT_SIG, "rows": "*i64", "req_to_token": "*i32", "page_table": "*i32", "kv_lens": "*i32",
              "cu_kv_lens": "*i32", "counter": "*i32", "N": "i32", "W": "i32", "out_width": "i32", "r2t_rows": "i32",
              "r2t_width": "i32", "page_size": "i32", "n_recent": "i32", "n_sink": "i32", "min_seq": "i32"}
AOT_VARIANTS = [
    (_page_select_kernel, {**_SELECT_SIG, **_SCALARS},
     {"N_PAD": n_pad, "G": 256, "SLOTS": 512, "PAIR": 128, "BLOCK_OUT": 256}, {"num_warps": 8})
    for n_pad in (2048, 8192)
] + [
    (_select_to_table_kernel, _TABLE_SIG,
     {"N_PAD": n_pad, "G": 256, "SLOTS": 512, "PAIR": 128, "BLOCK_OUT": 256, "BLOCK_T": 1024, "BLOCK_B": 1024},
     {"num_warps": 8})
    for n_pad in (2048, 8192)
]
