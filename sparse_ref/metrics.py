"""How good is a selection? Measured against dense attention (the oracle).

* ``page_attention_mass(probs, page_size)``: the true attention mass of each logical page,
  averaged over query heads, from ``dense_decode_attention(..., return_probs=True)``.
* ``page_recall``: the share of the oracle's top pages (by true mass) that a selection kept.
* ``attention_mass_kept``: the share of attention mass on the kept pages (1.0 = nothing lost).
* ``relative_error``: ``||out - ref|| / ||ref||`` per request, sparse output against dense.

Rows that stay dense (length 0) keep everything: recall and mass kept are 1.0 there.

And how close is a kernel to its torch reference? ``assert_matches_reference(got, want, kind)`` is
the one tolerance policy that tests and notebooks share, chosen by the backend that ran (a CUDA
tensor came from a compiled kernel, a CPU tensor from the interpreter):

* ``"ids"``: exactly equal (selections, page tables, lengths);
* ``"fp32"``: fp32 sums in another order (Quest scores, fp32 attention): ``rtol = 1e-5``, ``atol = 1e-4``;
* ``"fp8_logits"``: the DSA indexer's logits. Compiled, FP8 tensor-core accumulation: within
  ``2e-3`` of the tensor's largest ``|logit|`` (measured <= 3.4e-4 at DeepSeek's shapes; the error follows
  the magnitude of the summed terms, not a row's possibly cancelling sum). Interpreted (exact FP8
  products, fp32 sums): ``2e-5`` of each row's largest ``|logit|``;
* ``"attention_16bit"``: attention over 16-bit K/V. Compiled, two-term 16-bit dots keep ~16 mantissa
  bits: ``1e-3``; interpreted (widened to fp32): ``1e-5``.

``-inf`` and NaN must sit at the same places in both; the rest is compared by value.
"""

from __future__ import annotations

import torch

from sparse_ref.checks import FLOAT_DTYPES, INDEX_DTYPES, INT32_MAX, check_choice, check_int, check_rows, check_tensor
from sparse_ref.errors import ShapeError
from sparse_ref.selection import ceil_div, topk_reference


def page_attention_mass(probs: torch.Tensor, page_size: int) -> torch.Tensor:
    """fp32 ``[bs, ceil(T / P)]``: attention mass of each logical page, mean over heads (rows sum to 1)."""
    check_tensor("probs", probs, dtype=FLOAT_DTYPES, dims=3,
                 fix="pass the probabilities of dense_decode_attention, [bs, H_q, T].")
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    bs, heads, t = probs.shape
    pages = ceil_div(t, page_size)
    padded = torch.nn.functional.pad(probs.float(), (0, pages * page_size - t))
    return padded.reshape(bs, heads, pages, page_size).sum(-1).mean(1)


def _kept_mask(selected: torch.Tensor, lengths: torch.Tensor, num_pages: int) -> torch.Tensor:
    """bool ``[bs, num_pages]``: page kept by the row (every page for a dense row)."""
    check_tensor("selected", selected, dtype=INDEX_DTYPES, dims=2)
    check_tensor("lengths", lengths, dtype=INDEX_DTYPES, dims=1, device=selected.device)
    check_rows("lengths", lengths, selected.shape[0], "one per row of selected")
    live = (torch.arange(selected.shape[1], device=selected.device)[None, :] < lengths[:, None]) & (selected >= 0)
    ids = torch.where(live, selected.long(), torch.full_like(selected, num_pages, dtype=torch.long))
    kept = torch.zeros(selected.shape[0], num_pages + 1, dtype=torch.bool, device=selected.device)
    kept.scatter_(1, ids.clamp(max=num_pages), True)
    kept = kept[:, :num_pages]
    return kept | (lengths == 0)[:, None]


def attention_mass_kept(selected: torch.Tensor, lengths: torch.Tensor, page_mass: torch.Tensor) -> torch.Tensor:
    """fp32 ``[bs]``: the share of each request's attention mass on its kept pages."""
    _check_mass(page_mass, selected)
    kept = _kept_mask(selected, lengths, page_mass.shape[1])
    return torch.where(kept, page_mass, torch.zeros_like(page_mass)).sum(1) / page_mass.sum(1).clamp(min=1e-30)


def page_recall(selected: torch.Tensor, lengths: torch.Tensor, page_mass: torch.Tensor, seq_lens: torch.Tensor,
                page_size: int, k: int | None = None) -> torch.Tensor:
    """fp32 ``[bs]``: share of the oracle's top-``k`` pages (by true mass, among the row's pages) kept.

    ``k`` defaults to each row's own ``lengths`` (the best a selection of that size could do).
    """
    _check_mass(page_mass, selected)
    check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, dims=1)
    check_rows("seq_lens", seq_lens, page_mass.shape[0], "one per row of page_mass")
    page_size = check_int("page_size", page_size, low=1, high=INT32_MAX, error=ShapeError)
    if k is not None:
        check_int("k", k, low=0, high=INT32_MAX, error=ShapeError)
    num_pages = page_mass.shape[1]
    kept = _kept_mask(selected, lengths, num_pages)
    k_row = lengths.long() if k is None else torch.full_like(lengths, k, dtype=torch.long)
    n = ceil_div(seq_lens.long().to(page_mass.device), page_size).clamp(max=num_pages)
    k_row = torch.minimum(k_row, n)
    width = num_pages
    oracle = topk_reference(page_mass, k_row, n, width=width).long()
    hit = (oracle >= 0) & kept.gather(1, oracle.clamp(min=0))
    recall = hit.sum(1).float() / k_row.clamp(min=1).float()
    return torch.where((lengths == 0) | (k_row == 0), torch.ones_like(recall), recall)


