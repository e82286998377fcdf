"""Tests for sparse_ref.batch: ForwardBatch fields against req_to_token, the builders and every BatchError."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref import (
    BatchError,
    ForwardBatch,
    ForwardMode,
    KVCacheManager,
    PoolError,
    build_decode_batch,
    build_extend_batch,
    decode_step,
)


def make_manager(page_size=4, num_pages=40, max_requests=6, max_context_len=64):
    return KVCacheManager.create(max_requests=max_requests, max_context_len=max_context_len,
                                 num_pages=num_pages, page_size=page_size)


def row(m, r):
    return m.req_to_token_pool.req_to_token[r.req_pool_idx]


def test_forward_mode():
    assert ForwardMode.EXTEND.is_extend() and not ForwardMode.EXTEND.is_decode()
    assert ForwardMode.DECODE.is_decode() and not ForwardMode.DECODE.is_extend()


def test_extend_batch_without_prefix():
    m = make_manager()
    a, b = m.admit(5), m.admit(3)
    fb = build_extend_batch(m, [a, b])
    assert fb.forward_mode is ForwardMode.EXTEND and fb.batch_size == 2
    for name in ("req_pool_indices", "seq_lens", "positions", "out_cache_loc", "extend_prefix_lens",
                 "extend_seq_lens"):
        assert getattr(fb, name).dtype == torch.int64, name
    assert fb.req_pool_indices.tolist() == [a.req_pool_idx, b.req_pool_idx]
    assert fb.seq_lens.tolist() == [5, 3]
    assert fb.extend_prefix_lens.tolist() == [0, 0]
    assert fb.extend_seq_lens.tolist() == [5, 3]
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert fb.out_cache_loc.tolist() == row(m, a)[:5].tolist() + row(m, b)[:3].tolist()


def test_extend_batch_with_prefix():
    m = make_manager(page_size=3)
    a, b, c = m.admit(7), m.admit(4), m.admit(2)
    fb = build_extend_batch(m, [a, b, c], prefix_lens=[5, 0, 2])
    assert fb.extend_prefix_lens.tolist() == [5, 0, 2]
    assert fb.extend_seq_lens.tolist() == [2, 4, 0]
    assert fb.positions.tolist() == [5, 6, 0, 1, 2, 3]
    want = row(m, a)[5:7].tolist() + row(m, b)[:4].tolist()
    assert fb.out_cache_loc.tolist() == want


@given(lens=st.lists(st.integers(1, 20), min_size=1, max_size=5), data=st.data(), page_size=st.integers(1, 5))
def test_positions_and_out_cache_loc_match_req_to_token(lens, data, page_size):
    m = make_manager(page_size=page_size, num_pages=5 * 20 + 1)
    reqs = [m.admit(n) for n in lens]
    prefix = [data.draw(st.integers(0, n)) for n in lens]
    fb = build_extend_batch(m, reqs, prefix)
    table = m.req_to_token_pool.req_to_token
    owner = torch.repeat_interleave(fb.req_pool_indices, fb.extend_seq_lens)
    assert torch.equal(table[owner, fb.positions].long(), fb.out_cache_loc)
    assert torch.equal(fb.extend_prefix_lens + fb.extend_seq_lens, fb.seq_lens)
    d = decode_step(m, reqs)
    assert torch.equal(d.positions, d.seq_lens - 1)
    assert torch.equal(table[d.req_pool_indices, d.positions].long(), d.out_cache_loc)
    assert d.seq_lens.tolist() == [n + 1 for n in lens]


def test_decode_batch_and_decode_step():
    m = make_manager(page_size=4)
    a, b = m.admit(4), m.admit(6)
    fb = build_decode_batch(m, [a, b])  # decodes the last token already admitted
    assert fb.forward_mode is ForwardMode.DECODE
    assert fb.seq_lens.tolist() == [4, 6] and fb.positions.tolist() == [3, 5]
    assert fb.out_cache_loc.tolist() == [int(row(m, a)[3]), int(row(m, b)[5])]
    assert fb.extend_prefix_lens is None and fb.extend_seq_lens is None
    pages_a = len(a.pages)
    step = decode_step(m, [a, b])
    assert a.seq_len == 5 and b.seq_len == 7 and len(a.pages) == pages_a + 1  # token 4 opens a page
    assert step.seq_lens.tolist() == [5, 7] and step.positions.tolist() == [4, 6]
    assert step.out_cache_loc.tolist() == [a.pages[1] * 4, b.pages[1] * 4 + 2]


def test_decode_step_is_all_or_nothing_on_exhaustion():
    m = make_manager(page_size=2, num_pages=4)  # 3 usable pages
    a, b = m.admit(2), m.admit(2)  # 2 pages, both full
    with pytest.raises(PoolError, match=r"asked for 2 pages, 1 of 3"):
        decode_step(m, [a, b])
    assert a.seq_len == 2 and b.seq_len == 2 and len(a.pages) == 1 and len(b.pages) == 1
    assert m.allocator.available_pages() == 1
    decode_step(m, [a])
    assert a.seq_len == 3


def test_decode_step_respects_max_context_len():
    m = make_manager(max_context_len=4)
    a, b = m.admit(2), m.admit(4)
    with pytest.raises(PoolError, match="request of 5 tokens exceeds max_context_len 4"):
        decode_step(m, [a, b])
    assert a.seq_len == 2 and b.seq_len == 4


def test_builder_errors():
    m = make_manager()
    a, b = m.admit(3), m.admit(0)
    with pytest.raises(BatchError, match="at least one request, got none"):
        build_extend_batch(m, [])
    with pytest.raises(BatchError, match="at least one request"):
        build_decode_batch(m, [])
    with pytest.raises(BatchError, match="prefix_lens has 2 entries for 1 requests"):
        build_extend_batch(m, [a], prefix_lens=[0, 0])
    with pytest.raises(BatchError, match=r"prefix_lens\[0\]: expected an int in \[0, 3\], got 4.*seq_len=3"):
        build_extend_batch(m, [a], prefix_lens=[4])
    with pytest.raises(BatchError, match=r"got -1"):
        build_extend_batch(m, [a], prefix_lens=[-1])
    with pytest.raises(BatchError, match=r"got float 1.5"):
        build_extend_batch(m, [a], prefix_lens=[1.5])
    with pytest.raises(BatchError, match="request 1 has seq_len 0; grow it by one token"):
        build_decode_batch(m, [a, b])
    with pytest.raises(BatchError, match="request 0 appears twice"):
        build_decode_batch(m, [a, a])
    with pytest.raises(BatchError, match="request 0 appears twice"):
        decode_step(m, [a, a])
    assert a.seq_len == 3, "a rejected decode_step grows nothing"
    other = make_manager()
    with pytest.raises(BatchError, match="not admitted by this KVCacheManager"):
        build_extend_batch(other, [a])
    m.release(a)
    with pytest.raises(BatchError, match="request 0 was released"):
        build_decode_batch(m, [a])
    with pytest.raises(BatchError, match="request 0 was released"):
        decode_step(m, [a])


def _decode_fields(bs=2):
    i = torch.arange(bs, dtype=torch.int64)
    return dict(forward_mode=ForwardMode.DECODE, req_pool_indices=i, seq_lens=i + 1, positions=i,
                out_cache_loc=i + 8)


@pytest.mark.parametrize("name", ["req_pool_indices", "seq_lens", "positions", "out_cache_loc"])
@pytest.mark.parametrize("bad, what", [(torch.zeros(2, dtype=torch.int32), "dtype torch.int64"),
                                       (torch.zeros(2, 1, dtype=torch.int64), "a 1-D tensor"),
                                       ([0, 1], "a torch.Tensor")])
def test_forward_batch_field_type_errors(name, bad, what):
    fields = _decode_fields()
    fields[name] = bad
    with pytest.raises(BatchError, match=rf"ForwardBatch.{name}: expected {what}"):
        ForwardBatch(**fields)


def test_forward_batch_consistency_errors():
    f = _decode_fields()
    with pytest.raises(BatchError, match="forward_mode: expected ForwardMode"):
        ForwardBatch(**{**f, "forward_mode": "decode"})
    with pytest.raises(BatchError, match=r"req_pool_indices: expected each request's row once, got \[1, 1\]"):
        ForwardBatch(**{**f, "req_pool_indices": torch.tensor([1, 1])})  # (one row's KV written twice in a step)
    with pytest.raises(BatchError, match=r"seq_lens: expected 2 rows \(one per request\), got shape \(3,\)"):
        ForwardBatch(**{**f, "seq_lens": torch.ones(3, dtype=torch.int64)})
    three = torch.ones(3, dtype=torch.int64)
    with pytest.raises(BatchError, match=r"positions: expected 2 rows \(DECODE: one new token per request\)"):
        ForwardBatch(**{**f, "positions": three, "out_cache_loc": three})
    ext = {**f, "forward_mode": ForwardMode.EXTEND}
    with pytest.raises(BatchError, match=r"extend_prefix_lens: expected a torch.Tensor, got NoneType None"):
        ForwardBatch(**ext)
    zeros = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(BatchError, match=r"out_cache_loc: expected 3 rows \(one per new token\)"):
        ForwardBatch(**{**ext, "positions": three}, extend_prefix_lens=zeros, extend_seq_lens=zeros)
    with pytest.raises(BatchError, match=r"extend_seq_lens: expected dtype torch.int64"):
        ForwardBatch(**ext, extend_prefix_lens=zeros, extend_seq_lens=zeros.int())
    with pytest.raises(BatchError, match=r"extend_prefix_lens: expected 2 rows \(one per request\)"):
        ForwardBatch(**ext, extend_prefix_lens=torch.zeros(3, dtype=torch.int64), extend_seq_lens=zeros)
    with pytest.raises(BatchError, match=r"extend_seq_lens: expected seq_lens \[1, 2\] - extend_prefix_lens"):
        ForwardBatch(**ext, extend_prefix_lens=torch.tensor([0, 0]), extend_seq_lens=torch.tensor([0, 2]))
    with pytest.raises(BatchError, match=r"extend_seq_lens: expected a sum of 2 .*got a sum of 4"):
        ForwardBatch(**{**ext, "seq_lens": torch.tensor([1, 3])}, extend_prefix_lens=zeros,
                     extend_seq_lens=torch.tensor([1, 3]))
    ok = ForwardBatch(**ext, extend_prefix_lens=torch.tensor([0, 1]), extend_seq_lens=torch.tensor([1, 1]))
    assert ok.batch_size == 2


def test_forward_batch_device_mismatch():
    f = _decode_fields()
    elsewhere = torch.ones(2, dtype=torch.int64, device="meta")  # any device other than the CPU
    with pytest.raises(BatchError, match=r"ForwardBatch.seq_lens: expected a tensor with data"):
        ForwardBatch(**{**f, "seq_lens": elsewhere})
