"""DSAAlgorithm: the second seed error for every missing-kwarg combination, the retrieval contract,
and the token selection through the adaptor (page size 1) into sparse attention."""

import itertools
import re

import pytest
import torch

from sparse_ref import SEED_DSA_REQUIRED, KVCacheManager, build_extend_batch, decode_step
from sparse_ref.adaptor import lengths_from_selection, to_attention_metadata
from sparse_ref.algorithms import create_sparse_algorithm
from sparse_ref.algorithms.dsa import DSA_REQUIRED, DSAAlgorithm, LightningIndexer
from sparse_ref.attention import dense_decode_attention, sparse_decode_attention
from sparse_ref.config import IndexerConfig
from sparse_ref.errors import BatchError, PoolError, RetrievalError, ShapeError
from sparse_ref.memory import IndexerKeyCache

CFG = IndexerConfig(hidden_size=40, q_lora_rank=20, n_heads=4, head_dim=16, rope_dim=8, index_topk=6)
H_KV, D = 2, 8


def setup(lengths=(10, 5), cfg=CFG, page_size=4, seed=0):
    mgr = KVCacheManager.create(max_requests=4, max_context_len=48, num_pages=40, page_size=page_size,
                                num_layers=2, num_kv_heads=H_KV, head_dim=D)
    indexer = LightningIndexer(cfg, seed=seed).attach_cache(
        IndexerKeyCache.for_manager(mgr, cfg))
    reqs = [mgr.admit(n) for n in lengths]
    algo = create_sparse_algorithm("deepseek_dsa")
    algo.initialize_representation_pool(0, 2, mgr.token_to_kv_pool, mgr.req_to_token_pool)
    return mgr, indexer, reqs, algo


def token_inputs(cfg, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.hidden_size, generator=gen), torch.randn(n, cfg.q_lora_rank, generator=gen)


def test_registry_builds_dsa():
    algo = create_sparse_algorithm("deepseek_dsa")
    assert type(algo) is DSAAlgorithm and algo.name == "deepseek_dsa"


ALL_SUBSETS = [s for r in range(1, 6) for s in itertools.combinations(DSA_REQUIRED, r)]


def test_there_are_31_subsets():
    assert len(ALL_SUBSETS) == 31 and DSA_REQUIRED == ("indexer", "forward_batch", "x", "q_lora", "positions")


@pytest.mark.parametrize("missing", ALL_SUBSETS, ids=lambda s: "-".join(s))
@pytest.mark.parametrize("how", ["absent", "none"])
def test_every_missing_combination_names_exactly_the_missing(missing, how):
    mgr, indexer, reqs, algo = setup()
    fb = build_extend_batch(mgr, reqs)
    x, ql = token_inputs(CFG, 15, 0)
    full = dict(indexer=indexer, forward_batch=fb, x=x, q_lora=ql, positions=fb.positions)
    kwargs = {k: v for k, v in full.items() if k not in missing}
    if how == "none":
        kwargs.update({k: None for k in missing})
    with pytest.raises(RetrievalError) as info:
        algo.retrieve_topk(None, 0, fb.req_pool_indices, torch.ones(2, dtype=torch.bool), **kwargs)
    msg = str(info.value)
    assert msg.startswith(SEED_DSA_REQUIRED)
    named = re.search(r"Missing: (.*?) \(not passed, or None\)", msg).group(1).split(", ")
    assert named == list(missing)  # exactly the missing ones, in the canonical order
    assert "Fix: algo.retrieve_topk(queries, layer_id, req_pool_indices, sparse_mask, indexer=indexer, " in msg
    assert not indexer.cache.written[0].any()  # raised before the indexer ran


def test_retrieve_returns_the_indexer_selection_and_none():
    mgr, indexer, reqs, algo = setup()
    fb = build_extend_batch(mgr, reqs)
    x, ql = token_inputs(CFG, 15, 1)
    sel, extra = algo.retrieve_topk(None, 1, fb.req_pool_indices, torch.ones(2, dtype=torch.bool), indexer=indexer,
                                    forward_batch=fb, x=x, q_lora=ql, positions=fb.positions)
    assert extra is None
    assert torch.equal(sel, indexer(x, ql, fb.positions, fb, 1))
    fb = decode_step(mgr, reqs)
    x, ql = token_inputs(CFG, 2, 2)
    sel, extra = algo.retrieve_topk(torch.randn(2, 8), 1, fb.req_pool_indices, torch.ones(2, dtype=torch.bool),
                                    attn_metadata=object(), indexer=indexer, forward_batch=fb, x=x, q_lora=ql,
                                    positions=fb.positions)
    assert extra is None and sel.shape == (2, CFG.index_topk) and sel.dtype == torch.int32
    assert torch.equal(sel, indexer(x, ql, fb.positions, fb, 1))
    loop, extra = algo.retrieve_topk_loop(None, 1, fb.req_pool_indices, torch.ones(2, dtype=torch.bool),
                                          indexer=indexer, forward_batch=fb, x=x, q_lora=ql, positions=fb.positions)
    assert extra is None and torch.equal(loop, sel)


