"""From a selection of logical pages to what a paged attention kernel reads.

``retrieve_topk`` names *logical* pages (page ``j`` of request ``r``). Attention needs
*physical* pages, a KV length per request and cumulative lengths:

* ``page_table`` int32 ``[bs, W_out]``: physical page of each kept page, in selection order.
  Entries past a row's page count are the reserved page 0 (never real data).
  ``W_out = max(W, max_pages)`` with ``max_pages = ceil(req_to_token.shape[1] / P)``: static
  (a CUDA graph needs fixed shapes) and wide enough for a dense row's full page list.
* ``kv_lens`` int32 ``[bs]``: tokens to attend to. A sparse row keeps ``len`` pages, all full but
  the last, which is the request's last page (always kept as a recent page) holding
  ``last_page_len = seq_len - (n - 1) * P`` tokens, so ``kv_len = (len - 1) * P + last_page_len``.
  A dense row (length 0, or ``sparse_mask`` False) gets all its ``n = ceil(seq_len / P)`` pages
  and ``kv_len = seq_len``.
* ``cu_kv_lens`` int32 ``[bs + 1]``: 0, then the running sum of ``kv_lens``.

It also works at page size 1 for token selections (DSA): there, ``lengths`` is the count of
non-negative entries, ``lengths_from_selection(selected)``.
"""

from __future__ import annotations

import torch

from sparse_ref.checks import (
    INDEX_DTYPES,
    INT32_MAX,
    capturing,
    check_choice,
    check_int,
    check_range,
    check_rows,
    check_same_device,
    check_tensor,
    describe,
    fail,
)
from sparse_ref.errors import ShapeError, SparseRefError
from sparse_ref.selection import ceil_div


def lengths_from_selection(selected: torch.Tensor) -> torch.Tensor:
    """int32 ``[bs]``: entries ``>= 0`` per row of a -1 padded selection (e.g. DSA's top-k tokens)."""
    check_tensor("selected", selected, dtype=INDEX_DTYPES, dims=2)
    return (selected >= 0).sum(dim=1).to(torch.int32)


def page_table_width(selection_width: int, max_context_len: int, page_size: int) -> int:
    """``W_out = max(W, ceil(max_context_len / P))``: the static width of the page table."""
    return max(selection_width, ceil_div(max_context_len, page_size))


