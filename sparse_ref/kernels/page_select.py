"""Fused page selection: sink pages + history top-k + recent pages, ascending, -1 padded, lengths.

Semantics: ``sparse_ref.selection.select_pages`` (and so ``retrieve_topk_loop``). One launch,
one program per request row, the row's page scores held in registers:

1. **Plan.** From ``seq_lens`` the program derives its row's pages ``n = ceil(seq_len / P)``, the
   recent window ``[n - recent, n)``, the sink window ``[0, sink)``, the history between them and
   the history budget ``k`` (read from a table computed once by ``SparseConfig.history_budget_tensor``), and
   whether the row goes sparse at all.
2. **History top-k** in registers, by one of the two plans of ``topk.rows`` (shared with the short rows
   of the top-k, chosen from the shapes by ``use_direct``): **directly** (window rounds over the history's
   own range, which adapt to page scores packed within ~2%, and a pairwise rank give the exact k-th
   score; one prefix sum writes the winners; rows of up to 8 G pages, e.g. 2048 pages at k ~ 128), or
   with the **delegate threshold** of ``sparse_ref.kernels.topk`` (delegates, a threshold from window
   rounds over them, candidates, exact select on the candidates; the exact k-th delegate when even that
   lets more pages through than the slots hold; an exact select over the whole register row only when
   that overflows too). Winners in ascending page order.
3. **Merge.** Sink ids < history ids < recent ids, so "ascending" is a concatenation: the sink
   pages go before the winners, the recent pages after them, then -1 padding and the length.
4. **Page table** (``select_pages_to_table`` only): the program reads its row back and writes the
   adaptor's page table row and KV length (``page_table.py``'s rule); the last program to
   finish writes the cumulative lengths. At bs=1 each launch costs microseconds of latency.

No value is read back to the host, so the call can be captured in a CUDA graph. Rows longer
than ``MAX_REGISTER_PAGES`` are refused here; ``retrieve_topk`` sends them to the torch
``select_pages``. The selection rules (history budget, static width) have one home,
``SparseConfig``, which arrives as an argument; this module imports only the leaf modules of the
package and the device helpers of ``sparse_ref.kernels.topk.common`` and ``sparse_ref.kernels.page_table``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import (
    INDEX_DTYPES,
    capturing,
    check_int,
    check_kernel_device,
    check_range,
    check_same_device,
    check_scores,
    check_tensor,
    check_tokens_on_real_pages,
    fail,
)
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import Knob, Knobs, after_previous_launch, pdl_options
from sparse_ref.kernels.page_table import page_table_from_selection, write_cu_kv_lens, write_table_row
from sparse_ref.kernels.topk.planning import short_row_warps
from sparse_ref.kernels.topk.rows import direct_mode, select_direct, select_in_registers, use_direct

MAX_REGISTER_PAGES = 16384  # one program holds the row in registers up to this many pages
# Candidate slots per delegate (the delegates plan). Quest scores are packed (~2% spread); a threshold cut to 16
# bits let ~350 of 2048 pages through at k=123 (~260 of 8192), hence 2 G slots. The window threshold adapts to the
# packed range (fewer candidates); the slots stay, and the exact k-th delegate is needed only beyond them. The
# page selection's TUNING["slots"] overrides (tests force overflows).
SLOTS_PER_DELEGATE = 2
# The direct plan's value round (the top-k's value_bins) stays off for page histories, and their kept bin holds
# at most PAGE_PAIR keys (TUNING["short_pair"]; 0: rounds only): on an H200 the decode step's selection
# (2048 Quest page scores, k = 123, bs=1) took 11.6 us with 256 value bins, 11.1 without (bin of 128), 11.2 with a
# bin of 256, 10.8 with 32 (2026-12-04). A bin of 256 made the page selection 2x slower in Triton's interpreter.
VALUE_BINS, PAGE_PAIR = 0, 32
# Programmatic dependent launch of the select-to-table launch: it always lets the attention
# launch after it be placed early; it is itself placed early, while the scoring launch before it finishes, only
# for at most this many rows. Same-process A/B on an H200 (the decode step, bf16 bounds, default knobs): 48.2 us at
# bs=1 and 321.7 at bs=64 (no PDL: 50.5 and 323.1); placed early at any batch, 81.3 at bs=8 and 326.0 at bs=64
# (no PDL: 76.6 and 323.1): its early programs hold SM slots the scoring's last wave needs.
PDL_WAIT_MAX_ROWS = 1
MIN_DELEGATES, PAIR_RANK, DELEGATES_WARPS = 256, 128, 8  # the delegates plan: as the top-k's defaults
# Launch knobs of page selection (tests force each plan with them): a history is selected directly when N_PAD <=
# direct_ratio * G (0: never); the direct plan's kept bin holds up to short_pair keys (0: window rounds to one
# value); the delegates plan's candidate slots (0: SLOTS_PER_DELEGATE * G).
TUNING = Knobs("page_select", {
    "direct_ratio": Knob(1, 1 << 20, zero=True), "short_pair": Knob(16, 1024, pow2=True, zero=True),
    "slots": Knob(1, 1 << 20, pow2=True, zero=True)}, direct_ratio=8, short_pair=PAGE_PAIR, slots=0)


@triton.jit
def _plan_row(r, seq_lens, sparse_mask, budget, N, rules):
    """Row r's windows: ``(n, recent_start, sink_end, k, sparse)`` (see the module docstring, step 1).
    ``rules``: ``(page_size, num_recent_pages, num_sink_pages, min_sparse_seq_len)``."""
    page_size, n_recent, n_sink, min_seq = rules[0], rules[1], rules[2], rules[3]
    seq = tl.load(seq_lens + r).to(tl.int64)
    seq = tl.minimum(tl.maximum(seq, 0), (tl.zeros([], tl.int64) + N) * page_size)  # never past the row
    n = ((seq + page_size - 1) // page_size).to(tl.int32)
    recent_start = n - tl.minimum(n, n_recent)
    sink_end = tl.minimum(recent_start, n_sink)
    # The history's page count indexes the budget table, clamped to it by construction (a row with fewer
    # pages than sink + recent reads entry 0, never one before the table, whatever the windows above say).
    k = tl.load(budget + tl.minimum(tl.maximum(recent_start - sink_end, 0), N))
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
def _select_row(r, scores, selected, lengths, seq_lens, sparse_mask, budget, scratch, sizes, rules,
                N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                BLOCK_OUT: tl.constexpr, DIRECT: tl.constexpr):
    """Steps 1-3 for request row r: plan its windows, select its history top-k (ids ascending, after the
    sink pages), write sink, recent and padding, store its length. Returns (its output row, its length)."""
    stride_r, N, W = sizes[0], sizes[1], sizes[2]
    n, recent_start, sink_end, k, sparse = _plan_row(r, seq_lens, sparse_mask, budget, N, rules)
    out_row = selected + r.to(tl.int64) * W
    row = scores + r.to(tl.int64) * stride_r
    if DIRECT:
        k_eff = select_direct(row, sink_end, recent_start, k, out_row, sink_end, W, scratch + r.to(tl.int64) * PAIR,
                               N_PAD, PAIR, DIRECT)
    else:
        k_eff, _ = select_in_registers(row, sink_end, recent_start, k, out_row, sink_end, W,
                                        scratch + r.to(tl.int64) * SLOTS, N_PAD, G, SLOTS, PAIR)
    filled = _write_sink_recent_padding(out_row, W, sparse, n, recent_start, sink_end, k_eff, BLOCK_OUT)
    tl.store(lengths + r, filled)
    return out_row, filled


@triton.jit
def _page_select_kernel(scores, selected, lengths,  # the scores in; the selection out
                        seq_lens, sparse_mask, budget, scratch,  # the batch; the budget table; scratch
                        sizes, rules,  # (stride of scores, pages N, width W); (page size, recent, sink, min len)
                        N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                        BLOCK_OUT: tl.constexpr, DIRECT: tl.constexpr):
    """One program = one request row: plan its windows, select its history top-k, write the full row."""
    _select_row(tl.program_id(0), scores, selected, lengths, seq_lens, sparse_mask, budget, scratch, sizes, rules,
                N_PAD, G, SLOTS, PAIR, BLOCK_OUT, DIRECT)


@triton.jit
def _select_to_table_kernel(scores, selected, lengths,  # the scores in; the selection out
                            seq_lens, sparse_mask, budget, scratch,  # the batch; the budget table; scratch
                            rows, req_to_token, page_table, kv_lens, cu_kv_lens,  # the page table's in and out
                            sizes,  # (stride of scores, N, W, table width, req_to_token rows, req_to_token width)
                            rules,  # (page size, recent pages, sink pages, min sparse length)
                            N_PAD: tl.constexpr, G: tl.constexpr, SLOTS: tl.constexpr, PAIR: tl.constexpr,
                            BLOCK_OUT: tl.constexpr, BLOCK_T: tl.constexpr, DIRECT: tl.constexpr,
                            PDL: tl.constexpr):
    """One program = one request row: ``_page_select_kernel``, then the row's page table and KV length
    (``page_table.py``'s rule) from the row it just wrote; the last program to finish writes
    ``cu_kv_lens`` (the counter after the budget table, which it resets, so CUDA-graph replays start from
    zero again). PDL: placed while the scoring launch before it finishes (the decode step's launches)."""
    after_previous_launch(PDL)
    N, W, out_width, r2t_rows, r2t_width, page_size = sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], rules[0]
    r = tl.program_id(0)
    row = tl.minimum(tl.maximum(tl.load(rows + r).to(tl.int64), 0), r2t_rows - 1)  # loaded before the selection
    on = tl.load(sparse_mask + r).to(tl.int32) != 0
    seq_raw = tl.load(seq_lens + r).to(tl.int64)
    out_row, filled = _select_row(r, scores, selected, lengths, seq_lens, sparse_mask, budget, scratch, sizes, rules,
                                  N_PAD, G, SLOTS, PAIR, BLOCK_OUT, DIRECT)
    tl.debug_barrier()  # the row's ids are stored before the table reads them back
    kv_len = write_table_row(out_row, filled, W, seq_raw, on, req_to_token + row * r2t_width, r2t_width, page_size,
                             page_table + r.to(tl.int64) * out_width, out_width, BLOCK_T)
    tl.store(kv_lens + r, kv_len.to(tl.int32))
    if tl.num_programs(0) == 1:  # bs=1: no other row to wait for
        tl.store(cu_kv_lens, 0)
        tl.store(cu_kv_lens + 1, kv_len.to(tl.int32))
    else:
        counter = budget + N + 1  # the "last program" counter, after the table's N + 1 budgets
        tl.debug_barrier()  # every thread's stores happen before the counter says "done"
        if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.store(counter, 0)  # reset for the next call
            write_cu_kv_lens(kv_lens, cu_kv_lens, tl.num_programs(0), 1024)


_TABLES: dict = {}


def budget_table(max_pages: int, config, device: torch.device) -> torch.Tensor:
    """table[h] = the config's history budget for h history pages (``sparse_ref.selection``'s rule), h in
    ``[0, max_pages]``, then one zeroed int: the select-to-table kernel's counter. Cached per (device, size,
    budget), so one counter per table: two calls at once on different streams would share it (not
    supported); never cached from inside a graph capture."""
    key = (str(device), max_pages, config.keep_ratio, config.page_budget)
    if key not in _TABLES:
        table = config.history_budget_tensor(torch.arange(max_pages + 2, device=device)).to(torch.int32)
        table[-1:] = 0  # the select-to-table kernel's "last program" counter (it leaves it at zero again)
        if capturing():
            return table
        _TABLES[key] = table
    return _TABLES[key]


def _launch_args(scores, seq_lens, sparse_mask, page_size, config, W):
    """The selection kernels' shared arguments: the batch, the budget table and scratch; the config's rules; the
    constexprs."""
    bs, max_pages = scores.shape
    device = scores.device
    n_pad = max(32, triton.next_power_of_2(max_pages))  # (at least one bitmask word)
    k_max = config.history_budget(max_pages)  # no row keeps more history pages than this
    G = min(n_pad, max(MIN_DELEGATES, triton.next_power_of_2(max(2 * k_max, 1))))
    direct = use_direct(n_pad, G, TUNING["direct_ratio"])
    slots = min(n_pad, TUNING["slots"] or SLOTS_PER_DELEGATE * G)
    pair = TUNING["short_pair"] if direct else min(PAIR_RANK, slots) if slots >= 16 else 0
    scratch = torch.empty((bs, max(pair, 1) if direct else slots), dtype=torch.int32, device=device)
    args = (seq_lens.contiguous(), sparse_mask.contiguous(), budget_table(max_pages, config, device), scratch)
    rules = (page_size, config.num_recent_pages, config.num_sink_pages, config.min_sparse_seq_len)
    nw = (short_row_warps(n_pad) if direct else DELEGATES_WARPS) if device.type == "cuda" else 1
    constexprs = dict(N_PAD=n_pad, G=G, SLOTS=slots, PAIR=pair, BLOCK_OUT=min(1024, max(16, triton.next_power_of_2(W))),
                      DIRECT=direct_mode(direct, VALUE_BINS), num_warps=nw)
    return args, rules, constexprs


def select_pages_triton(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                        config, width: int | None = None, *, check_values: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pages`` in one Triton launch: ``(selected int32 [bs, W], lengths int32 [bs])``.

    ``check_values=False`` skips the host-side range checks of index values when the caller has made
    them (one host sync per call, not two); the kernel still clamps every index it reads.
    """
    page_size, W = check_page_select("select_pages_triton", scores, seq_lens, sparse_mask, page_size, config,
                                            width, check_values, MAX_REGISTER_PAGES)
    bs, max_pages = scores.shape
    selected = torch.empty((bs, W), dtype=torch.int32, device=scores.device)
    lengths = torch.empty((bs,), dtype=torch.int32, device=scores.device)
    if bs == 0:
        return selected, lengths
    if max_pages == 0:  # no pages at all: every row is dense
        return selected.fill_(-1), lengths.zero_()
    batch, rules, ce = _launch_args(scores, seq_lens, sparse_mask, page_size, config, W)
    _page_select_kernel[(bs,)](scores, selected, lengths, *batch, (scores.stride(0), max_pages, W), rules, **ce)
    return selected, lengths


def select_pages_to_table(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                          config, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, *,
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
    page_size, W, out_width, shapes = check_select_to_table(
        scores, seq_lens, sparse_mask, page_size, config, req_pool_indices, req_to_token, out, check_values,
        MAX_REGISTER_PAGES)
    bs, max_pages = scores.shape
    r2t_rows, r2t_width = req_to_token.shape
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
    batch, rules, ce = _launch_args(scores, seq_lens, sparse_mask, page_size, config, W)
    sizes = (scores.stride(0), max_pages, W, out_width, r2t_rows, r2t_width)
    pdl = pdl_options(device)
    if "launch_pdl" in pdl and bs > PDL_WAIT_MAX_ROWS:
        pdl["launch_pdl"] = False  # (it still lets the attention launch after it start early)
    _select_to_table_kernel[(bs,)](scores, selected, lengths, *batch, req_pool_indices.contiguous(), req_to_token,
                                   *out, sizes, rules, BLOCK_T=min(1024, max(16, triton.next_power_of_2(out_width))),
                                   **ce, **pdl)
    return selected, lengths, out[0], out[1], out[2]


# ------------------------------ argument checks (each entry point above calls one first)
def check_page_select(fn, scores, seq_lens, sparse_mask, page_size, config, width, check_values, max_pages_limit):
    """The fused selection's input checks; returns ``(page_size, W)``."""
    check_scores(fn, "scores", scores)
    bs, max_pages = scores.shape
    check_tensor(f"{fn}: seq_lens", seq_lens, dtype=INDEX_DTYPES, shape=(bs,), fix="pass forward_batch.seq_lens.")
    check_tensor(f"{fn}: sparse_mask", sparse_mask, dtype=torch.bool, shape=(bs,), fix="one bool per request.")
    check_same_device(fn, "scores", {"scores": scores, "seq_lens": seq_lens, "sparse_mask": sparse_mask})
    page_size = check_int(f"{fn}: page_size", page_size, low=1, fix="pass the KV pool's page size.")
    if not callable(getattr(config, "selection_width", None)):  # (a kernel imports no config class: duck-typed)
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
    if max_pages > max_pages_limit:
        fail(f"{fn}: scores", f"at most {max_pages_limit} pages per row (one program holds a row in registers)",
             f"{max_pages} pages", "use sparse_ref.selection.select_pages for longer rows (retrieve_topk does).",
             SparseRefError)
    return page_size, W


def check_select_to_table(scores, seq_lens, sparse_mask, page_size, config, req_pool_indices, req_to_token, out,
                          check_values, max_pages_limit):
    """``(page_size, W, out_width, shapes)`` of ``select_pages_to_table``."""
    fn = "select_pages_to_table"
    page_size, W = check_page_select(fn, scores, seq_lens, sparse_mask, page_size, config, None, check_values,
                                     max_pages_limit)
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
        check_tokens_on_real_pages(seq_lens, req_pool_indices, req_to_token, page_size, f"{fn}: seq_lens")
    return page_size, W, out_width, shapes
