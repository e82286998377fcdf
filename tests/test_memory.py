"""Tests for sparse_ref.memory: the request pool, the page allocator, the paged KV pool and the manager.

The last part is a hypothesis state machine: random admit / grow / release sequences, with the
isolation invariants (no shared slot or page between live requests, page-aligned slots, page 0
never used, failed operations change nothing) checked after every step.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparse_ref import KVCacheManager, PageAllocator, PoolError, ReqToTokenPool, SparseRefError, TokenToKVPool


def snapshot(m: KVCacheManager):
    """Everything a failed operation must leave unchanged."""
    return (
        m.req_to_token_pool.req_to_token.clone(),
        sorted(m.req_to_token_pool._free),
        m.allocator.available_pages(),
        sorted(m.allocator._free),
        {rid: (r.req_pool_idx, r.seq_len, list(r.pages)) for rid, r in m.requests.items()},
    )


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1:] == b[1:]


# ---------------------------------------------------------------- ReqToTokenPool


def test_req_to_token_shape_dtype():
    pool = ReqToTokenPool(5, 37)
    assert pool.req_to_token.shape == (5, 37)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.available_size() == 5


def test_req_pool_alloc_free_reuse():
    pool = ReqToTokenPool(3, 8)
    a = pool.alloc(2)
    assert len(a) == 2 and len(set(a)) == 2 and all(0 <= s < 3 for s in a)
    assert pool.available_size() == 1
    pool.req_to_token[a[0]] = 7
    pool.free([a[0]])
    assert pool.available_size() == 2
    assert int(pool.req_to_token[a[0]].abs().sum()) == 0, "a freed row is zeroed"
    b = pool.alloc(2)
    assert a[0] in b and a[1] not in b
    assert pool.alloc(0) == []


def test_req_pool_exhaustion_message_has_numbers():
    pool = ReqToTokenPool(4, 8)
    pool.alloc(3)
    with pytest.raises(PoolError, match=r"asked for 2 request slots, 1 of 4 free"):
        pool.alloc(2)
    assert pool.available_size() == 1, "a failed alloc takes nothing"


@pytest.mark.parametrize("slots", [[2], torch.tensor([2]), 2])
def test_req_pool_double_free(slots):
    pool = ReqToTokenPool(4, 8)
    pool.alloc(4)
    pool.free(slots)
    with pytest.raises(PoolError, match=r"slot 2 is already free \(double free\)"):
        pool.free(slots)


def test_req_pool_duplicate_in_one_free_call():
    pool = ReqToTokenPool(4, 8)
    pool.alloc(4)
    with pytest.raises(PoolError, match=r"appears twice in \[1, 1\]"):
        pool.free([1, 1])
    assert pool.available_size() == 0, "a failed free gives nothing back"


@pytest.mark.parametrize("slot", [-1, 4, 100])
def test_req_pool_free_out_of_range(slot):
    pool = ReqToTokenPool(4, 8)
    pool.alloc(4)
    with pytest.raises(PoolError, match=rf"slot {slot} is out of range \[0, 4\)"):
        pool.free([slot])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_req_pool_alloc_bad_count(bad):
    with pytest.raises(PoolError, match=r"ReqToTokenPool.alloc\(n\)"):
        ReqToTokenPool(4, 8).alloc(bad)


@pytest.mark.parametrize("bad", [[1.0], torch.tensor([1.0]), "x", [True]])
def test_req_pool_free_bad_indices(bad):
    pool = ReqToTokenPool(4, 8)
    pool.alloc(4)
    with pytest.raises(PoolError, match=r"ReqToTokenPool.free\(slots\)"):
        pool.free(bad)


@pytest.mark.parametrize("size,ctx", [(0, 8), (3, 0), (-1, 4)])
def test_req_pool_bad_construction(size, ctx):
    bad = "size" if size < 1 else "max_context_len"
    with pytest.raises(PoolError, match=rf"ReqToTokenPool\({bad}\): expected an int in \[1, "):
        ReqToTokenPool(size, ctx)


def test_req_pool_free_accepts_numpy_ints():
    pool = ReqToTokenPool(4, 8)
    pool.alloc(4)
    pool.free(np.array([3, 1]))
    assert pool.available_size() == 2


# ---------------------------------------------------------------- PageAllocator


def test_page_allocator_never_hands_out_page_zero():
    alloc = PageAllocator(7, 4)
    assert alloc.available_pages() == 6
    pages = alloc.alloc(6)
    assert sorted(pages) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(PoolError, match=r"asked for 1 pages, 0 of 6 usable pages free \(page size 4\)"):
        alloc.alloc(1)


def test_page_allocator_free_reuse_and_listeners():
    alloc = PageAllocator(5, 2)
    seen = []
    alloc.add_free_listener(lambda pages: seen.append(pages.tolist()))
    pages = alloc.alloc(3)
    alloc.free(pages[1:])
    assert seen == [pages[1:]]
    assert alloc.available_pages() == 3
    again = alloc.alloc(3)
    assert set(pages[1:]) <= set(again) and 0 not in again
    assert len(seen) == 1, "listeners are called on free only, once per free"
    alloc.add_free_listener(seen.append)
    alloc.add_free_listener(seen.append)  # the same listener twice is registered once
    alloc.free(again[:1])
    assert len(seen) == 3 and seen[1] == again[:1] and seen[2].tolist() == again[:1]


def test_page_allocator_errors():
    alloc = PageAllocator(5, 2)
    alloc.alloc(2)  # pages 1, 2
    with pytest.raises(PoolError, match="page 0 is the reserved padding page"):
        alloc.free([0])
    with pytest.raises(PoolError, match=r"page 5 is out of range \[1, 5\)"):
        alloc.free([5])
    with pytest.raises(PoolError, match=r"page 3 is already free \(double free\)"):
        alloc.free([3])
    with pytest.raises(PoolError, match=r"appears twice"):
        alloc.free([1, 1])
    assert alloc.available_pages() == 2, "failed frees give nothing back"
    with pytest.raises(PoolError, match=r"asked for 3 pages, 2 of 4"):
        alloc.alloc(3)
    with pytest.raises(PoolError, match=r"alloc\(n\): expected an int in \[0, inf\], got -1"):
        alloc.alloc(-1)
    with pytest.raises(PoolError, match=r"PageAllocator\(num_pages\): expected an int in \[2, \d+\], got 1"):
        PageAllocator(1, 4)
    with pytest.raises(PoolError, match=r"PageAllocator\(page_size\): expected an int in \[1, \d+\], got 0"):
        PageAllocator(3, 0)


def test_page_allocator_listener_not_called_on_failed_free():
    alloc = PageAllocator(4, 2)
    calls = []
    alloc.add_free_listener(calls.append)
    alloc.alloc(1)
    with pytest.raises(PoolError):
        alloc.free([1, 2])  # 2 was never allocated
    assert calls == [] and alloc.available_pages() == 2


# ---------------------------------------------------------------- TokenToKVPool


def test_token_to_kv_pool_shapes_per_layer():
    pool = TokenToKVPool(num_pages=5, page_size=3, num_layers=2, num_kv_heads=2, head_dim=7, dtype=torch.float16)
    for layer in range(2):
        for buf in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            assert buf.shape == (15, 2, 7) and buf.dtype == torch.float16
    assert pool.get_key_buffer(0).data_ptr() != pool.get_key_buffer(1).data_ptr()
    assert pool.num_slots == 15
    with pytest.raises(PoolError, match=r"layer: expected an int in \[0, 1\], got 2"):
        pool.get_key_buffer(2)
    with pytest.raises(PoolError, match=r"layer: expected an int in \[0, 1\], got -1"):
        pool.get_value_buffer(-1)


def test_set_kv_writes_only_the_given_slots():
    pool = TokenToKVPool(4, 3, 2, 2, 5)
    loc = torch.tensor([3, 10, 11])
    k = torch.randn(3, 2, 5)
    v = torch.randn(3, 2, 5)
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k)
    assert torch.equal(pool.get_value_buffer(1)[loc], v)
    others = torch.ones(12, dtype=torch.bool)
    others[loc] = False
    assert pool.get_key_buffer(1)[others].abs().sum() == 0
    assert pool.get_key_buffer(0).abs().sum() == 0, "other layers untouched"
    pool.set_kv(0, torch.zeros(0, dtype=torch.int32), torch.zeros(0, 2, 5), torch.zeros(0, 2, 5))


@pytest.mark.parametrize(
    "loc,match",
    [
        ([0], r"loc: expected values in \[3, 11\], got min 0, max 0. Fix: page 0 is padding"),
        ([2, 5], r"got min 2, max 5"),
        ([3, 12], r"got min 3, max 12"),
        ([-1], r"got min -1"),
    ],
)
def test_set_kv_range_checks_page_zero_reserved(loc, match):
    pool = TokenToKVPool(4, 3, 1, 2, 5)
    n = len(loc)
    with pytest.raises(PoolError, match=match):
        pool.set_kv(0, torch.tensor(loc), torch.zeros(n, 2, 5), torch.zeros(n, 2, 5))
    assert pool.get_key_buffer(0).abs().sum() == 0


def test_set_kv_shape_checks():
    pool = TokenToKVPool(4, 3, 1, 2, 5)
    with pytest.raises(PoolError, match=r"k: expected shape \[2, 2, 5\], got shape \(2, 2, 4\)"):
        pool.set_kv(0, torch.tensor([3, 4]), torch.zeros(2, 2, 4), torch.zeros(2, 2, 5))
    with pytest.raises(PoolError, match=r"v: expected shape \[2, 2, 5\], got shape \(1, 2, 5\)"):
        pool.set_kv(0, torch.tensor([3, 4]), torch.zeros(2, 2, 5), torch.zeros(1, 2, 5))
    with pytest.raises(SparseRefError, match=r"loc: expected dtype"):
        pool.set_kv(0, torch.tensor([3.0]), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))
    with pytest.raises(SparseRefError, match=r"loc: expected a 1-D"):
        pool.set_kv(0, torch.tensor([[3]]), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))
    with pytest.raises(PoolError, match=r"layer: expected an int in \[0, 0\], got 1"):
        pool.set_kv(1, torch.tensor([3]), torch.zeros(1, 2, 5), torch.zeros(1, 2, 5))


@pytest.mark.parametrize("field_index", range(5))
def test_token_to_kv_pool_bad_construction(field_index):
    args = [4, 3, 1, 2, 5]
    names = ["num_pages", "page_size", "num_layers", "num_kv_heads", "head_dim"]
    args[field_index] = 0
    with pytest.raises(PoolError, match=rf"\({names[field_index]}\): expected an int in \[\d, \w+\], got 0"):
        TokenToKVPool(*args)
    with pytest.raises(PoolError, match=r"num_pages\): expected an int in \[2, \d+\], got 1. Fix: page 0 is reserved"):
        TokenToKVPool(1, 3, 1, 2, 5)


# ---------------------------------------------------------------- KVCacheManager


def make_manager(max_requests=4, max_context_len=50, num_pages=12, page_size=4):
    return KVCacheManager.create(max_requests=max_requests, max_context_len=max_context_len,
                                 num_pages=num_pages, page_size=page_size)


def expected_row(req, page_size):
    """The slot formula, written out: page_of(t // P) * P + t % P."""
    return [req.pages[t // page_size] * page_size + t % page_size for t in range(req.seq_len)]


@pytest.mark.parametrize("page_size", [1, 3, 4, 7])
def test_admit_fills_row_by_the_slot_formula(page_size):
    m = make_manager(num_pages=40, page_size=page_size)
    reqs = [m.admit(n) for n in (0, 1, 5, 13)]
    for r in reqs:
        assert len(r.pages) == -(-r.seq_len // page_size)
        row = m.req_to_token_pool.req_to_token[r.req_pool_idx]
        assert row[: r.seq_len].tolist() == expected_row(r, page_size)
        assert row[r.seq_len:].abs().sum() == 0
        assert all(m.slot_of(r, t) == row[t] for t in range(r.seq_len))


def test_grow_returns_new_slots_and_allocates_pages_only_when_needed():
    m = make_manager(page_size=4)
    r = m.admit(3)
    assert len(r.pages) == 1
    free_before = m.allocator.available_pages()
    slots = m.grow(r, 1)  # token 3 fills page 0 of the request
    assert slots.dtype == torch.int64 and slots.tolist() == [r.pages[0] * 4 + 3]
    assert m.allocator.available_pages() == free_before
    assert m.pages_needed(r, 1) == 1
    slots = m.grow(r, 1)  # token 4 opens a new page
    assert len(r.pages) == 2 and slots.tolist() == [r.pages[1] * 4]
    assert m.allocator.available_pages() == free_before - 1
    slots = m.grow(r, 6)
    assert slots.tolist() == expected_row(r, 4)[5:11]
    assert m.grow(r, 0).numel() == 0
    assert m.req_to_token_pool.req_to_token[r.req_pool_idx, : r.seq_len].tolist() == expected_row(r, 4)


def test_release_makes_pages_and_slot_reusable():
    m = make_manager(max_requests=2, num_pages=5, page_size=4)  # 4 usable pages
    a = m.admit(9)  # 3 pages
    b = m.admit(2)  # 1 page
    with pytest.raises(PoolError, match="exhausted"):
        m.admit(1)
    pages_a, slot_a = set(a.pages), a.req_pool_idx
    m.release(a)
    assert a.released and a.pages == [] and a.rid not in m.requests
    assert m.req_to_token_pool.req_to_token[slot_a].abs().sum() == 0
    c = m.admit(12)
    assert set(c.pages) == pages_a and c.req_pool_idx == slot_a
    assert not set(c.pages) & set(b.pages)


def test_manager_error_paths_leave_state_unchanged():
    m = make_manager(max_requests=2, max_context_len=10, num_pages=4, page_size=2)  # 3 usable pages
    a = m.admit(5)  # 3 pages
    before = snapshot(m)
    with pytest.raises(PoolError, match=r"asked for 1 pages, 0 of 3 usable pages free"):
        m.admit(1)
    assert_same(before, snapshot(m))
    with pytest.raises(PoolError, match=r"asked for 1 pages, 0 of 3"):
        m.grow(a, 2)
    assert_same(before, snapshot(m))
    with pytest.raises(PoolError, match=r"request of 11 tokens exceeds max_context_len 10"):
        m.admit(11)
    with pytest.raises(PoolError, match=r"request of 11 tokens exceeds max_context_len 10"):
        m.grow(a, 6)
    with pytest.raises(PoolError, match=r"admit\(num_tokens\): expected an int in \[0, inf\], got -1"):
        m.admit(-1)
    with pytest.raises(PoolError, match=r"grow\(num_tokens\): expected an int in \[0, inf\], got -2"):
        m.grow(a, -2)
    assert_same(before, snapshot(m))
    m.grow(a, 1)  # fits in the last page
    m.release(a)
    with pytest.raises(PoolError, match=r"request 0 was already released \(double free\)"):
        m.release(a)
    with pytest.raises(PoolError, match=r"request 0 was released"):
        m.grow(a, 1)


def test_request_slot_exhaustion_leaves_pages_untouched():
    m = make_manager(max_requests=1, num_pages=10, page_size=2)
    m.admit(1)
    before = snapshot(m)
    with pytest.raises(PoolError, match=r"asked for 1 request slots, 0 of 1 free"):
        m.admit(3)
    assert_same(before, snapshot(m))


def test_manager_rejects_requests_of_another_manager():
    m1, m2 = make_manager(), make_manager()
    r = m1.admit(3)
    m2.admit(3)  # same rid 0 in m2
    with pytest.raises(PoolError, match="not admitted by this KVCacheManager"):
        m2.release(r)
    with pytest.raises(PoolError, match="not admitted by this KVCacheManager"):
        m2.grow(r, 1)


def test_manager_on_the_pool_device(device):
    m = KVCacheManager.create(max_requests=2, max_context_len=20, num_pages=6, page_size=4, device=device)
    r = m.admit(6)
    slots = m.grow(r, 1)
    assert slots.device.type == device.type
    assert m.req_to_token_pool.req_to_token.device.type == device.type


# ---------------------------------------------------------------- isolation, with hypothesis


class PoolIsolation(RuleBasedStateMachine):
    """Random admit / grow / release; after every step the isolation invariants hold."""

    def __init__(self):
        super().__init__()
        self.live = []

    @initialize(page_size=st.integers(1, 5), num_pages=st.integers(2, 13), max_requests=st.integers(1, 5))
    def build(self, page_size, num_pages, max_requests):
        self.P = page_size
        self.m = KVCacheManager.create(max_requests=max_requests, max_context_len=23, num_pages=num_pages,
                                       page_size=page_size)

    @rule(n=st.integers(0, 25))
    def admit(self, n):
        before = snapshot(self.m)
        try:
            r = self.m.admit(n)
        except PoolError:
            assert_same(before, snapshot(self.m))  # a failed admit changes nothing
            return
        self.live.append(r)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), n=st.integers(0, 7))
    def grow(self, i, n):
        r = self.live[i % len(self.live)]
        before = snapshot(self.m)
        try:
            self.m.grow(r, n)
        except PoolError:
            assert_same(before, snapshot(self.m))  # a failed grow changes nothing

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        r = self.live.pop(i % len(self.live))
        self.m.release(r)

    @invariant()
    def isolated_and_page_aligned(self):
        m, P = self.m, self.P
        table = m.req_to_token_pool.req_to_token
        seen_slots, seen_pages, seen_rows = set(), set(), set()
        for r in self.live:
            assert len(r.pages) == -(-r.seq_len // P), "exactly enough pages"
            assert 0 not in r.pages, "page 0 is never handed out"
            assert not seen_pages & set(r.pages), "two live requests share a page"
            seen_pages |= set(r.pages)
            assert r.req_pool_idx not in seen_rows
            seen_rows.add(r.req_pool_idx)
            row = table[r.req_pool_idx, : r.seq_len].tolist()
            assert row == expected_row(r, P)
            assert all(s >= P for s in row), "no live slot in page 0"
            assert not seen_slots & set(row), "two live requests share a physical slot"
            seen_slots |= set(row)
            assert table[r.req_pool_idx, r.seq_len:].abs().sum() == 0
        # bookkeeping adds up: every usable page is either owned or free, never both
        assert m.allocator.available_pages() + len(seen_pages) == m.allocator.num_pages - 1
        assert not set(m.allocator._free) & seen_pages
        assert m.req_to_token_pool.available_size() + len(self.live) == m.req_to_token_pool.size

    def teardown(self):
        # released pages and slots are reusable: after releasing everything, the whole pool fits one request
        for r in list(self.live):
            self.m.release(r)
        usable = self.m.allocator.num_pages - 1
        assert self.m.allocator.available_pages() == usable
        assert self.m.req_to_token_pool.available_size() == self.m.req_to_token_pool.size
        assert sorted(self.m.allocator.alloc(usable)) == list(range(1, usable + 1))
        size = self.m.req_to_token_pool.size
        assert sorted(self.m.req_to_token_pool.alloc(size)) == list(range(size))


PoolIsolation.TestCase.settings = settings(stateful_step_count=30)  # examples from the loaded profile
TestPoolIsolation = PoolIsolation.TestCase


@given(sizes=st.lists(st.integers(0, 17), min_size=1, max_size=6), page_size=st.integers(1, 6))
def test_admit_then_release_all_restores_the_pools(sizes, page_size):
    m = KVCacheManager.create(max_requests=6, max_context_len=17, num_pages=6 * 17 + 1, page_size=page_size)
    empty = snapshot(m)
    reqs = [m.admit(n) for n in sizes]
    for r in reversed(reqs):
        m.release(r)
    after = snapshot(m)
    assert torch.equal(after[0], empty[0])
    assert after[1] == empty[1] and after[2] == empty[2] and after[3] == empty[3] and after[4] == {}
