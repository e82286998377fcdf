"""Metrics against the dense oracle, and the planted workloads they are measured on."""

import torch

from sparse_ref import SparseConfig
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.attention import dense_decode_attention
from sparse_ref.metrics import attention_mass_kept, page_attention_mass, page_recall, relative_error
from sparse_ref.selection import topk_reference
from sparse_ref.workloads import make_planted_workload, make_quest_decode_setup


def dense_probs(wl):
    fb = wl.forward_batch
    return dense_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, wl.req_to_token, fb.req_pool_indices,
                                  fb.seq_lens, return_probs=True)


def test_page_mass_by_hand():
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.0], [0.0, 0.0, 0.5, 0.5, 0.0]]])  # bs=1, 2 heads, 5 tokens
    mass = page_attention_mass(probs, 2)
    torch.testing.assert_close(mass, torch.tensor([[0.15, 0.85, 0.0]]))
    sel, lens = torch.tensor([[1, -1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    torch.testing.assert_close(attention_mass_kept(sel, lens, mass), torch.tensor([0.85]))
    assert page_recall(sel, lens, mass, torch.tensor([5]), 2).tolist() == [1.0]
    sel0 = torch.tensor([[0, -1]], dtype=torch.int32)
    assert page_recall(sel0, lens, mass, torch.tensor([5]), 2).tolist() == [0.0]
    # a dense row (length 0) keeps everything
    assert attention_mass_kept(sel0, torch.tensor([0], dtype=torch.int32), mass).tolist() == [1.0]
    assert relative_error(probs, probs).tolist() == [0.0]
    torch.testing.assert_close(relative_error(2 * probs, probs), torch.tensor([1.0]))


def test_oracle_selection_has_recall_one_and_workloads_are_deterministic():
    a = make_planted_workload([50, 130], page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=7)
    b = make_planted_workload([50, 130], page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=7)
    assert torch.equal(a.k_buffer, b.k_buffer) and torch.equal(a.queries, b.queries)
    assert a.needle_pages == b.needle_pages and all(len(p) == 4 for p in a.needle_pages)
    assert not torch.equal(a.req_to_token[0, :16] // 8, torch.arange(16) // 8 + 1)  # pages interleave
    _, probs = dense_probs(a)
    mass = page_attention_mass(probs, 8)
    n = torch.tensor([7, 17])
    oracle = topk_reference(mass, 3, n, order="index")
    lens = torch.tensor([3, 3], dtype=torch.int32)
    assert page_recall(oracle, lens, mass, a.forward_batch.seq_lens, 8).tolist() == [1.0, 1.0]
    # the planted needles are among the heaviest pages
    heavy = topk_reference(mass, 6, n)
    for r, needles in enumerate(a.needle_pages):
        assert set(needles) <= set(heavy[r].tolist())


def test_quest_finds_planted_needles():
    wl = make_planted_workload([400, 333, 512], page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=32, seed=1)
    algo = QuestAlgorithm(SparseConfig(page_budget=6, num_recent_pages=1))
    wl.attach(algo)
    fb = wl.forward_batch
    sel, lens = algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices, torch.ones(3, dtype=torch.bool),
                                   forward_batch=fb)
    found = [len(set(n) & set(sel[r].tolist())) / len(n) for r, n in enumerate(wl.needle_pages)]
    assert sum(found) / 3 >= 0.75, found
    _, probs = dense_probs(wl)
    kept = attention_mass_kept(sel, lens, page_attention_mass(probs, 16))
    assert bool((kept > 0.4).all()), kept


def test_quest_decode_setup_recipe():
    s = make_quest_decode_setup(3, 300, 16, num_q_heads=4, num_kv_heads=2, head_dim=8)
    a, b = s.retrieve(), s.retrieve(loop=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[1].tolist() == [7, 7, 7]  # 19 pages: 4 recent + floor(15 * 0.25)
