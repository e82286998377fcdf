"""Regression tests for silent wrong answers: each case used to return a plausible but wrong result.

One test (or more) per finding: req_pool_indices out of step with the batch, stale Quest bounds
without an opt-in, lengths past a request's tokens, NaN turned into 0, negative ids that wrap, a
mutable config, a release that stopped halfway.
"""

import dataclasses

import pytest
import torch

from sparse_ref import (
    BatchError,
    ConfigError,
    KVCacheManager,
    PoolError,
    RetrievalError,
    ShapeError,
    SparseConfig,
    SparseRefError,
    TokenToKVPool,
    build_decode_batch,
    build_extend_batch,
    decode_step,
)
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.attention import dense_decode_attention, sparse_decode_attention
from sparse_ref.selection import select_pages

P = 4


def quest_setup(lengths, num_pages=40, config=None, seed=0):
    """Quest attached the plain SGLang way (4 arguments, no allocator passed), bounds built after a prefill."""
    m = KVCacheManager.create(max_requests=4, max_context_len=64, num_pages=num_pages, page_size=P, head_dim=4)
    reqs = [m.admit(n) for n in lengths]
    gen = torch.Generator().manual_seed(seed)
    pool = m.token_to_kv_pool
    for r in reqs:
        slots = m.req_to_token_pool.req_to_token[r.req_pool_idx, : r.seq_len].long()
        k = torch.randn(slots.shape[0], 1, 4, generator=gen)
        pool.set_kv(0, slots, k, k)
    algo = QuestAlgorithm(config or SparseConfig(page_budget=1, num_recent_pages=1))
    algo.initialize_representation_pool(0, 1, pool, m.req_to_token_pool)
    algo.construct_representations(0, build_extend_batch(m, reqs), pool.get_key_buffer(0))
    return m, reqs, algo


