"""Tests written to catch realistic single-point bugs that the suite once let through (a mutation study).

Each test names the bug it pins: an off-by-one at a boundary, a comparison that drops the value 0, a
check that covers slot 0 but not the rest of page 0, a stale generation, a hash that ignores order.
"""

from __future__ import annotations

import pytest
import torch

import sparse_ref
from sparse_ref import KVCacheManager
from sparse_ref.adaptor import Metadata
from sparse_ref.batch import ForwardBatch, ForwardMode, build_decode_batch
from sparse_ref.checks import check_selection_values, check_tokens_on_real_pages
from sparse_ref.config import SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.engine_graph import GraphedDecodeStep
from sparse_ref.errors import BatchError, PoolError, ShapeError
from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels import tuning
from sparse_ref.kernels.topk import topk
from sparse_ref.selection import topk_reference
from sparse_ref.tensor_parallel import tensor_hash
from sparse_ref.workloads import PlantedEngineWorkload

DEVICE = sparse_ref.default_device()
LONG = {"register_row": 0, "chunk": 64, "delegate_cols": 64, "min_delegates": 128}


@pytest.mark.knobs
@pytest.mark.parametrize("knobs", [{}, {"short_pair": 0}, {"direct_ratio": 0}, {"direct_ratio": 0, "slots": 2}],
                         ids=["shapes' plan", "rounds only", "delegates plan", "delegates + fallback"])
def test_register_rows_with_fewer_valid_keys_than_delegates(knobs):
    """A row held in registers where most keys are -inf or NaN: fewer valid keys than delegates, but more than k.
    Every plan must still return k ids (a plan that trusted the delegates alone returned fewer)."""
    g = torch.Generator().manual_seed(4)
    x = torch.full((3, 4096), float("-inf"))
    for r, valid in enumerate((150, 101, 100)):
        cols = torch.randperm(4096, generator=g)[:valid]
        x[r, cols] = torch.randn(valid, generator=g)
    x[1][x[1] == float("-inf")] = float("nan")
    with tuning(topk_module.TUNING, **knobs):
        got = topk(x.to(DEVICE), 100, order="index").cpu()
    want = topk_reference(x, 100, order="index")
    assert torch.equal(got, want)
    assert bool((got >= 0).all()), "every row has at least 100 valid keys: no -1"


@pytest.mark.knobs
def test_candidates_exactly_filling_the_slots_stay_off_the_fallback():
    """The long-row path with SLOTS = 128: a row whose candidates (keys >= T) number exactly 128 fits its slots
    (flag 0); one more candidate overflows (the tie path, flag 2). An off-by-one in the slot bound moves the
    boundary (or writes a slot past the row's own)."""
    g = torch.Generator().manual_seed(9)
    x = -torch.rand(2, 2000, generator=g) - 1.0  # every key < 0 ...
    x[:, :128] = 5.0  # ... but one 5.0 per delegate column (G = 128): T = 5.0 and exactly 128 candidates
    x[1, 128] = 5.0  # row 1: 129
    with tuning(topk_module.TUNING, **LONG, slots=128):
        out = torch.empty(2, 5, dtype=torch.int32, device=DEVICE)
        flags = topk_module.launch_topk(x.to(DEVICE), 5, None, None, out).flags
    assert flags.tolist() == [0, 2]
    assert torch.equal(out.cpu(), topk_reference(x, 5, order="index"))


def selection_case():
    m = KVCacheManager.create(max_requests=2, max_context_len=32, num_pages=12, page_size=4)
    req = m.admit(13)  # 4 pages
    r2t = m.req_to_token_pool.req_to_token
    return r2t, torch.tensor([13]), torch.tensor([req.req_pool_idx])


def test_selection_values_refuse_a_duplicate_of_page_zero():
    r2t, seq_lens, rows = selection_case()
    mask = torch.tensor([True])
    check_selection_values(torch.tensor([[0, 1, 3]]), torch.tensor([3]), mask, seq_lens, rows, r2t, 4)
    with pytest.raises(ShapeError, match="same page twice"):  # a duplicate of page 0 (a ``> 0`` test misses it)
        check_selection_values(torch.tensor([[0, 0, 3]]), torch.tensor([3]), mask, seq_lens, rows, r2t, 4)
    with pytest.raises(ShapeError, match="same page twice"):
        check_selection_values(torch.tensor([[2, 2, 3]]), torch.tensor([3]), mask, seq_lens, rows, r2t, 4)


@pytest.mark.parametrize("slot", [0, 1, 3])
def test_tokens_on_page_zero_are_refused_whatever_the_slot(slot):
    """Page 0 is padding: a request's token mapped to any of its slots (not only slot 0) is refused."""
    r2t, seq_lens, rows = selection_case()
    r2t = r2t.clone()
    check_tokens_on_real_pages(seq_lens, rows, r2t, 4)
    r2t[int(rows[0]), 6] = slot
    with pytest.raises(ShapeError, match="padding page 0"):
        check_tokens_on_real_pages(seq_lens, rows, r2t, 4)