def _check_mass(page_mass, selected) -> None:
    check_tensor("selected", selected, dtype=INDEX_DTYPES, dims=2)
    check_tensor("page_mass", page_mass, dtype=FLOAT_DTYPES, dims=2, fix="pass page_attention_mass(probs, page_size).")
    check_rows("page_mass", page_mass, selected.shape[0], "one per row of selected")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """fp32 ``[bs]``: ``||out - ref|| / ||ref||`` per request (over heads and dims)."""
    check_tensor("ref", ref, dtype=FLOAT_DTYPES, dims=(2, 3))
    check_tensor("out", out, dtype=FLOAT_DTYPES, shape=tuple(ref.shape), device=ref.device)
    diff = (out.float() - ref.float()).reshape(out.shape[0], -1).norm(dim=1)
    return diff / ref.float().reshape(ref.shape[0], -1).norm(dim=1).clamp(min=1e-30)


# ----------------------------------------------------------------------------- kernel against reference
KINDS = ("ids", "fp32", "fp8_logits", "attention_16bit")


def compare_with_dense(trace, q: torch.Tensor, batch, manager) -> None:
    """Dense attention (the oracle) beside an engine layer's output: fills ``trace``'s ``dense_out``,
    ``output_error``, ``recall`` and ``mass_kept`` (``DecodeEngine.step`` calls it for every layer)."""
    from sparse_ref.attention import dense_decode_attention

    pool, md = manager.token_to_kv_pool, trace.metadata
    k_buf, v_buf = pool.get_key_buffer(trace.layer), pool.get_value_buffer(trace.layer)
    on = k_buf.device  # an offloaded layer's K/V is in host memory: the oracle runs there
    ref, probs = dense_decode_attention(q.to(on), k_buf, v_buf, manager.req_to_token_pool.req_to_token.to(on),
                                        batch.req_pool_indices.to(on), batch.seq_lens.to(on), return_probs=True)
    ref, probs = ref.to(q.device), probs.to(q.device)
    trace.dense_out, trace.output_error = ref, relative_error(trace.out, ref)
    if md.selected is None:  # a dense layer keeps everything
        trace.recall = trace.mass_kept = torch.ones(q.shape[0], device=q.device)
        return
    lengths = torch.where(md.sparse_mask, md.lengths, torch.zeros_like(md.lengths))
    mass = page_attention_mass(probs, md.page_size)
    trace.mass_kept = attention_mass_kept(md.selected, lengths, mass)
    trace.recall = page_recall(md.selected, lengths, mass, batch.seq_lens, md.page_size)


def assert_matches_reference(got: torch.Tensor, want: torch.Tensor, kind: str, what: str = "kernel") -> None:
    """Raise AssertionError unless ``got`` (a kernel's result) matches ``want`` (its torch reference) per ``kind``."""
    check_choice("kind", kind, KINDS)
    check_tensor("got", got, shape=tuple(want.shape))
    want = want.to(got.device)
    if kind == "ids":
        if not torch.equal(got, want.to(got.dtype)):
            raise AssertionError(f"{what}: ids differ from the reference at {_first_diff(got, want)}")
        return
    got, want = got.double(), want.double()
    for special in (torch.isnan, torch.isneginf, torch.isposinf):
        if not torch.equal(special(got), special(want)):
            raise AssertionError(f"{what}: {special.__name__[2:]} at other places than in the reference")
    finite = torch.isfinite(want)
    if not bool(finite.any()):
        return
    g, w = torch.where(finite, got, 0.0), torch.where(finite, want, 0.0)
    compiled = got.is_cuda
    if kind == "fp8_logits":
        scale = (w.abs().amax() if compiled else w.abs().amax(-1, keepdim=True)).clamp_min(1e-6)
        allowed, err = (2e-3 if compiled else 2e-5), float(((g - w).abs() / scale).amax())
        if err > allowed:
            raise AssertionError(f"{what}: {err:.2e} of the largest |logit| apart (allowed {allowed:g})")
        return
    rtol, atol = {"fp32": (1e-5, 1e-4), "attention_16bit": (1e-3, 1e-3) if compiled else (1e-5, 1e-5)}[kind]
    torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    differ = (got != want.to(got.dtype)).nonzero()
    return "nowhere" if differ.numel() == 0 else str(tuple(differ[0].tolist()))
