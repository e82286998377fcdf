"""From a selection of logical pages to what a paged attention kernel reads.

``to_attention_metadata`` turns ``retrieve_topk``'s *logical* pages into ``page_table`` (physical pages in
selection order, padded with the reserved page 0, a static width wide enough for a dense row),
``kv_lens`` (``(len - 1) * P + last_page_len`` for a sparse row, whose last kept page is the request's
last; ``seq_len`` for a dense row) and ``cu_kv_lens``. At page size 1 it maps DSA's token positions.
``docs/design.md`` section 3.7 states the contract; ``sparse_ref.algorithms.base.retrieve_attention_metadata``
runs retrieval and this adaptor as one call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_ref import checks
from sparse_ref.backend import choose_backend, torch_twin
from sparse_ref.checks import (
    INDEX_DTYPES,
    INT32_MAX,
    check_int,
    check_rows,
    check_same_device,
    check_selection_values,
    check_tensor,
    describe,
    fail,
)
from sparse_ref.errors import ShapeError
from sparse_ref.selection import ceil_div, select_pages_unchecked


@dataclass
class Metadata:
    """What attention reads: physical pages (slots at page size 1), KV lengths, and the page size."""

    page_table: torch.Tensor
    kv_lens: torch.Tensor
    page_size: int
    selected: torch.Tensor | None = None  # logical pages (Quest) or positions (DSA), ascending, -1 padded
    lengths: torch.Tensor | None = None  # kept entries per row; 0 = the row stays dense
    sparse_mask: torch.Tensor | None = None


def lengths_from_selection(selected: torch.Tensor) -> torch.Tensor:
    """int32 ``[bs]``: entries ``>= 0`` per row of a -1 padded selection (e.g. DSA's top-k tokens)."""
    checks.check_tensor("selected", selected, dtype=checks.INDEX_DTYPES, dims=2)
    return (selected >= 0).sum(dim=1).to(torch.int32)


def page_table_width(selection_width: int, max_context_len: int, page_size: int) -> int:
    """``W_out = max(W, ceil(max_context_len / P))``: the static width of the page table."""
    return max(selection_width, ceil_div(max_context_len, page_size))


def to_attention_metadata(selected: torch.Tensor, lengths: torch.Tensor, sparse_mask: torch.Tensor, forward_batch,
                          req_to_token: torch.Tensor, page_size: int, out=None, backend=None):
    """``(page_table, kv_lens, cu_kv_lens)`` for paged attention (see the module docstring).

    ``out``: optional ``(page_table, kv_lens, cu_kv_lens)`` int32 buffers written in place (CUDA
    graph replay); they are returned. ``backend``: the engine's ``Backend``, or a name for ``choose_backend`` (its
    ``page_table``: on the Triton side one launch); ``None``, the batched torch below (no host sync once the eager
    checks are skipped).
    """
    page_size = check_attention_metadata(selected, lengths, sparse_mask, forward_batch, req_to_token, page_size, out)
    table = page_table_torch if backend is None else choose_backend(backend, selected.device).page_table
    return table(selected, lengths, sparse_mask, forward_batch.seq_lens, forward_batch.req_pool_indices, req_to_token,
                 page_size, out)


@torch_twin("page_table")
def page_table_torch(selected: torch.Tensor, lengths: torch.Tensor, sparse_mask: torch.Tensor, seq_lens: torch.Tensor,
                     req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, page_size: int, out=None):
    """The adaptor's batched torch (the backend's torch page table, the kernel's signature), on checked inputs."""
    bs, width = selected.shape
    device = selected.device
    w_out = page_table_width(width, req_to_token.shape[1], page_size)
    seq = seq_lens.long()
    n = ceil_div(seq, page_size)
    lens = lengths.long()
    sparse = sparse_mask & (lens > 0)

    cols = torch.arange(w_out, device=device)
    if w_out > width:
        pad = torch.full((bs, w_out - width), -1, dtype=selected.dtype, device=device)
        chosen = torch.cat([selected, pad], dim=1)
    else:
        chosen = selected
    logical = torch.where(sparse[:, None], chosen.long(), cols[None, :].expand(bs, -1))
    count = torch.where(sparse, lens, n)
    live = cols[None, :] < count[:, None]
    first_token = torch.where(live, logical, torch.zeros_like(logical)) * page_size
    rows = req_pool_indices.long()[:, None]
    physical = req_to_token[rows, first_token.clamp(max=req_to_token.shape[1] - 1)] // page_size
    page_table = torch.where(live, physical, torch.zeros_like(physical)).to(torch.int32)

    last_page_len = seq - (n - 1) * page_size
    kv_lens = torch.where(sparse, (lens - 1) * page_size + last_page_len, seq).to(torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(kv_lens.long(), 0)])
    cu_kv_lens = cu.to(torch.int32)
    if out is None:
        return page_table, kv_lens, cu_kv_lens
    out[0].copy_(page_table)
    out[1].copy_(kv_lens)
    out[2].copy_(cu_kv_lens)
    return out[0], out[1], out[2]


@torch_twin("select_to_table")
def select_to_table_torch(scores: torch.Tensor, seq_lens: torch.Tensor, sparse_mask: torch.Tensor, page_size: int,
                          config, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, out=None):
    """The backend's torch retrieval + table (the fused kernel's signature): ``select_pages`` then the page table."""
    selected, lengths = select_pages_unchecked(scores, seq_lens, sparse_mask, page_size, config)
    return selected, lengths, *page_table_torch(selected, lengths, sparse_mask, seq_lens, req_pool_indices,
                                                req_to_token, page_size, out)


# ------------------------------ argument checks (each entry point above calls one first)
def check_attention_metadata(selected, lengths, sparse_mask, forward_batch, req_to_token, page_size, out) -> int:
    """The adaptor's inputs: types, shapes, devices, then every value (``check_selection_values``); the page size."""
    check_tensor("selected", selected, dtype=INDEX_DTYPES, dims=2,
                 fix="pass the selection returned by retrieve_topk, int32 [bs, W].")
    bs, width = selected.shape
    seq_lens = getattr(forward_batch, "seq_lens", None)
    rows = getattr(forward_batch, "req_pool_indices", None)
    tensors = {"selected": selected, "lengths": lengths, "sparse_mask": sparse_mask, "forward_batch.seq_lens": seq_lens,
               "forward_batch.req_pool_indices": rows}
    for name, t in list(tensors.items())[1:]:
        check_tensor(name, t, dtype=torch.bool if name == "sparse_mask" else INDEX_DTYPES, dims=1,
                     fix="pass the ForwardBatch of this step." if "." in name else "")
        check_rows(name, t, bs, "one per row of selected")
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2)
    check_same_device("to_attention_metadata", "selected", {**tensors, "req_to_token": req_to_token})
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    w_out = max(width, -(-req_to_token.shape[1] // page_size))
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail("out", "a tuple (page_table, kv_lens, cu_kv_lens) of preallocated buffers", describe(out))
        for name, t, shape in (("page_table", out[0], (bs, w_out)), ("kv_lens", out[1], (bs,)),
                               ("cu_kv_lens", out[2], (bs + 1,))):
            check_tensor(f"out {name}", t, dtype=torch.int32, shape=shape, device=selected.device)
    check_selection_values(selected, lengths, sparse_mask, seq_lens, rows, req_to_token, page_size, "forward_batch.")
    return page_size
