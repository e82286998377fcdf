"""Paged decode attention references: sparse over all pages == dense; sparse == a per-request loop."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref import ShapeError, SparseConfig
from sparse_ref.adaptor import to_attention_metadata
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.attention import dense_decode_attention, sparse_decode_attention
from sparse_ref.workloads import make_planted_workload


@given(st.lists(st.integers(1, 90), min_size=1, max_size=5), st.sampled_from([1, 3, 16]),
       st.sampled_from([(1, 1), (4, 2), (6, 3)]), st.integers(0, 1000))
def test_sparse_over_all_pages_equals_dense(seq_lens, P, heads, seed):
    h_q, h_kv = heads
    wl = make_planted_workload(seq_lens, page_size=P, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=6, seed=seed)
    fb = wl.forward_batch
    bs = len(seq_lens)
    nothing = torch.full((bs, 1), -1, dtype=torch.int32)
    table, kv, _ = to_attention_metadata(nothing, torch.zeros(bs, dtype=torch.int32),
                                         torch.zeros(bs, dtype=torch.bool), fb, wl.req_to_token, P)
    assert kv.tolist() == seq_lens
    dense, p_dense = dense_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, wl.req_to_token,
                                            fb.req_pool_indices, fb.seq_lens, return_probs=True)
    sparse, p_sparse = sparse_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, table, kv, P, return_probs=True)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    longest = max(seq_lens)
    torch.testing.assert_close(p_sparse[..., :longest], p_dense, rtol=1e-5, atol=1e-7)
    assert not p_sparse[..., longest:].any()


def naive_attention(q, keys, values):
    """Softmax attention of one request's q [H_q, D] over keys/values [T, H_kv, D], head by head."""
    h_q, d = q.shape
    group = h_q // keys.shape[1]
    out = torch.empty(h_q, d)
    for h in range(h_q):
        logits = keys[:, h // group] @ q[h] / math.sqrt(d)
        out[h] = torch.softmax(logits, 0) @ values[:, h // group]
    return out


def test_sparse_attention_reads_exactly_the_selected_tokens():
    P = 4
    wl = make_planted_workload([37, 9, 64], page_size=P, num_q_heads=4, num_kv_heads=2, head_dim=8, seed=5)
    algo = QuestAlgorithm(SparseConfig(page_budget=2, num_recent_pages=1, num_sink_pages=1))
    wl.attach(algo)
    fb = wl.forward_batch
    mask = torch.ones(3, dtype=torch.bool)
    sel, lens = algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices, mask, forward_batch=fb)
    assert lens.tolist()[0] == 4 and lens.tolist()[1] == 0
    table, kv, _ = to_attention_metadata(sel, lens, mask, fb, wl.req_to_token, P)
    out = sparse_decode_attention(wl.queries, wl.k_buffer, wl.v_buffer, table, kv, P)
    for i, req in enumerate(wl.requests):
        seq = req.seq_len
        pages = sel[i, : lens[i]].tolist() if lens[i] else list(range(-(-seq // P)))
        tokens = [t for p in pages for t in range(p * P, min((p + 1) * P, seq))]
        slots = wl.req_to_token[req.req_pool_idx, tokens].long()
        ref = naive_attention(wl.queries[i], wl.k_buffer[slots], wl.v_buffer[slots])
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-6)


def test_attention_input_errors():
    wl = make_planted_workload([5], page_size=4, num_q_heads=2, num_kv_heads=1, head_dim=4)
    q, k, v = wl.queries, wl.k_buffer, wl.v_buffer
    with pytest.raises(ShapeError, match="q: expected a 3-D tensor"):
        sparse_decode_attention(q[0], k, v, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]), 4)
    with pytest.raises(ShapeError, match="not a multiple of the 2 KV heads"):
        sparse_decode_attention(q[:, :1].expand(1, 3, 4), k.expand(-1, 2, -1), v.expand(-1, 2, -1),
                                torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]), 4)
    with pytest.raises(ShapeError, match="kv_lens: expected values in"):
        sparse_decode_attention(q, k, v, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([9]), 4)
    with pytest.raises(ShapeError, match="page_table: expected values in"):
        sparse_decode_attention(q, k, v, torch.full((1, 2), 99, dtype=torch.int32), torch.tensor([5]), 4)
    with pytest.raises(ShapeError, match="seq_lens: expected values in"):
        dense_decode_attention(q, k, v, wl.req_to_token, torch.tensor([0]), torch.tensor([6]))
