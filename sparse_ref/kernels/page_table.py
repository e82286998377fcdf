"""The adaptor in one Triton launch: a page selection becomes the page table attention reads.

``page_table_from_selection`` returns exactly what ``sparse_ref.adaptor.to_attention_metadata``
returns (read its module docstring for the contract):

* ``page_table`` int32 ``[bs, W_out]``, ``W_out = max(W, ceil(req_to_token.shape[1] / P))``: a
  sparse row maps each kept logical page ``j`` to ``req_to_token[row, j * P] // P`` in selection
  order; a dense row (``lengths[r] == 0`` or ``sparse_mask[r]`` False) lists all its
  ``n = ceil(seq_len / P)`` pages; entries past a row's count are page 0;
* ``kv_lens`` int32 ``[bs]``: ``(len - 1) * P + last_page_len`` for a sparse row, ``seq_len`` for a
  dense one;
* ``cu_kv_lens`` int32 ``[bs + 1]``: 0, then the running sum of ``kv_lens``.

The torch adaptor runs about fifteen small ops (each a launch, several microseconds at bs=1); this
is one launch with grid ``(column blocks, bs + 1)``:

* program ``(c, r)`` with ``r < bs`` writes ``BLOCK_W`` entries of row ``r``'s table;
* program ``(0, bs)`` (the extra row) walks the batch in chunks of ``BLOCK_B`` rows and writes
  ``kv_lens`` and ``cu_kv_lens`` with ``tl.cumsum`` and a running carry. One program is enough:
  a few thousand rows are a few chunks.

Every index is clamped inside the kernel (request row into ``req_to_token``, lengths into
``[0, W]``, ``seq_len`` into ``[0, req_to_token.shape[1]]``, a kept page into the row's own
``[0, n)``), so even unchecked values (while a CUDA graph captures and the launcher's value
checks are skipped) never read outside the buffers and never name another request's pages.
Nothing is read back to the host: the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import (
    INDEX_DTYPES,
    check_int,
    check_kernel_device,
    check_same_device,
    check_selection_values,
    check_tensor,
    fail,
)
from sparse_ref.device import triton_interpreted


@triton.jit
def _floor_div(a, b):
    """Floor division of int64 ``a`` by a positive ``b`` (Triton's ``//`` truncates; torch's floors)."""
    q = a // b
    return tl.where((a % b != 0) & (a < 0), q - 1, q)


@triton.jit
def _table_entries(sel_row, lens, width, seq_raw, mask_on, r2t_row, r2t_width, page_size, table_row, out_width,
                   col, FROM_L2: tl.constexpr):
    """Entries ``col`` of one row's page table (see the module docstring for the rule); returns ``kv_len``.

    ``sel_row``: the row's selection, ``lens`` its length, ``seq_raw`` its seq_len (clamped here),
    ``mask_on`` its sparse_mask, ``r2t_row`` its req_to_token row. ``FROM_L2``: read the selection
    past L1 (the caller wrote it in this same program).
    """
    seq = tl.minimum(tl.maximum(seq_raw, 0), r2t_width)
    n = (seq + page_size - 1) // page_size  # the row's pages
    lens = tl.minimum(tl.maximum(lens.to(tl.int64), 0), width)
    sparse = mask_on & (lens > 0)
    count = tl.where(sparse, lens, n)
    live = col < count
    sel_mask = live & sparse & (col < width)
    if FROM_L2:
        chosen = tl.load(sel_row + col, mask=sel_mask, other=0, cache_modifier=".cg")
    else:
        chosen = tl.load(sel_row + col, mask=sel_mask, other=0)
    logical = tl.where(sparse, chosen.to(tl.int64), col.to(tl.int64))
    logical = tl.minimum(tl.maximum(logical, 0), tl.maximum(n - 1, 0))  # only the row's own pages
    first_token = tl.maximum(tl.minimum(logical * page_size, r2t_width - 1), 0)
    slot = tl.load(r2t_row + first_token, mask=live & (r2t_width > 0), other=0).to(tl.int64)
    physical = _floor_div(slot, page_size)
    tl.store(table_row + col, tl.where(live, physical, 0).to(tl.int32), mask=col < out_width)
    last_page_len = seq - (n - 1) * page_size
    return tl.where(sparse, (lens - 1) * page_size + last_page_len, seq)


@triton.jit
def write_table_row(sel_row, lens, width, seq_raw, mask_on, r2t_row, r2t_width, page_size, table_row, out_width,
               BLOCK_W: tl.constexpr):
    """A whole row's page table, BLOCK_W entries a step, its selection written by the calling program;
    returns the row's ``kv_len``."""
    kv_len = tl.zeros([], tl.int64)
    for start in range(0, out_width, BLOCK_W):
        kv_len = _table_entries(sel_row, lens, width, seq_raw, mask_on, r2t_row, r2t_width, page_size, table_row,
                                out_width, start + tl.arange(0, BLOCK_W), True)
    return kv_len