def _check_inputs(selected, lengths, sparse_mask, forward_batch, req_to_token, page_size, out) -> None:
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
    w_out = page_table_width(width, req_to_token.shape[1], page_size)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail("out", "a tuple (page_table, kv_lens, cu_kv_lens) of preallocated buffers", describe(out))
        for name, t, shape in (("page_table", out[0], (bs, w_out)), ("kv_lens", out[1], (bs,)),
                               ("cu_kv_lens", out[2], (bs + 1,))):
            check_tensor(f"out {name}", t, dtype=torch.int32, shape=shape, device=selected.device)
    if bs == 0 or capturing():
        return
    # Eager value checks (each syncs with the host, so none of them runs while a graph captures).
    check_range("forward_batch.seq_lens", seq_lens, 0, req_to_token.shape[1])
    check_range("forward_batch.req_pool_indices", rows, 0, req_to_token.shape[0] - 1)
    check_range("lengths", lengths, 0, width, "(the width of selected).")
    t = torch.arange(req_to_token.shape[1], device=selected.device)
    padding = (t[None, :] < seq_lens[:, None]) & (req_to_token[rows.long()] < page_size)
    if bool(padding.any()):
        r, tok = (int(x) for x in padding.nonzero()[0])
        fail("forward_batch.seq_lens", "lengths within each request's tokens", f"row {r} has seq_len "
             f"{int(seq_lens[r])} but token {tok} maps to padding page 0", "pass the batch built for these requests.")
    n = ceil_div(seq_lens.long(), page_size)
    cols = torch.arange(width, device=selected.device)
    live = cols[None, :] < lengths[:, None]
    sparse = sparse_mask & (lengths > 0)
    bad = sparse[:, None] & live & ((selected < 0) | (selected >= n[:, None]))
    bad |= sparse[:, None] & ~live & (selected != -1)
    if bool(bad.any()):
        r, j = (int(x) for x in bad.nonzero()[0])
        raise ShapeError(
            f"selected: row {r} entry {j} is {int(selected[r, j])}; expected its first lengths[r]={int(lengths[r])} "
            f"entries in [0, {int(n[r])}) (ceil(seq_len / page_size) pages of that request) and -1 after. "
            "A request may only name its own pages. Fix: pass the (selected, lengths) of retrieve_topk unchanged."
        )
    ids = torch.where(live & sparse[:, None], selected.long(), torch.full_like(selected, -1, dtype=torch.long))
    ids = torch.sort(ids, dim=1).values
    if bool(((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any()):
        raise ShapeError("selected: a row names the same page twice; each kept page must appear once.")
    if page_size > 1 and width > 0:  # (width 0: every length is 0, every row dense)
        last = selected.long().gather(1, (lengths.long() - 1).clamp(min=0)[:, None]).squeeze(1)
        wrong = sparse & (last != n - 1)
        if bool(wrong.any()):
            r = int(wrong.nonzero()[0, 0])
            raise ShapeError(
                f"selected: row {r} ends with page {int(last[r])}, not its last page {int(n[r] - 1)}. The KV length "
                "(len - 1) * P + last_page_len needs the last (partial) page kept last. Fix: keep num_recent_pages "
                ">= 1 and pass the ascending selection of retrieve_topk."
            )


def to_attention_metadata(selected: torch.Tensor, lengths: torch.Tensor, sparse_mask: torch.Tensor, forward_batch,
                          req_to_token: torch.Tensor, page_size: int, out=None, backend: str = "auto"):
    """``(page_table, kv_lens, cu_kv_lens)`` for paged attention (see the module docstring).

    ``out``: optional ``(page_table, kv_lens, cu_kv_lens)`` int32 buffers written in place (CUDA
    graph replay); they are returned. Batched torch, no host sync once the eager checks are skipped.
    ``backend``: "torch" (the batched torch below), "triton" (the same result in one launch,
    ``sparse_ref.kernels.page_table``) or "auto" (triton on CUDA, torch elsewhere).
    """
    _check_inputs(selected, lengths, sparse_mask, forward_batch, req_to_token, page_size, out)
    seq_lens, rows = forward_batch.seq_lens, forward_batch.req_pool_indices
    check_choice("backend", backend, ("auto", "torch", "triton"), "leave backend='auto'.", SparseRefError)
    if backend == "triton" or (backend == "auto" and selected.device.type == "cuda"):
        from sparse_ref.kernels.page_table import page_table_from_selection  # kernels import only when used

        return page_table_from_selection(selected, lengths, sparse_mask, seq_lens, rows, req_to_token, page_size,
                                         out=out, check_values=False)  # values were checked just above
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
    physical = req_to_token[rows.long()[:, None], first_token.clamp(max=req_to_token.shape[1] - 1)] // page_size
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


def retrieve_attention_metadata(algo, queries: torch.Tensor, layer_id: int, req_pool_indices: torch.Tensor,
                                sparse_mask: torch.Tensor, forward_batch, req_to_token: torch.Tensor, out=None):
    """``algo.retrieve_topk`` then ``to_attention_metadata``, as one step of the decode:
    ``(selected, lengths, page_table, kv_lens, cu_kv_lens)``.

    The results are those of the two calls. Where the selection runs in Triton (a CUDA device, a
    page-scoring algorithm such as Quest, rows the register kernel holds) the selection kernel also
    writes the page table (``kernels/page_select.py`` ``select_pages_to_table``): at bs=1 every
    launch costs a few microseconds of latency, about what the whole table costs to write.
    ``out``: optional ``(page_table, kv_lens, cu_kv_lens)`` int32 buffers, written in place.
    """
    from sparse_ref.algorithms.base import SparseAlgorithm, forward_batch_with_seq_lens

    if not isinstance(algo, SparseAlgorithm):
        fail("algo", "a sparse algorithm (sparse_ref.create_sparse_algorithm)", describe(algo),
             "pass the layer's algorithm.")
    forward_batch = forward_batch_with_seq_lens({"forward_batch": forward_batch})
    backend = algo.selection_backend
    on_cuda = isinstance(queries, torch.Tensor) and queries.is_cuda
    fused = type(algo).retrieve_topk is SparseAlgorithm.retrieve_topk and (
        backend == "triton" or (backend == "auto" and on_cuda))  # as SparseAlgorithm._select chooses
    if fused:
        from sparse_ref.kernels import page_select  # kernels import only when used

        fused = getattr(algo, "max_pages", page_select.MAX_REGISTER_PAGES + 1) <= page_select.MAX_REGISTER_PAGES
    if not fused:
        selected, lengths = algo.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask,
                                               forward_batch=forward_batch)
        return selected, lengths, *to_attention_metadata(selected, lengths, sparse_mask, forward_batch, req_to_token,
                                                         algo.page_size, out=out)
    algo._check_retrieve_inputs(queries, layer_id, req_pool_indices, sparse_mask, forward_batch)
    check_tensor("req_to_token", req_to_token, dtype=torch.int32, dims=2, device=queries.device,
                 fix="pass the req_to_token table of the ReqToTokenPool.")
    scores = algo.score_pages(queries, layer_id, req_pool_indices, forward_batch)
    return page_select.select_pages_to_table(scores, forward_batch.seq_lens.to(scores.device),
                                             sparse_mask.to(scores.device), algo.page_size, algo.config,
                                             forward_batch.req_pool_indices.to(scores.device), req_to_token,
                                             out=out, check_values=not capturing())