def test_batch_slots_refuse_a_token_on_slot_zero_deterministically():
    """A decode batch whose token maps to slot 0 (a row that holds no token there) is refused, every time."""
    m = KVCacheManager.create(max_requests=2, max_context_len=32, num_pages=12, page_size=4)
    req = m.admit(5)
    good = build_decode_batch(m, [req])
    for seq_len in (6, 9, 32):  # positions past the request's tokens: req_to_token holds 0 there
        bad = ForwardBatch(ForwardMode.DECODE, good.req_pool_indices.clone(), torch.tensor([seq_len]),
                           torch.tensor([seq_len - 1]), torch.tensor([0]))
        from sparse_ref.batch import check_batch_slots

        with pytest.raises(BatchError, match="holds no token"):
            check_batch_slots(m.req_to_token_pool.req_to_token, bad)


def test_admit_takes_exactly_the_free_pages_and_refuses_one_more():
    m = KVCacheManager.create(max_requests=3, max_context_len=64, num_pages=9, page_size=4)  # 8 usable pages
    a = m.admit(4 * 5)  # 5 pages
    free = m.allocator.available_pages()
    assert free == 3
    with pytest.raises(PoolError, match="3 of 8 usable pages free"):
        m.admit(4 * 3 + 1)  # 4 pages: one too many, and nothing is taken
    assert m.allocator.available_pages() == 3 and m.req_to_token_pool.available_size() == 2
    b = m.admit(4 * 3)  # exactly the 3 free pages
    assert m.allocator.available_pages() == 0 and len(b.pages) == 3 and not set(a.pages) & set(b.pages)


def test_replay_after_a_release_is_refused():
    """A request leaves after the graph's step: the manager's generation moved, so a replay would write K/V
    into slots that are free (or someone else's). Refused, before anything runs."""
    wl = PlantedEngineWorkload(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=1,
                               num_head_needles=1, seed=2)
    e = DecodeEngine(wl, ["quest"], SparseConfig(page_budget=2), page_size=4, max_requests=3, max_context_len=48,
                     backend="torch" if DEVICE.type == "cpu" else "auto", device=DEVICE)
    a, _ = e.add_request(20), e.add_request(13)
    step = GraphedDecodeStep(e)
    step.step()
    step.replay()  # the same step again: allowed
    e.finish(a)
    k = e.manager.token_to_kv_pool.get_key_buffer(0).clone()
    with pytest.raises(BatchError):
        step.replay()
    assert torch.equal(e.manager.token_to_kv_pool.get_key_buffer(0), k)


def test_tensor_hash_sees_order_and_small_moves():
    ids = torch.tensor([[0, 5, 9], [3, 4, 9]])
    assert int(tensor_hash(ids[0])) != int(tensor_hash(ids[1]))  # a weighted sum (1, 3, 5) gives both 37 + c
    x = torch.randint(0, 1000, (64,))
    assert int(tensor_hash(x)) == int(tensor_hash(x.clone()))
    for i, j in ((0, 1), (5, 40), (62, 63)):
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        assert x[i] == x[j] or int(tensor_hash(y)) != int(tensor_hash(x))
    for a, b in ((1, -1), (3, -1), (2, -2)):
        y = x.clone()
        y[10] += a
        y[11] += b
        assert int(tensor_hash(y)) != int(tensor_hash(x))


# ---------------------------------------------------------------- offload: the buffer's edges
def test_a_row_reading_its_whole_buffer_and_its_newest_token_swaps_in_exactly():
    """``size`` held tokens plus the newest: the kernel's span must be ``size + 1`` (a span of ``size`` would drop
    the newest token's entry, one of ``size + 2`` would read past the buffer)."""
    from test_swap_in import decode_batch

    from sparse_ref.kernels.swap_in import swap_in
    from sparse_ref.offload import HostKVPool, HotBuffer, positions_read

    size, rows, max_ctx = 6, 1, 16
    host = HostKVPool(1 + rows * max_ctx, 1, 1, 2)
    host.k[0].copy_(torch.randn(host.k[0].shape))
    host.v[0].copy_(torch.randn(host.v[0].shape))
    r2t = torch.arange(1, 1 + rows * max_ctx, dtype=torch.int32).view(rows, max_ctx)
    seq = torch.tensor([size + 1])  # tokens 0..size: size of history and the newest
    selected, lengths = torch.arange(size + 1, dtype=torch.int32)[None, :], torch.tensor([size + 1], dtype=torch.int32)
    mask = torch.ones(1, dtype=torch.bool)
    ref, kern = HotBuffer(1, rows, size, 1, 2, max_ctx), HotBuffer(1, rows, size, 1, 2, max_ctx, device=DEVICE)
    new, loc = host.k[0][r2t[0, size].long()][None], r2t[[0], seq - 1].long()
    positions, counts = positions_read(selected, lengths, mask, seq, 1, size + 1)
    assert int(counts[0]) == size + 1
    ref.write_newest(0, torch.tensor([0]), new, host.v[0][loc])
    want = ref.swap_in(0, torch.tensor([0]), positions, counts, seq, host, r2t)
    on = {"device": DEVICE}
    host_kern = HostKVPool(1 + rows * max_ctx, 1, 1, 2)
    host_kern.k[0].copy_(host.k[0])
    host_kern.v[0].copy_(host.v[0])
    md = Metadata(torch.zeros(1, size + 1, dtype=torch.int32, **on), None, 1, selected.to(**on), lengths.to(**on),
                  mask.to(**on))
    table, n = swap_in(kern, 0, md,
                       decode_batch(torch.tensor([0], **on), seq.to(**on), loc.to(**on)), (new.to(**on),
                       host.v[0][loc].to(**on)), host_kern, r2t.to(**on))
    assert int(n[0]) == size + 1 and torch.equal(table.cpu(), want.cpu())
    assert torch.equal(kern.k[0].cpu(), ref.k[0].cpu())  # every one of the size + 1 slots holds its token