# ---------------------------------------------------------------- item 1: rows out of step with the batch
@pytest.mark.parametrize("loop", [False, True])
def test_quest_refuses_req_pool_indices_in_another_order(loop):
    m, reqs, algo = quest_setup([30, 9])
    fb = build_decode_batch(m, reqs)
    retrieve = algo.retrieve_topk_loop if loop else algo.retrieve_topk
    q, mask = torch.randn(2, 1, 4), torch.ones(2, dtype=torch.bool)
    sel, lens = retrieve(q, 0, fb.req_pool_indices, mask, forward_batch=fb)
    assert all(0 <= p < -(-r.seq_len // P) for r, row, k in zip(reqs, sel, lens, strict=True) for p in row[:k])
    with pytest.raises(RetrievalError, match="req_pool_indices: expected forward_batch.req_pool_indices"):
        retrieve(q, 0, fb.req_pool_indices.flip(0), mask, forward_batch=fb)


# ---------------------------------------------------------------- item 2: stale bounds need no opt-in
def test_quest_forgets_freed_pages_without_opt_in():
    m, (a,), algo = quest_setup([32])
    pages = list(a.pages)
    assert algo.page_valid[0][pages].all()
    m.release(a)  # the manager frees through the pool's allocator, which Quest subscribed to
    assert not algo.page_valid[0][pages].any()


def test_quest_reused_page_never_scores_with_the_previous_owner():
    """Second, independent check through the public API: a new owner's unbuilt pages score -inf."""
    m, (a,), algo = quest_setup([32])
    m.release(a)
    b = m.admit(32)  # takes the same physical pages back
    assert set(b.pages) & set(range(1, 9))
    fb = build_decode_batch(m, [b])
    scores = algo.score_pages(torch.ones(1, 1, 4), 0, fb.req_pool_indices, fb)
    assert torch.isneginf(scores[0, :8]).all(), "no bounds were built for b: nothing may score"


def test_quest_refuses_a_pool_without_allocator():
    m = KVCacheManager.create(max_requests=1, max_context_len=8, num_pages=4, page_size=P)

    class BarePool:  # a duck-typed pool that cannot report frees
        num_pages, page_size, num_layers, num_kv_heads, head_dim = 4, P, 1, 1, 8

    with pytest.raises(PoolError, match="token_to_kv_pool.allocator: expected a PageAllocator"):
        QuestAlgorithm().initialize_representation_pool(0, 1, BarePool(), m.req_to_token_pool)


# ---------------------------------------------------------------- item 4: lengths past the tokens
def test_construct_refuses_seq_len_past_the_tokens():
    m, (a,), algo = quest_setup([8])
    fb = build_extend_batch(m, [a])
    too_long = dataclasses.replace(fb, seq_lens=fb.seq_lens + 8, extend_seq_lens=fb.extend_seq_lens + 8,
                                   positions=torch.arange(16), out_cache_loc=torch.arange(16))
    algo.page_valid[0][0] = False
    with pytest.raises(BatchError, match="forward_batch.seq_lens: expected lengths within each request's tokens"):
        algo.construct_representations(0, too_long, m.token_to_kv_pool.get_key_buffer(0))
    assert not algo.page_valid[0][0], "padding page 0 never becomes valid"


def test_update_refuses_seq_len_past_the_tokens():
    m, (a,), algo = quest_setup([7])
    fb = decode_step(m, [a])  # 8 tokens: the decode completes page 1
    algo.update_representations(0, fb, m.token_to_kv_pool.get_key_buffer(0))
    bad = dataclasses.replace(fb, seq_lens=fb.seq_lens + 4, positions=fb.positions + 4)
    with pytest.raises(BatchError, match="forward_batch.seq_lens: expected lengths within"):
        algo.update_representations(0, bad, m.token_to_kv_pool.get_key_buffer(0))
    assert not algo.page_valid[0][0]


def test_quest_scoring_refuses_a_live_page_mapped_to_padding():
    m, (a,), algo = quest_setup([9])
    fb = build_decode_batch(m, [a])
    m.req_to_token_pool.req_to_token[a.req_pool_idx, 4] = 2  # logical page 1 -> padding page 0
    with pytest.raises(ShapeError, match="maps logical page 1 to physical page 0"):
        algo.score_pages(torch.zeros(1, 1, 4), 0, fb.req_pool_indices, fb)


def test_dense_attention_refuses_seq_len_past_the_tokens():
    m, (a,), _ = quest_setup([6])
    pool, r2t = m.token_to_kv_pool, m.req_to_token_pool.req_to_token
    rows = torch.tensor([a.req_pool_idx])
    q = torch.randn(1, 1, 4)
    dense_decode_attention(q, pool.k_buffer[0], pool.v_buffer[0], r2t, rows, torch.tensor([6]))
    with pytest.raises(ShapeError, match="seq_lens: expected lengths within each request's tokens"):
        dense_decode_attention(q, pool.k_buffer[0], pool.v_buffer[0], r2t, rows, torch.tensor([7]))


# ---------------------------------------------------------------- item 5: NaN stays NaN, empty rows are 0
def attention_inputs():
    m, (a, b), _ = quest_setup([6, 5])
    pool, r2t = m.token_to_kv_pool, m.req_to_token_pool.req_to_token
    rows = torch.tensor([a.req_pool_idx, b.req_pool_idx])
    return m, pool, r2t, rows, (a, b)


def test_dense_attention_nan_query_is_not_zero_and_empty_row_is():
    m, pool, r2t, rows, _ = attention_inputs()
    q = torch.randn(2, 1, 4)
    q[0, 0, 1] = float("nan")
    out = dense_decode_attention(q, pool.k_buffer[0], pool.v_buffer[0], r2t, rows, torch.tensor([6, 0]))
    assert torch.isnan(out[0]).all(), "a NaN query must not become an output of exactly 0"
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a row with nothing to read attends to nothing"


def test_dense_attention_inf_key_is_not_zero():
    m, pool, r2t, rows, (a, _) = attention_inputs()
    k = pool.k_buffer[0].clone()
    k[int(r2t[a.req_pool_idx, 2])] = float("inf")
    out = dense_decode_attention(torch.ones(2, 1, 4), k, pool.v_buffer[0], r2t, rows, torch.tensor([6, 5]))
    assert not torch.equal(out[0], torch.zeros_like(out[0]))


def test_sparse_attention_empty_row_is_zero_and_nan_stays():
    m, pool, r2t, rows, (a, b) = attention_inputs()
    table = torch.tensor([[a.pages[0], a.pages[1]], [b.pages[0], b.pages[1]]], dtype=torch.int32)
    q = torch.randn(2, 1, 4)
    q[0, 0, 0] = float("nan")
    out = sparse_decode_attention(q, pool.k_buffer[0], pool.v_buffer[0], table, torch.tensor([6, 0]), P)
    assert torch.isnan(out[0]).all() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_dense_attention_refuses_negative_rows():
    m, pool, r2t, rows, _ = attention_inputs()
    with pytest.raises(ShapeError, match="req_pool_indices: expected values in"):
        dense_decode_attention(torch.randn(2, 1, 4), pool.k_buffer[0], pool.v_buffer[0], r2t, torch.tensor([-1, 0]),
                               torch.tensor([6, 5]))


# ---------------------------------------------------------------- item 6: the config cannot go invalid
def test_mutated_config_cannot_reach_selection():
    cfg = SparseConfig(page_budget=1, num_recent_pages=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_budget = 50
    with pytest.raises(ConfigError, match="SparseConfig.num_recent_pages"):
        dataclasses.replace(cfg, num_recent_pages=0)
    sel, lens = select_pages(torch.randn(1, 8), torch.tensor([32]), torch.tensor([True]), P, cfg)
    assert int(lens.max()) <= sel.shape[1]


# ---------------------------------------------------------------- item 7: negative ids do not wrap
def test_invalidate_pages_refuses_negative_ids():
    m, (a,), algo = quest_setup([32])
    last = algo.num_pages - 1
    algo.page_valid[0][last] = True
    for bad in ([-1], torch.tensor([-1]), [last + 1]):
        with pytest.raises(PoolError, match=r"invalidate_pages\(pages\): expected values in"):
            algo.invalidate_pages(bad)
    assert algo.page_valid[0][last], "the last page was not touched"
    with pytest.raises(PoolError, match="expected an int"):
        algo.invalidate_pages([1.5])


# ---------------------------------------------------------------- item 8: release is all or nothing
class Flaky:
    """A free listener that raises on its first call, then works."""

    def __init__(self):
        self.calls = 0

    def __call__(self, pages):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("listener down")


def test_release_is_all_or_nothing_when_a_listener_raises():
    m, (a,), algo = quest_setup([12])
    flaky = Flaky()
    m.allocator.add_free_listener(flaky)
    free_before, pages, row = m.allocator.available_pages(), list(a.pages), a.req_pool_idx
    with pytest.raises(PoolError, match="listener down. No page was freed"):
        m.release(a)
    assert not a.released and a.pages == pages and m.requests[a.rid] is a
    assert m.allocator.available_pages() == free_before and m.req_to_token_pool._is_free[row] is False
    m.release(a)  # the retry works: no "double free"
    assert a.released and m.allocator.available_pages() == free_before + len(pages) and flaky.calls == 2
    assert not algo.page_valid[0][pages].any()


def test_page_allocator_free_calls_every_listener_before_freeing():
    """Second, independent check at the allocator level: the listener sees pages that are still allocated."""
    pool = TokenToKVPool(6, 2, 1, 1, 2)
    alloc = pool.allocator
    pages = alloc.alloc(3)
    seen = []
    alloc.add_free_listener(lambda p: seen.append((p.tolist(), alloc.available_pages())))
    alloc.free(pages[:2])
    assert seen == [(pages[:2], 2)] and alloc.available_pages() == 4


def test_decode_step_all_or_nothing_second_check():
    """decode_step with one request that does not fit grows none of them (independent of test_batch)."""
    m = KVCacheManager.create(max_requests=2, max_context_len=8, num_pages=4, page_size=2)
    a, b = m.admit(2), m.admit(4)  # 1 + 2 pages of 3 usable: none left
    before = (a.seq_len, b.seq_len, list(a.pages), list(b.pages))
    with pytest.raises(SparseRefError):
        decode_step(m, [a, b])
    assert (a.seq_len, b.seq_len, list(a.pages), list(b.pages)) == before


def test_seed_topk_message_verbatim_second_check():
    """The seed message, checked from the raised error of a real QuestAlgorithm (independent of test_retrieval)."""
    m, reqs, algo = quest_setup([8])
    with pytest.raises(RetrievalError) as info:
        algo.retrieve_topk(torch.zeros(1, 1, 4), 0, torch.tensor([0]), torch.ones(1, dtype=torch.bool))
    assert str(info.value).split(":")[0] == "forward_batch with seq_lens is required for TopK retrieval"


def test_dsa_from_pools_never_scores_a_previous_owners_keys():
    """DSA through its plain constructors: a reused page's old keys never pass for the new owner's history."""
    from sparse_ref.algorithms.dsa import DSAAlgorithm, LightningIndexer
    from sparse_ref.config import IndexerConfig
    from sparse_ref.memory import IndexerKeyCache

    cfg = IndexerConfig(hidden_size=16, q_lora_rank=8, n_heads=2, head_dim=16, rope_dim=4, index_topk=3)
    m = KVCacheManager.create(max_requests=2, max_context_len=16, num_pages=8, page_size=P)
    pool = m.token_to_kv_pool
    indexer = LightningIndexer(cfg, seed=1).attach_cache(IndexerKeyCache.from_pools(pool, m.req_to_token_pool, cfg))
    algo = DSAAlgorithm()
    algo.initialize_representation_pool(0, 1, pool, m.req_to_token_pool)
    gen = torch.Generator().manual_seed(0)

    def run(fb):
        T = fb.positions.shape[0]
        return algo.retrieve_topk(None, 0, fb.req_pool_indices, torch.ones(fb.batch_size, dtype=torch.bool),
                                  indexer=indexer, forward_batch=fb, x=torch.randn(T, 16, generator=gen),
                                  q_lora=torch.randn(T, 8, generator=gen), positions=fb.positions)

    a = m.admit(8)
    run(build_extend_batch(m, [a]))  # a's keys are written
    pages = list(a.pages)
    m.release(a)
    b = m.admit(8)  # the prompt of b skips the indexer
    assert b.pages == pages[::-1] or set(b.pages) == set(pages)
    fb = decode_step(m, [b])
    with pytest.raises(BatchError, match="holds no key"):
        run(fb)
