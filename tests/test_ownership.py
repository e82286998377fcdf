"""Nothing frees, grows or half-admits a request under the engine: the third hardening pass, class by class.

* A live request's row and pages are taken *for* it: ``ReqToTokenPool.free`` and ``PageAllocator.free``
  refuse them (only ``KVCacheManager.release`` gives them back), so the next admit never shares them.
* A request grown outside the engine (``manager.grow``) would attend over tokens with no K/V (on a reused
  page, the previous owner's): ``step`` and ``forward`` refuse it before anything grows or is written.
* ``add_request`` is all or nothing: a prompt the workload cannot plan changes nothing, and a prefill that
  fails gives the row and pages back.
"""

from __future__ import annotations

import pytest
import torch

from sparse_ref import KVCacheManager
from sparse_ref.batch import decode_step
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.errors import BatchError, PoolError, SparseRefError
from sparse_ref.workloads import PlantedEngineWorkload

INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)


def engine(layers=("quest", "deepseek_dsa"), head_needles=1):
    wl = PlantedEngineWorkload(num_layers=len(layers), num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=head_needles, local_window=4, indexer_config=INDEXER, seed=5)
    e = DecodeEngine(wl, list(layers), SparseConfig(page_budget=2, min_sparse_seq_len=8), dsa_topk=8, page_size=4,
                     max_requests=3, max_context_len=64, num_pages=30)
    return e


def pools_state(e):
    m = e.manager
    return (m.req_to_token_pool.available_size(), m.allocator.available_pages(), m.generation,
            m.req_to_token_pool.req_to_token.clone(), dict(e.coordinator.prompt_lens), list(e.live),
            dict(e.written))


def assert_same_state(a, b):
    assert a[:3] == b[:3] and torch.equal(a[3], b[3]) and a[4:] == b[4:]


# ---------------------------------------------------------------- a live request's row and pages
def test_page_allocator_refuses_a_live_requests_pages():
    m = KVCacheManager.create(max_requests=2, max_context_len=32, num_pages=8, page_size=4)
    a = m.admit(9)
    free_before = m.allocator.available_pages()
    with pytest.raises(PoolError, match=f"belongs to request {a.rid}"):
        m.allocator.free(a.pages[:1])
    assert m.allocator.available_pages() == free_before
    b = m.admit(5)
    assert not set(a.pages) & set(b.pages), "the next admit never shares a live request's pages"
    m.release(a)
    assert m.allocator.available_pages() == free_before + 3 - 2


def test_req_to_token_pool_refuses_a_live_requests_row_and_release_still_works():
    m = KVCacheManager.create(max_requests=2, max_context_len=32, num_pages=8, page_size=4)
    a = m.admit(6)
    row = m.req_to_token_pool.req_to_token[a.req_pool_idx].clone()
    with pytest.raises(PoolError, match="which is live"):
        m.req_to_token_pool.free([a.req_pool_idx])
    assert torch.equal(m.req_to_token_pool.req_to_token[a.req_pool_idx], row)
    m.release(a)  # no bare AssertionError: the row was never freed under it
    assert m.req_to_token_pool.available_size() == 2


def test_unowned_allocations_free_as_before():
    m = KVCacheManager.create(max_requests=2, max_context_len=32, num_pages=8, page_size=4)
    pages = m.allocator.alloc(2)
    m.allocator.free(pages)
    with pytest.raises(PoolError, match="double free"):
        m.allocator.free(pages)


# ---------------------------------------------------------------- grown outside the engine
@pytest.mark.parametrize("how", ["step", "forward"])
def test_a_request_grown_outside_the_engine_is_refused_before_anything_grows(how):
    e = engine()
    for n in (13, 9):
        e.add_request(n)
    e.step()
    e.manager.grow(e.live[0], 1)  # outside the engine: this token's K/V is never written
    before = pools_state(e)
    k_before = e.manager.token_to_kv_pool.get_key_buffer(0).clone()
    with pytest.raises(BatchError, match="outside"):
        if how == "step":
            e.step()
        else:
            e.forward(decode_step(e.manager, e.live), [e.decode_inputs(layer) for layer in range(2)])
    if how == "step":
        assert_same_state(pools_state(e), before)
    assert torch.equal(e.manager.token_to_kv_pool.get_key_buffer(0), k_before)


def test_finishing_the_changed_request_lets_the_others_go_on():
    e = engine()
    a, b = e.add_request(13), e.add_request(9)
    e.manager.grow(a, 2)
    with pytest.raises(BatchError, match=f"request {a.rid}"):
        e.step()
    e.finish(a)
    result = e.step()
    assert result.rids == [b.rid] and e.written[b.rid] == b.seq_len == 10


# ---------------------------------------------------------------- add_request: all or nothing
def test_a_prompt_the_workload_cannot_plan_changes_nothing():
    e = engine(head_needles=3)
    before = pools_state(e)
    with pytest.raises(SparseRefError, match="prompt_len.*head needles"):
        e.add_request(2)
    assert_same_state(pools_state(e), before)
    assert e.add_request(3).seq_len == 3  # the smallest prompt it can plan


def test_a_failed_prefill_gives_the_row_and_pages_back(monkeypatch):
    e = engine()
    e.add_request(11)
    before = pools_state(e)
    quest = e.coordinator.algorithms[0]
    valid_before = quest.page_valid[0].clone()
    calls = []

    def prefill(plan, layer, with_hidden=False, _original=e.workload.prefill):
        calls.append(layer)
        if layer == 1:
            raise RuntimeError("the model failed on layer 1")
        return _original(plan, layer, with_hidden=with_hidden)

    monkeypatch.setattr(e.workload, "prefill", prefill)
    with pytest.raises(RuntimeError, match="layer 1"):
        e.add_request(17)
    assert calls == [0, 1]  # layer 0 was written (K/V and Quest bounds) before the failure
    assert_same_state(pools_state(e), (before[0], before[1], pools_state(e)[2], *before[3:]))
    assert torch.equal(quest.page_valid[0], valid_before), "the freed pages' bounds are dropped"
    monkeypatch.undo()
    assert e.add_request(17).seq_len == 17 and len(e.step().rids) == 2
