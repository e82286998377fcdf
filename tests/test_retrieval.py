"""The retrieval contract: batched ``retrieve_topk`` == ``retrieve_topk_loop``, isolation, the seed error.

A ``FixedScores`` algorithm returns whatever scores the test hands it, so hypothesis can aim at
the hard cases directly: ties, NaN, +-inf, -0.0, lengths 0 and 1, pages below, at and past a
page boundary, every budget mode, recent and sink counts, and masked-out rows.
"""

import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref import (
    SEED_TOPK_NEEDS_SEQ_LENS,
    PoolError,
    ReqToTokenPool,
    RetrievalError,
    ShapeError,
    SparseConfig,
    TokenToKVPool,
)
from sparse_ref.algorithms import QuestAlgorithm, SparseAlgorithm
from sparse_ref.backend import choose_backend
from sparse_ref.selection import ceil_div, select_pages, selection_width
from sparse_ref.workloads import make_planted_workload


class FixedScores(SparseAlgorithm):
    """Scores come from the test (``self.scores``), so selection can be probed on any input."""

    name = "fixed"

    def score_pages(self, queries, layer_id, req_pool_indices, forward_batch):
        return self.scores


def fixed_algorithm(scores, config, max_context_len, page_size, num_rows):
    algo = FixedScores(config)
    algo.initialize_representation_pool(0, 1, TokenToKVPool(2, page_size, 1, 1, 1),
                                        ReqToTokenPool(num_rows, max_context_len))
    algo.scores = scores
    return algo


def batch_stub(seq_lens, req_pool_indices=None):
    """The smallest object retrieve_topk accepts as forward_batch: seq_lens and req_pool_indices."""
    rows = torch.arange(seq_lens.shape[0]) if req_pool_indices is None else req_pool_indices
    return types.SimpleNamespace(seq_lens=seq_lens, req_pool_indices=rows)


SCORE_VALUES = [0.0, -0.0, 1.0, 1.0, 2.5, -3.0, float("nan"), float("-inf"), float("inf"), 1e-30]


@st.composite
def retrieval_case(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 16]))
    max_context_len = draw(st.integers(1, 400))
    bs = draw(st.integers(1, 9))
    special = [0, 1, page_size - 1, page_size, 2 * page_size, 3 * page_size + 1, max_context_len]
    lengths = st.one_of(st.sampled_from(special), st.integers(0, max_context_len),
                        st.integers(max_context_len // 2, max_context_len))
    seq_lens = [min(max(s, 0), max_context_len) for s in draw(st.lists(lengths, min_size=bs, max_size=bs))]
    if draw(st.booleans()):
        budget = {"keep_ratio": draw(st.sampled_from([0.01, 0.1, 0.25, 0.5, 0.9, 1.0]))}
    else:
        budget = {"page_budget": draw(st.integers(1, 12))}
    config = SparseConfig(**budget, num_recent_pages=draw(st.integers(1, 5)), num_sink_pages=draw(st.integers(0, 3)),
                          min_sparse_seq_len=draw(st.sampled_from([0, 0, 5, 40])))
    max_pages = ceil_div(max_context_len, page_size)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["tied", "randn", "mixed"]))
    pick = torch.tensor(SCORE_VALUES)[torch.randint(0, len(SCORE_VALUES), (bs, max_pages), generator=gen)]
    scores = torch.randn(bs, max_pages, generator=gen)
    if kind == "tied":
        scores = pick
    elif kind == "mixed":  # mostly distinct values, with NaN / +-inf / ties sprinkled in
        scores = torch.where(torch.rand(bs, max_pages, generator=gen) < 0.2, pick, scores)
    mask = torch.tensor(draw(st.lists(st.sampled_from([True, True, True, False]), min_size=bs, max_size=bs)))
    return page_size, max_context_len, torch.tensor(seq_lens, dtype=torch.int64), scores, mask, config


@given(retrieval_case())
def test_loop_equals_batched(case):
    page_size, max_context_len, seq_lens, scores, mask, config = case
    bs = seq_lens.shape[0]
    algo = fixed_algorithm(scores, config, max_context_len, page_size, bs)
    rows = torch.arange(bs)
    queries = torch.zeros(bs, 4)
    batched = algo.retrieve_topk(queries, 0, rows, mask, forward_batch=batch_stub(seq_lens))
    loop = algo.retrieve_topk_loop(queries, 0, rows, mask, forward_batch=batch_stub(seq_lens))
    assert batched[0].dtype == loop[0].dtype == torch.int32 and batched[1].dtype == loop[1].dtype == torch.int32
    assert torch.equal(batched[0], loop[0]), (batched[0], loop[0])
    assert torch.equal(batched[1], loop[1])
    assert batched[0].shape == (bs, selection_width(algo.max_pages, config))
    check_isolation(batched[0], batched[1], seq_lens, mask, page_size)


