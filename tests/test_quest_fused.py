"""The one-launch Quest scoring (sign split + page mapping + scores) == the unfused path; QuestAlgorithm on it.

Runs on CPU through Triton's interpreter (small sizes). ``quest_page_scores_from_queries`` must
equal ``quest_page_scores(*split_query_sign(...), pages=physical_pages)`` up to fp32 rounding of
the group sum, and exactly ``-inf`` for pages without bounds.
"""

import pytest
import torch

import sparse_ref
from sparse_ref import SparseConfig
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.algorithms.quest import quest_page_scores_reference, split_query_sign
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import quest as quest_kernels
from sparse_ref.kernels import tuning
from sparse_ref.kernels.quest import quest_page_scores_from_queries
from sparse_ref.workloads import make_planted_workload

DEVICE = sparse_ref.default_device()


def make_case(bs, max_pages, num_kv_heads, group, head_dim, P, q_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = bs * max_pages + 3
    a = torch.randn(num_pages, num_kv_heads, head_dim, generator=g)
    b = torch.randn(num_pages, num_kv_heads, head_dim, generator=g)
    page_min, page_max = torch.minimum(a, b), torch.maximum(a, b)
    page_valid = torch.rand(num_pages, generator=g) > 0.2
    rows = torch.randperm(bs + 2, generator=g)[:bs]
    r2t = torch.randint(-3, num_pages * P + 5, (bs + 2, max_pages * P - (P > 1)), generator=g, dtype=torch.int32)
    q = (torch.randn(bs, num_kv_heads * group, head_dim, generator=g) * 2).to(q_dtype)
    return [t.to(DEVICE) for t in (q, page_min, page_max, page_valid, r2t, rows)]


def unfused(q, page_min, page_max, page_valid, r2t, rows, P, max_pages, gqa_mode):
    num_pages, num_kv_heads, head_dim = page_min.shape
    q_pos, q_neg = split_query_sign(q, num_kv_heads, head_dim, gqa_mode)
    first = torch.clamp(torch.arange(max_pages, device=r2t.device) * P, max=r2t.shape[1] - 1)
    pages = (r2t[rows.long()[:, None], first[None, :]].long() // P).clamp(0, num_pages - 1)
    return quest_page_scores_reference(q_pos, q_neg, page_min, page_max, page_valid, pages), pages


@pytest.mark.parametrize("bs,max_pages,num_kv_heads,group,head_dim,P", [
    (1, 1, 1, 1, 8, 1), (3, 7, 3, 4, 12, 4), (2, 33, 2, 1, 16, 3), (1, 20, 1, 8, 8, 16), (4, 5, 2, 3, 8, 2),
])
@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_fused_equals_unfused(bs, max_pages, num_kv_heads, group, head_dim, P, gqa_mode):
    q, page_min, page_max, page_valid, r2t, rows = make_case(bs, max_pages, num_kv_heads, group, head_dim, P,
                                                             seed=bs + max_pages + group)
    want, pages = unfused(q, page_min, page_max, page_valid, r2t, rows, P, max_pages, gqa_mode)
    for queries in (q, q.reshape(bs, -1)):  # [bs, H_q, D] and [bs, H_q * D]
        got = quest_page_scores_from_queries(queries, page_min, page_max, page_valid, r2t, rows, P, max_pages,
                                             gqa_mode)
        invalid = ~page_valid[pages]
        assert got.shape == (bs, max_pages) and got.dtype == torch.float32
        assert bool(torch.isneginf(got[invalid]).all()) and bool(torch.isfinite(got[~invalid]).all())
        torch.testing.assert_close(got[~invalid], want[~invalid], rtol=1e-5, atol=1e-4)


def test_bf16_queries_and_bounds_and_blocks():
    q, page_min, page_max, page_valid, r2t, rows = make_case(2, 9, 2, 4, 16, 4, q_dtype=torch.bfloat16, seed=5)
    page_min, page_max = page_min.bfloat16(), page_max.bfloat16()
    want, pages = unfused(q, page_min, page_max, page_valid, r2t, rows, 4, 9, "mean")
    for knobs in ({}, dict(block_p=2, block_hd=8), dict(block_p=4, block_hd=64)):
        with tuning(quest_kernels.TUNING, **knobs):
            got = quest_page_scores_from_queries(q, page_min, page_max, page_valid, r2t, rows, 4, 9, "mean")
        ok = page_valid[pages]
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-4)
        assert bool(torch.isneginf(got[~ok]).all())


def test_checks():
    q, page_min, page_max, page_valid, r2t, rows = make_case(2, 4, 2, 2, 8, 2, seed=6)
    with pytest.raises(SparseRefError, match="queries"):
        quest_page_scores_from_queries(q[:, :3], page_min, page_max, page_valid, r2t, rows, 2, 4)
    with pytest.raises(SparseRefError, match="req_pool_indices"):
        quest_page_scores_from_queries(q, page_min, page_max, page_valid, r2t, rows + 10, 2, 4)
    with pytest.raises(SparseRefError, match="gqa_mode"):
        quest_page_scores_from_queries(q, page_min, page_max, page_valid, r2t, rows, 2, 4, "max")
    empty = quest_page_scores_from_queries(q[:0], page_min, page_max, page_valid, r2t, rows[:0], 2, 4)
    assert empty.shape == (0, 4)


@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_quest_retrieve_on_the_fused_kernel_equals_torch_scoring(gqa_mode):
    picks = {}
    for backend in ("torch", "triton"):
        wl = make_planted_workload([300, 77, 1, 160], page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                   device=DEVICE, seed=3)
        algo = QuestAlgorithm(SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1, gqa_mode=gqa_mode),
                              DEVICE, scoring_backend=backend)
        wl.attach(algo)
        fb = wl.forward_batch
        scores = algo.score_pages(wl.queries, 0, fb.req_pool_indices, fb)
        picks[backend] = (scores, *algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices,
                                                     torch.ones(4, dtype=torch.bool, device=DEVICE), forward_batch=fb))
    (s_t, sel_t, len_t), (s_k, sel_k, len_k) = picks["torch"], picks["triton"]
    finite = torch.isfinite(s_t)
    assert torch.equal(finite, torch.isfinite(s_k))
    torch.testing.assert_close(s_k[finite], s_t[finite], rtol=1e-5, atol=1e-4)
    assert torch.equal(sel_t, sel_k) and torch.equal(len_t, len_k)