def test_sparse_mask_false_rows_stay_dense():
    mgr, indexer, reqs, algo = setup((10, 5, 8))
    fb = build_extend_batch(mgr, reqs)
    x, ql = token_inputs(CFG, 23, 3)
    mask = torch.tensor([True, False, True])
    sel, _ = algo.retrieve_topk(None, 0, fb.req_pool_indices, mask, indexer=indexer, forward_batch=fb, x=x,
                                q_lora=ql, positions=fb.positions)
    assert torch.all(sel[10:15] == -1)  # request 1's five tokens: length 0, attend densely
    assert torch.all(sel[:10, 0] == 0) and torch.all(sel[15:, 0] >= 0)


def test_retrieve_input_errors():
    mgr, indexer, reqs, algo = setup()
    fb = build_extend_batch(mgr, reqs)
    x, ql = token_inputs(CFG, 15, 0)
    ok = dict(indexer=indexer, forward_batch=fb, x=x, q_lora=ql, positions=fb.positions)
    mask = torch.ones(2, dtype=torch.bool)
    with pytest.raises(RetrievalError, match="indexer: expected the model's LightningIndexer"):
        algo.retrieve_topk(None, 0, fb.req_pool_indices, mask, **{**ok, "indexer": "indexer"})
    with pytest.raises(RetrievalError, match="forward_batch: expected a sparse_ref.ForwardBatch"):
        algo.retrieve_topk(None, 0, fb.req_pool_indices, mask, **{**ok, "forward_batch": object()})
    with pytest.raises(BatchError, match="req_pool_indices: differ"):
        algo.retrieve_topk(None, 0, fb.req_pool_indices.flip(0), mask, **ok)
    with pytest.raises(ShapeError, match=r"sparse_mask: expected shape \[2\]"):
        algo.retrieve_topk(None, 0, fb.req_pool_indices, torch.ones(3, dtype=torch.bool), **ok)
    with pytest.raises(ShapeError, match="sparse_mask: expected dtype torch.bool"):
        algo.retrieve_topk(None, 0, fb.req_pool_indices, torch.ones(2), **ok)
    with pytest.raises(PoolError, match="layer_id"):
        algo.retrieve_topk(None, 2, fb.req_pool_indices, mask, **ok)  # the algorithm serves layers [0, 2)