def test_the_buffer_minimum_counts_dense_rows_below_the_sparse_threshold():
    """A row below ``min_sparse_seq_len`` reads all its tokens: with a threshold above the sparse budget, the
    smallest buffer is ``min_sparse_seq_len - 1``, not the budget (a buffer sized by the budget alone would not
    hold such a row)."""
    from sparse_ref.errors import ConfigError

    wl = PlantedEngineWorkload(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=4, seed=3)
    cfg = SparseConfig(page_budget=1, num_recent_pages=1, min_sparse_seq_len=41)  # Quest reads 2 pages of 4 = 8
    kw = dict(page_size=4, max_requests=2, max_context_len=64, backend="torch")
    with pytest.raises(ConfigError, match="at least 40 token slots"):
        DecodeEngine(wl, ["quest"], cfg, offload_buffer=39, **kw)
    engine = DecodeEngine(wl, ["quest"], cfg, offload_buffer=40, **kw)
    engine.add_request(39)  # 40 tokens at the first step: dense (below 41), all read through the buffer
    assert engine.step().offload_misses > 0


# ---------------------------------------------------------------- pools: owners
def test_a_pool_free_naming_another_owner_is_refused_and_frees_nothing():
    m = KVCacheManager.create(max_requests=2, max_context_len=16, num_pages=9, page_size=4, head_dim=2)
    a, b = m.admit(8), m.admit(4)
    free_before = m.allocator.available_pages()
    with pytest.raises(PoolError, match=f"belongs to request {a.rid}"):
        m.allocator.free(a.pages, owner=b)
    with pytest.raises(PoolError, match="belongs to request"):
        m.req_to_token_pool.free([a.req_pool_idx], owner=b)
    assert m.allocator.available_pages() == free_before and not a.released


def test_a_freed_ids_owner_is_forgotten():
    """After its owner's release, a page taken again without an owner frees without one (a stale owner would make
    the free refuse, or let the old owner free it again)."""
    m = KVCacheManager.create(max_requests=2, max_context_len=16, num_pages=3, page_size=4, head_dim=2)
    a = m.admit(8)  # both usable pages
    pages = list(a.pages)
    m.release(a)
    again = m.allocator.alloc(2)  # no owner now
    assert sorted(again) == sorted(pages)
    m.allocator.free(again)  # frees cleanly
    assert m.allocator.available_pages() == 2
    with pytest.raises(PoolError, match="double free"):
        m.allocator.free(again[:1], owner=a)  # and the old owner is no owner of them any more


@pytest.mark.knobs
@pytest.mark.parametrize("valid", [15, 16, 17])
def test_the_direct_plan_ranks_a_kept_bin_of_exactly_sixteen_keys(valid):
    """The direct plan's last step ranks the kept bin pairwise when it holds at most 16 keys. With no value round
    (``value_bins=0``), a row of exactly 16 distinct valid keys reaches that rank with no window round before it:
    a bound of ``< 16`` would skip the rank and keep the window's lower edge as the k-th key."""
    g = torch.Generator().manual_seed(valid)
    x = torch.full((2, 40), float("-inf"))
    x[:, :valid] = torch.randn(2, valid, generator=g)
    x[1] = x[1, torch.randperm(40, generator=g)]  # the valid keys anywhere in the row
    with tuning(topk_module.TUNING, value_bins=0):
        run = topk_module.prepare(x.to(DEVICE), 5, None, None, torch.empty(2, 5, dtype=torch.int32, device=DEVICE))
        assert run.plan.direct and run.names == ("short_row",)
        got = topk(x.to(DEVICE), 5, order="index").cpu()
    assert torch.equal(got, topk_reference(x, 5, order="index"))