@triton.jit
def write_cu_kv_lens(kv_lens_ptr, cu_kv_lens_ptr, bs, BLOCK_B: tl.constexpr):
    """``cu_kv_lens = [0, cumsum(kv_lens)]`` in BLOCK_B chunks with a running carry (kv_lens read from L2)."""
    tl.store(cu_kv_lens_ptr, 0)
    carry = tl.zeros([], dtype=tl.int64)
    for start in range(0, bs, BLOCK_B):
        b = start + tl.arange(0, BLOCK_B)
        kv_len = tl.load(kv_lens_ptr + b, mask=b < bs, other=0, cache_modifier=".cg").to(tl.int64)
        running = tl.cumsum(kv_len, axis=0) + carry
        tl.store(cu_kv_lens_ptr + 1 + b, running.to(tl.int32), mask=b < bs)
        carry += tl.sum(kv_len, axis=0)


@triton.jit
def _page_table_kernel(selected_ptr, lengths_ptr, mask_ptr, seq_lens_ptr, rows_ptr, req_to_token_ptr,
                       page_table_ptr, kv_lens_ptr, cu_kv_lens_ptr,
                       bs, width, out_width, r2t_rows, r2t_width, page_size,
                       BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program = one BLOCK_W block of one row's page table; the one extra program row ``r == bs``
    writes every ``kv_lens`` entry and their running sum ``cu_kv_lens`` in BLOCK_B chunks."""
    c = tl.program_id(0)
    r = tl.program_id(1)
    if r < bs:  # one block of one row's page table
        row = tl.load(rows_ptr + r).to(tl.int64)
        row = tl.minimum(tl.maximum(row, 0), r2t_rows - 1)
        _table_entries(selected_ptr + r.to(tl.int64) * width, tl.load(lengths_ptr + r), width,
                       tl.load(seq_lens_ptr + r).to(tl.int64), tl.load(mask_ptr + r) != 0,
                       req_to_token_ptr + row * r2t_width, r2t_width, page_size,
                       page_table_ptr + r.to(tl.int64) * out_width, out_width, c * BLOCK_W + tl.arange(0, BLOCK_W),
                       False)
    elif c == 0:  # the extra program: kv_lens and their running sum
        tl.store(cu_kv_lens_ptr, 0)
        carry = tl.zeros([], dtype=tl.int64)
        for start in range(0, bs, BLOCK_B):
            b = start + tl.arange(0, BLOCK_B)
            in_b = b < bs
            seq = tl.load(seq_lens_ptr + b, mask=in_b, other=0).to(tl.int64)
            seq = tl.minimum(tl.maximum(seq, 0), r2t_width)
            n = (seq + page_size - 1) // page_size
            lens = tl.load(lengths_ptr + b, mask=in_b, other=0).to(tl.int64)
            lens = tl.minimum(tl.maximum(lens, 0), width)
            sparse = (tl.load(mask_ptr + b, mask=in_b, other=0) != 0) & (lens > 0)
            last_page_len = seq - (n - 1) * page_size
            kv_len = tl.where(sparse, (lens - 1) * page_size + last_page_len, seq)
            kv_len = tl.where(in_b, kv_len, 0)
            tl.store(kv_lens_ptr + b, kv_len.to(tl.int32), mask=in_b)
            running = tl.cumsum(kv_len, axis=0) + carry
            tl.store(cu_kv_lens_ptr + 1 + b, running.to(tl.int32), mask=in_b)
            carry += tl.sum(kv_len, axis=0)


def block_sizes(out_width: int, interpreted: bool) -> tuple[int, int]:
    """``(BLOCK_W, BLOCK_B)``: table entries per program and batch rows per step of the lengths program."""
    if interpreted:  # the interpreter pays per program and per element: small blocks, few programs
        return max(16, min(128, triton.next_power_of_2(max(out_width, 1)))), 64
    return max(128, min(1024, triton.next_power_of_2(max(out_width, 1)))), 1024


def page_table_from_selection(selected: torch.Tensor, lengths: torch.Tensor, sparse_mask: torch.Tensor,
                              seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                              page_size: int, out=None, check_values: bool = True):
    """``(page_table, kv_lens, cu_kv_lens)`` from a selection, in one launch (see the module docstring).

    ``selected`` int32/int64 ``[bs, W]`` kept logical pages (-1 padded), ``lengths`` ``[bs]``,
    ``sparse_mask`` bool ``[bs]``, ``seq_lens`` and ``req_pool_indices`` int ``[bs]`` (the forward
    batch), ``req_to_token`` int32 ``[rows, max_context_len]``. ``out``: optional contiguous int32
    ``(page_table [bs, W_out], kv_lens [bs], cu_kv_lens [bs + 1])`` written in place and returned.
    ``check_values``: the values checked on the host as ``adaptor.to_attention_metadata`` checks them
    (every page a row names is its own, in order, once, its last page last; skipped while a CUDA graph
    captures, where the kernel's clamps keep every read inside the row's own pages). The adaptor passes
    False after making the same checks itself.
    """
    out_width, shapes = check_page_table(selected, lengths, sparse_mask, seq_lens, req_pool_indices,
                                                req_to_token, page_size, out, check_values)
    bs, width = selected.shape
    r2t_rows, r2t_width = req_to_token.shape
    interpreted = triton_interpreted()
    if out is None:
        out = tuple(torch.empty(shape, dtype=torch.int32, device=selected.device) for shape in shapes)
    block_w, block_b = block_sizes(out_width, interpreted)
    grid = (max(1, triton.cdiv(out_width, block_w)), bs + 1)
    _page_table_kernel[grid](selected.contiguous(), lengths.contiguous(), sparse_mask.contiguous().view(torch.uint8),
                             seq_lens.contiguous(), req_pool_indices.contiguous(), req_to_token,
                             out[0], out[1], out[2], bs, width, out_width, r2t_rows, r2t_width, page_size,
                             BLOCK_W=block_w, BLOCK_B=block_b, num_warps=4)
    return out[0], out[1], out[2]


# ------------------------------ argument checks (each entry point above calls one first)
def check_page_table(selected, lengths, sparse_mask, seq_lens, req_pool_indices, req_to_token, page_size, out,
                     check_values: bool):
    """``(out_width, shapes)`` of ``page_table_from_selection``: the contract of ``to_attention_metadata``."""
    fn = "page_table_from_selection"
    check_tensor("selected", selected, dtype=INDEX_DTYPES, dims=2,
                 fix="pass the selection returned by retrieve_topk, int32 [bs, W].")
    bs, width = selected.shape
    for name, t, dtype in (("lengths", lengths, INDEX_DTYPES), ("sparse_mask", sparse_mask, torch.bool),
                           ("seq_lens", seq_lens, INDEX_DTYPES), ("req_pool_indices", req_pool_indices, INDEX_DTYPES)):
        check_tensor(name, t, dtype=dtype, shape=(bs,), fix=f"pass one {name} entry per row of selected.")
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, contiguous=True,
                 fix="pass the req_to_token table of the ReqToTokenPool.")
    page_size = check_int("page_size", page_size, low=1, fix="pass the KV pool's page size.")
    r2t_rows, r2t_width = req_to_token.shape
    if r2t_rows == 0:
        fail("req_to_token", "at least one row", f"shape {tuple(req_to_token.shape)}")
    out_width = max(width, -(-r2t_width // page_size))
    shapes = ((bs, out_width), (bs,), (bs + 1,))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail("out", "a tuple (page_table, kv_lens, cu_kv_lens) of int32 buffers", repr(type(out)))
        for name, t, shape in zip(("page_table", "kv_lens", "cu_kv_lens"), out, shapes, strict=True):
            check_tensor(f"out {name}", t, dtype=torch.int32, shape=shape, contiguous=True,
                         fix=f"preallocate torch.zeros({shape}, dtype=torch.int32) on the device of selected.")
    check_same_device(fn, "selected", {"selected": selected, "lengths": lengths, "sparse_mask": sparse_mask,
                                       "seq_lens": seq_lens, "req_pool_indices": req_pool_indices,
                                       "req_to_token": req_to_token,
                                       **({} if out is None else {"out page_table": out[0], "out kv_lens": out[1],
                                                                  "out cu_kv_lens": out[2]})})
    check_kernel_device(f"{fn}: selected", selected,
                        "use sparse_ref.adaptor.to_attention_metadata(backend='torch') on CPU.")
    if check_values:
        check_selection_values(selected, lengths, sparse_mask, seq_lens, req_pool_indices, req_to_token, page_size)
    if bs >= 65535:
        fail("selected", "fewer than 65535 rows (one launch)", f"{bs} rows", "build the table in chunks of rows.")
    return out_width, shapes