def masked_attention(q, mgr, reqs, fb, keep):
    """Reference: softmax over the logical positions in ``keep[i]`` only, read through req_to_token."""
    out = []
    k_buf, v_buf = mgr.token_to_kv_pool.get_key_buffer(0), mgr.token_to_kv_pool.get_value_buffer(0)
    for i, r in enumerate(reqs):
        slots = mgr.req_to_token_pool.req_to_token[r.req_pool_idx, keep[i]].long()
        k = k_buf[slots].repeat_interleave(q.shape[1] // H_KV, dim=1)  # [n, H_q, D]
        v = v_buf[slots].repeat_interleave(q.shape[1] // H_KV, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k) / D**0.5, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def decode_through_attention(mgr, indexer, reqs, algo, mask, steps, gen):
    """Prefill, then ``steps`` decode steps of retrieve -> adaptor (page size 1) -> sparse attention."""
    pool = mgr.token_to_kv_pool
    k_buf, v_buf = pool.get_key_buffer(0), pool.get_value_buffer(0)
    req_to_token = mgr.req_to_token_pool.req_to_token
    fb = build_extend_batch(mgr, reqs)
    n = fb.positions.shape[0]
    pool.set_kv(0, fb.out_cache_loc, torch.randn(n, H_KV, D, generator=gen), torch.randn(n, H_KV, D, generator=gen))
    x, ql = torch.randn(n, CFG.hidden_size, generator=gen), torch.randn(n, CFG.q_lora_rank, generator=gen)
    indexer(x, ql, fb.positions, fb, 0)  # prefill writes every prompt token's indexer key
    results = []
    for _ in range(steps):
        fb = decode_step(mgr, reqs)
        bs = len(reqs)
        pool.set_kv(0, fb.out_cache_loc, torch.randn(bs, H_KV, D, generator=gen),
                    torch.randn(bs, H_KV, D, generator=gen))
        x, ql = torch.randn(bs, CFG.hidden_size, generator=gen), torch.randn(bs, CFG.q_lora_rank, generator=gen)
        q = torch.randn(bs, 4, D, generator=gen)
        sel, _ = algo.retrieve_topk(q, 0, fb.req_pool_indices, mask, indexer=indexer, forward_batch=fb, x=x,
                                    q_lora=ql, positions=fb.positions)
        lengths = lengths_from_selection(sel)
        page_table, kv_lens, cu = to_attention_metadata(sel, lengths, mask, fb, req_to_token, 1)
        out = sparse_decode_attention(q, k_buf, v_buf, page_table, kv_lens, 1)
        results.append((fb, q, sel, lengths, kv_lens, cu, out))
    return results


@pytest.mark.parametrize("page_size", [1, 4])
def test_end_to_end_decode_through_adaptor_and_sparse_attention(page_size):
    mgr, indexer, reqs, algo = setup((13, 4, 9), page_size=page_size)
    mask = torch.tensor([True, True, False])
    for fb, q, sel, lengths, kv_lens, cu, out in decode_through_attention(mgr, indexer, reqs, algo, mask, 3,
                                                                         torch.Generator().manual_seed(9)):
        seq = fb.seq_lens
        assert torch.equal(lengths[:2], torch.minimum(seq[:2], torch.tensor(CFG.index_topk)).int())
        assert int(lengths[2]) == 0 and torch.equal(kv_lens, torch.cat([lengths[:2], seq[2:].int()]))
        assert torch.equal(cu[1:], torch.cumsum(kv_lens, 0).int())
        keep = [sel[0][sel[0] >= 0].long(), sel[1][sel[1] >= 0].long(), torch.arange(int(seq[2]))]
        assert all(int(k.max()) < int(s) for k, s in zip(keep, seq, strict=True))
        torch.testing.assert_close(out, masked_attention(q, mgr, reqs, fb, keep), rtol=1e-5, atol=1e-5)


def test_topk_covering_the_history_equals_dense_attention():
    wide = IndexerConfig(hidden_size=40, q_lora_rank=20, n_heads=4, head_dim=16, rope_dim=8, index_topk=32)
    mgr, indexer, reqs, algo = setup((13, 4, 9), cfg=wide, page_size=4)
    mask = torch.ones(3, dtype=torch.bool)
    pool = mgr.token_to_kv_pool
    for fb, q, _sel, lengths, kv_lens, _cu, out in decode_through_attention(mgr, indexer, reqs, algo, mask, 2,
                                                                           torch.Generator().manual_seed(3)):
        assert torch.equal(lengths.long(), fb.seq_lens) and torch.equal(kv_lens.long(), fb.seq_lens)  # all kept
        dense = dense_decode_attention(q, pool.get_key_buffer(0), pool.get_value_buffer(0),
                                       mgr.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens)
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_lifecycle_hooks_are_no_ops():
    """DSA keeps its keys in the indexer's cache: the hooks change nothing, but still check the layer."""
    mgr, indexer, reqs, algo = setup()
    fb = build_extend_batch(mgr, reqs)
    pool = mgr.token_to_kv_pool
    pool.set_kv(0, fb.out_cache_loc, torch.randn(15, H_KV, D), torch.randn(15, H_KV, D))
    before = [t.clone() for t in (pool.get_key_buffer(0), pool.get_key_buffer(1), pool.get_value_buffer(0))]
    assert algo.construct_representations(0, fb, pool.get_key_buffer(0)) is None
    assert algo.update_representations(1, fb, pool.get_key_buffer(1)) is None
    after = (pool.get_key_buffer(0), pool.get_key_buffer(1), pool.get_value_buffer(0))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the KV cache is untouched
    with pytest.raises(PoolError, match="layer_id"):
        algo.construct_representations(2, fb, pool.get_key_buffer(0))  # still checks its layers


def test_decode_with_req_pool_indices_of_another_batch_is_refused():
    """A second, independent check: the same rows in another order, and a batch of other requests."""
    mgr, indexer, reqs, algo = setup((6, 9, 3))
    fb = build_extend_batch(mgr, reqs)
    indexer(*token_inputs(CFG, 18, 4), fb.positions, fb, 0)
    fb = decode_step(mgr, reqs)
    x, ql = token_inputs(CFG, 3, 5)
    kw = dict(indexer=indexer, forward_batch=fb, x=x, q_lora=ql, positions=fb.positions)
    mask = torch.ones(3, dtype=torch.bool)
    for wrong in (fb.req_pool_indices[[1, 0, 2]], fb.req_pool_indices + 1):
        with pytest.raises(BatchError, match="req_pool_indices: differ from forward_batch.req_pool_indices"):
            algo.retrieve_topk(None, 0, wrong, mask, **kw)
    sel, _ = algo.retrieve_topk(None, 0, fb.req_pool_indices.int(), mask, **kw)  # int32 of the same rows is fine
    assert sel.shape == (3, CFG.index_topk)