def check_isolation(selected, lengths, seq_lens, mask, page_size):
    """Every kept page is one of the row's own pages [0, ceil(seq_len / P)), ascending, -1 padded after."""
    for r in range(selected.shape[0]):
        n = ceil_div(int(seq_lens[r]), page_size)
        k = int(lengths[r])
        row = selected[r].tolist()
        assert all(p == -1 for p in row[k:])
        assert all(0 <= p < n for p in row[:k])
        assert row[:k] == sorted(set(row[:k]))
        if k:
            assert bool(mask[r]) and row[k - 1] == n - 1  # the last (current) page is always kept


def test_scores_never_pick_nan_or_neg_inf_and_ties_go_low():
    P, config = 1, SparseConfig(page_budget=2, num_recent_pages=1)
    nan, ninf = float("nan"), float("-inf")
    scores = torch.tensor([[nan, 5.0, 5.0, 5.0, ninf, 0.0], [ninf, nan, ninf, 1.0, nan, 9.0]])
    algo = fixed_algorithm(scores, config, 6, P, 2)
    seq = torch.tensor([6, 6])
    sel, lens = algo.retrieve_topk(torch.zeros(2, 1), 0, torch.arange(2), torch.ones(2, dtype=torch.bool),
                                   forward_batch=batch_stub(seq))
    # row 0: ties among pages 1,2,3 go to the lower ids 1 and 2; row 1: only page 3 is a candidate.
    assert sel.tolist() == [[1, 2, 5], [3, 5, -1]] and lens.tolist() == [3, 2]


def test_row_goes_sparse_on_current_seq_len_not_prompt():
    """The same request, dense at a short length, turns sparse once decoding makes it long enough."""
    P, config = 4, SparseConfig(page_budget=1, num_recent_pages=1, min_sparse_seq_len=10)
    algo = fixed_algorithm(torch.arange(8.0)[None], config, 32, P, 1)
    mask = torch.ones(1, dtype=torch.bool)
    kept = []
    for seq_len in (6, 9, 10, 13):
        _, lens = algo.retrieve_topk(torch.zeros(1, 1), 0, torch.zeros(1, dtype=torch.long), mask,
                                     forward_batch=batch_stub(torch.tensor([seq_len])))
        kept.append(int(lens[0]))
    assert kept == [0, 0, 2, 2]


def quest_workload_algo(config, seq_lens=(1, 15, 16, 17, 64, 97, 150), P=16, device="cpu"):
    wl = make_planted_workload(list(seq_lens), page_size=P, num_q_heads=4, num_kv_heads=2, head_dim=8, seed=3,
                               device=device)
    algo = QuestAlgorithm(config, device)
    wl.attach(algo)
    return wl, algo


@pytest.mark.parametrize("config", [SparseConfig(page_budget=2, num_recent_pages=1),
                                    SparseConfig(keep_ratio=0.3, num_recent_pages=2, num_sink_pages=1)])
def test_quest_loop_equals_batched_and_isolated(config):
    wl, algo = quest_workload_algo(config)
    fb = wl.forward_batch
    mask = torch.tensor([True, True, False, True, True, True, True])
    a = algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices, mask, forward_batch=fb)
    b = algo.retrieve_topk_loop(wl.queries.flatten(1), 0, fb.req_pool_indices, mask, forward_batch=fb)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert int(a[1].max()) > 0  # the long rows really went sparse
    check_isolation(a[0], a[1], fb.seq_lens, mask, wl.page_size)
    scores = algo.score_pages(wl.queries, 0, fb.req_pool_indices, fb)
    assert torch.equal(a[0], select_pages(scores, fb.seq_lens, mask, wl.page_size, config)[0])


# ------------------------------------------------------------------ the seed error and bad input
@pytest.mark.parametrize("kwargs, arrived", [
    ({}, "got kwargs [] and no forward_batch"),
    ({"top_k": 4}, "got kwargs ['top_k'] and no forward_batch"),
    ({"forward_batch": None}, "got forward_batch=None"),
    ({"forward_batch": object()}, "forward_batch of type object has no seq_lens"),
    ({"forward_batch": types.SimpleNamespace(seq_lens=None)}, "has seq_lens=None"),
])
@pytest.mark.parametrize("loop", [False, True])
def test_seed_error(kwargs, arrived, loop):
    algo = fixed_algorithm(torch.zeros(1, 4), SparseConfig(), 16, 4, 1)
    fn = algo.retrieve_topk_loop if loop else algo.retrieve_topk
    with pytest.raises(RetrievalError) as info:
        fn(torch.zeros(1, 4), 0, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), **kwargs)
    msg = str(info.value)
    assert msg.startswith(SEED_TOPK_NEEDS_SEQ_LENS)
    assert arrived in msg
    assert "retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, forward_batch=forward_batch)" in msg
    assert isinstance(info.value, ValueError)  # code written against SGLang's ValueError still catches it


