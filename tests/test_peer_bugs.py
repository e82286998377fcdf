"""The bugs production peers published (top-k kernels, the indexer), each as a test here.

* SGLang's top-k emitted -1 (and ids outside the row) when the k-th value was a tie among exact zeros
  (ReLU-degenerate indexer scores), and attention then read through them;
* vLLM's top-k took ``logits.size(1)`` as the row stride of a padded, sliced logits view (as DeepGEMM returns);
* coarse bins from the fp16 rounding of a score collapse every row whose values lie outside fp16's range;
* a dropped tie left output slots unwritten, so a stale id from the previous step survived;
* the indexer's RoPE in the wrong (interleaved) layout is right until the context exceeds ``index_topk``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import sparse_ref
from sparse_ref.kernels.topk import topk
from sparse_ref.selection import topk_reference

DEVICE = sparse_ref.default_device()


def exact(scores, k, lengths=None, order="index", **kw):
    """The kernel against the reference on the same inputs; returns the kernel's ids."""
    got = topk(scores.to(DEVICE), k, None if lengths is None else lengths.to(DEVICE), order=order, **kw).cpu()
    want = topk_reference(scores, k, lengths, order=order)
    assert torch.equal(got, want), (got, want)
    return got


def ids_in_range(ids, lengths, k):
    """Every id names a token of its own row; no -1 before ``min(length, k)`` entries; -1 after."""
    for row, n in zip(ids, lengths.tolist(), strict=True):
        want = min(n, k)
        assert bool((row[:want] >= 0).all()) and bool((row[:want] < n).all()), row
        assert bool((row[want:] == -1).all()), row


@pytest.mark.parametrize("order", ["index", "score"])
def test_a_tie_of_exact_zeros_at_the_kth_value_names_only_the_rows_own_tokens(order):
    """SGLang's repro scaled down: a few winners, then thousands of exact zeros on which the k-th value falls."""
    g = torch.Generator().manual_seed(0)
    n, k, rows = 1300, 300, 3
    scores = torch.zeros(rows, n)
    for r in range(rows):
        scores[r, torch.randperm(n, generator=g)[:40]] = torch.rand(40, generator=g) + 0.5  # 40 winners
    scores[1, :10] = float("-inf")  # and rows with -inf and a short length
    lengths = torch.tensor([n, n - 3, 250])
    ids = exact(scores, k, lengths, order)
    ids_in_range(ids, lengths, k)
    for row in ids:
        kept = row[row >= 0]
        assert kept.unique().numel() == kept.numel()  # no id twice


def test_a_padded_sliced_logits_view_reads_each_row_at_its_stride():
    """DeepGEMM pads the logits width (here to 256) and returns ``full[:, :width]``: the row stride is not the
    width. The kernel must read row ``r`` at ``r * stride``, as torch does."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(5, 256, generator=g)
    full[:, 200:] = 1e9  # the padding: a stride taken as the width would pick these up
    view = full[:, :200]
    assert not view.is_contiguous() and view.stride(0) == 256
    for k, lengths in ((37, None), (150, torch.tensor([200, 199, 1, 0, 120]))):
        ids = exact(view, k, lengths)
        assert int(ids.max()) < 200


@pytest.mark.parametrize("values", ["above_fp16", "below_fp16", "both"])
def test_rows_outside_the_fp16_range_are_still_exact(values):
    """All above 65504, all below 2^-24, or both in one row: bins built on fp16 keys collapse such rows."""
    g = torch.Generator().manual_seed(2)
    base = torch.rand(4, 900, generator=g, dtype=torch.float64)
    big, tiny = (1e5 + base * 1e3).float(), (base * 1e-9).float()
    scores = {"above_fp16": big, "below_fp16": tiny, "both": torch.where(base > 0.5, big, tiny)}[values]
    assert len(scores[0].unique()) > 800  # distinct values: the order is fully determined
    for order in ("index", "score"):
        exact(scores, 128, order=order)


def test_every_output_slot_is_written_whatever_the_buffer_held():
    """A stale id in an output slot the kernel does not write would page-translate to another step's KV: every
    slot is written, ids or -1, on rows with fewer valid entries than k (NaN, -inf, short lengths)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 700, generator=g)
    scores[0, 100:] = float("nan")
    scores[1, :] = float("-inf")
    scores[1, :5] = 1.0
    lengths = torch.tensor([700, 700, 30, 0])
    for order in ("index", "score"):
        out = torch.full((4, 64), 12345, dtype=torch.int32, device=DEVICE)
        got = topk(scores.to(DEVICE), 64, lengths.to(DEVICE), order=order, out=out).cpu()
        assert torch.equal(got, topk_reference(scores, 64, lengths, order=order))
        assert not bool((got == 12345).any())
        assert (got[1] >= 0).sum() == 5 and (got[2] >= 0).sum() == 30 and bool((got[3] == -1).all())


def test_the_indexers_rope_layout_is_neox_past_index_topk_tokens():
    """DeepSeek's indexer rotates half-split pairs (NeoX). With interleaved pairs a selection is right while the
    context fits ``index_topk`` (every token is kept) and wrong after: here a 96-token request against
    ``index_topk=12``, checked against the NeoX formula in fp64, and shown to differ from the interleaved one."""
    from test_indexer import SMALL, inputs, make, reference_scores

    from sparse_ref.batch import build_extend_batch

    cfg = dataclasses.replace(SMALL, use_fp8=False, index_topk=12)
    assert not cfg.rope_interleaved
    mgr, idx = make(cfg, seed=5)
    req = mgr.admit(96)
    fb = build_extend_batch(mgr, [req])
    x, ql = inputs(cfg, 96, 6)
    sel = idx.select(idx.index_scores(x, ql, fb.positions, fb, 0), fb.positions)
    want = reference_scores(idx, x, ql, fb.positions)
    late = range(60, 96)  # contexts of 61-96 tokens: past index_topk, where the layout decides the selection
    for t in late:
        best = sorted(torch.argsort(want[t, : t + 1], descending=True, stable=True)[:12].tolist())
        assert sel[t].tolist() == best, t
    wrong = LightningIndexerWithInterleavedRope(cfg, idx)
    other = wrong.select(wrong.index_scores(x, ql, fb.positions, fb, 0), fb.positions)
    assert any(other[t].tolist() != sel[t].tolist() for t in late), "the test must tell the layouts apart"


def LightningIndexerWithInterleavedRope(cfg, idx):
    """The same indexer (same weights, same cache) with the other RoPE layout."""
    from sparse_ref.algorithms.dsa import LightningIndexer

    other = LightningIndexer(dataclasses.replace(cfg, rope_interleaved=True), seed=0)
    other.load_state_dict(idx.state_dict())
    return other.attach_cache(idx.cache)
