"""Tests written to catch realistic single-point bugs that the suite once let through (a mutation study).

Each test names the bug it pins: an off-by-one at a boundary, a comparison that drops the value 0, a
check that covers slot 0 but not the rest of page 0, a stale generation, a hash that ignores order.
"""

from __future__ import annotations

import pytest
import torch

import sparse_ref
from sparse_ref import KVCacheManager
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
        flags = topk_module._launch_topk(x.to(DEVICE), 5, None, None, out)
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