def test_bad_inputs_raise_clear_errors():
    algo = fixed_algorithm(torch.zeros(2, 4), SparseConfig(), 16, 4, 2)
    q, rows, mask = torch.zeros(2, 4), torch.arange(2), torch.ones(2, dtype=torch.bool)
    fb = batch_stub(torch.tensor([3, 16]))
    with pytest.raises(PoolError, match=r"layer_id: expected an int in \[0, 1\) \(end_layer is exclusive\)"):
        algo.retrieve_topk(q, 1, rows, mask, forward_batch=fb)
    with pytest.raises(ShapeError, match="sparse_mask: expected dtype torch.bool"):
        algo.retrieve_topk(q, 0, rows, mask.long(), forward_batch=fb)
    with pytest.raises(ShapeError, match="queries: expected 2 rows"):
        algo.retrieve_topk(q[:1], 0, rows, mask, forward_batch=fb)
    with pytest.raises(ShapeError, match=r"seq_lens: expected values in \[0, 16\]"):
        algo.retrieve_topk(q, 0, rows, mask, forward_batch=batch_stub(torch.tensor([3, 17])))
    with pytest.raises(ShapeError, match=r"req_pool_indices: expected values in \[0, 1\]"):
        algo.retrieve_topk(q, 0, torch.tensor([0, 2]), mask, forward_batch=fb)
    for retrieve in (algo.retrieve_topk, algo.retrieve_topk_loop):  # the batch's rows, in the batch's order
        with pytest.raises(RetrievalError, match=r"req_pool_indices: expected forward_batch.req_pool_indices \[0, 1\]"):
            retrieve(q, 0, rows.flip(0), mask, forward_batch=fb)


def test_lifecycle_layer_range_and_uninitialized():
    algo = SparseAlgorithm()
    with pytest.raises(PoolError, match="not initialized"):
        algo.check_layer(0)
    kv, r2t = TokenToKVPool(2, 4, 3, 1, 1), ReqToTokenPool(1, 8)
    for start, end in ((0, 0), (2, 1), (-1, 2), (0, 4)):
        with pytest.raises(PoolError, match="end_layer is exclusive"):
            algo.initialize_representation_pool(start, end, kv, r2t)
    algo.initialize_representation_pool(1, 3, kv, r2t)
    algo.check_layer(1)
    algo.check_layer(2)
    for bad in (0, 3, True, 1.0):
        with pytest.raises(PoolError):
            algo.check_layer(bad)
    with pytest.raises(NotImplementedError, match="score_pages"):
        algo.retrieve_topk(torch.zeros(1, 1), 1, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool),
                           forward_batch=batch_stub(torch.tensor([4])))


def test_auto_backend_is_torch_on_cpu_tensors():
    """'auto' must not touch the Triton kernel for CPU tensors (tests for the Triton backend live elsewhere)."""
    scores = torch.randn(3, 10)
    algo = fixed_algorithm(scores, SparseConfig(page_budget=2), 40, 4, 3)
    assert algo.backend.name == "torch"  # "auto", resolved once for the CPU
    seq = torch.tensor([40, 13, 0])
    out = algo.retrieve_topk(torch.zeros(3, 1), 0, torch.arange(3), torch.ones(3, dtype=torch.bool),
                             forward_batch=batch_stub(seq))
    ref = select_pages(scores, seq, torch.ones(3, dtype=torch.bool), 4, algo.config)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_triton_backend_through_retrieve_topk_matches_torch(device):
    """The switch wires the fused kernel in with select_pages' contract (its own tests live in test_page_select*)."""
    pytest.importorskip("sparse_ref.kernels.page_select")
    config = SparseConfig(page_budget=3, num_sink_pages=1)
    wl, torch_algo = quest_workload_algo(config, seq_lens=(300, 17, 129, 64), device=device)
    torch_algo.backend = choose_backend("torch", device)
    triton_algo = QuestAlgorithm(config, device, backend="triton")
    wl.attach(triton_algo)
    fb = wl.forward_batch
    mask = torch.tensor([True, True, False, True], device=device)
    a = torch_algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices, mask, forward_batch=fb)
    b = triton_algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices, mask, forward_batch=fb)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and int(a[1][0]) > 0
