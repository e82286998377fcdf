"""The adaptor: logical selection -> physical page table, KV lengths, cumulative lengths."""

import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref import KVCacheManager, ShapeError, SparseConfig, build_decode_batch
from sparse_ref.adaptor import lengths_from_selection, page_table_width, to_attention_metadata  # noqa: F401
from sparse_ref.selection import ceil_div, select_pages


def fb_of(seq_lens, rows):
    return types.SimpleNamespace(seq_lens=torch.tensor(seq_lens), req_pool_indices=torch.tensor(rows))


def hand_example():
    """P=4. Row 0 holds 10 tokens on physical pages 5, 2, 7; row 1 holds 5 tokens on pages 3, 9."""
    P = 4
    r2t = torch.zeros(3, 12, dtype=torch.int32)
    for row, pages, n_tokens in ((0, [5, 2, 7], 10), (2, [3, 9], 5)):
        t = torch.arange(n_tokens)
        r2t[row, :n_tokens] = (torch.tensor(pages)[t // P] * P + t % P).int()
    return P, r2t


def test_hand_computed_example():
    P, r2t = hand_example()
    selected = torch.tensor([[0, 2, -1], [-1, -1, -1]], dtype=torch.int32)  # row 0 keeps logical pages 0 and 2
    lengths = torch.tensor([2, 0], dtype=torch.int32)  # row 1 stays dense
    mask = torch.tensor([True, True])
    table, kv, cu = to_attention_metadata(selected, lengths, mask, fb_of([10, 5], [0, 2]), r2t, P)
    assert table.dtype == kv.dtype == cu.dtype == torch.int32
    assert table.tolist() == [[5, 7, 0], [3, 9, 0]]  # W_out = max(3, ceil(12 / 4)) = 3
    assert kv.tolist() == [4 + 2, 5]  # (len - 1) * P + last_page_len with last_page_len = 10 - 2 * 4
    assert cu.tolist() == [0, 6, 11]
    # sparse_mask False makes the row dense whatever its selection says
    table, kv, cu = to_attention_metadata(selected, lengths, torch.tensor([False, True]), fb_of([10, 5], [0, 2]),
                                          r2t, P)
    assert table.tolist() == [[5, 2, 7], [3, 9, 0]] and kv.tolist() == [10, 5] and cu.tolist() == [0, 10, 15]


def test_writes_into_preallocated_buffers():
    P, r2t = hand_example()
    selected = torch.tensor([[1, 2, -1], [-1, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([2, 0], dtype=torch.int32)
    out = (torch.full((2, 3), 99, dtype=torch.int32), torch.full((2,), 99, dtype=torch.int32),
           torch.full((3,), 99, dtype=torch.int32))
    ptrs = [t.data_ptr() for t in out]
    res = to_attention_metadata(selected, lengths, torch.tensor([True, True]), fb_of([10, 5], [0, 2]), r2t, P, out=out)
    assert [t.data_ptr() for t in res] == ptrs
    assert out[0].tolist() == [[2, 7, 0], [3, 9, 0]] and out[1].tolist() == [6, 5] and out[2].tolist() == [0, 6, 11]
    with pytest.raises(ShapeError, match=r"out page_table: expected shape \[2, 3\]"):
        to_attention_metadata(selected, lengths, torch.tensor([True, True]), fb_of([10, 5], [0, 2]), r2t, P,
                              out=(torch.zeros(2, 2, dtype=torch.int32), out[1], out[2]))


def loop_reference(selected, lengths, mask, seq_lens, rows, r2t, P):
    """The adaptor one request at a time, as plain Python."""
    bs, width = selected.shape
    w_out = max(width, -(-r2t.shape[1] // P))  # wide enough for the selection and for a dense row's pages
    table, kv = torch.zeros(bs, w_out, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32)
    for i in range(bs):
        seq, n, k = int(seq_lens[i]), ceil_div(int(seq_lens[i]), P), int(lengths[i])
        logical = selected[i, :k].tolist() if (mask[i] and k) else list(range(n))
        for j, page in enumerate(logical):
            table[i, j] = int(r2t[rows[i], page * P]) // P
        kv[i] = (k - 1) * P + seq - (n - 1) * P if (mask[i] and k) else seq
    cu = torch.zeros(bs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(kv, 0)
    return table, kv, cu


@given(st.lists(st.integers(1, 70), min_size=1, max_size=6), st.sampled_from([1, 2, 5, 16]),
       st.integers(1, 6), st.integers(0, 2), st.lists(st.booleans(), min_size=6, max_size=6))
def test_matches_loop_on_real_selections(seq_lens, P, budget, sinks, mask_bits):
    m = KVCacheManager.create(max_requests=len(seq_lens), max_context_len=71, num_pages=80 * len(seq_lens) // P + 8,
                              page_size=P)
    m.allocator.alloc(1)
    reqs = [m.admit(s) for s in seq_lens]
    fb = build_decode_batch(m, reqs)
    r2t = m.req_to_token_pool.req_to_token
    mask = torch.tensor(mask_bits[: len(seq_lens)])
    gen = torch.Generator().manual_seed(sum(seq_lens))
    scores = torch.randn(len(seq_lens), ceil_div(71, P), generator=gen)
    cfg = SparseConfig(page_budget=budget, num_recent_pages=1 + sinks % 2, num_sink_pages=sinks)
    sel, lens = select_pages(scores, fb.seq_lens, mask, P, cfg)
    got = to_attention_metadata(sel, lens, mask, fb, r2t, P)
    ref = loop_reference(sel, lens, mask, fb.seq_lens, fb.req_pool_indices, r2t, P)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_token_selection_at_page_size_1():
    """DSA returns [bs, topk] -1 padded tokens and no lengths: the adaptor still works at P = 1."""
    r2t = torch.arange(40, dtype=torch.int32).reshape(2, 20) + 100
    selected = torch.tensor([[0, 3, 7, -1], [2, 5, 9, 11]], dtype=torch.int32)
    lengths = lengths_from_selection(selected)
    assert lengths.tolist() == [3, 4]
    table, kv, cu = to_attention_metadata(selected, lengths, torch.tensor([True, True]), fb_of([8, 12], [0, 1]), r2t, 1)
    assert table.shape == (2, 20)
    assert table[0, :3].tolist() == [100, 103, 107] and table[1, :4].tolist() == [122, 125, 129, 131]
    assert not table[0, 3:].any() and not table[1, 4:].any()
    assert kv.tolist() == [3, 4] and cu.tolist() == [0, 3, 7]


@pytest.mark.parametrize("selected, lengths, seq, match", [
    ([[0, 3, -1]], [2], [10], r"row 0 entry 1 is 3; expected .* in \[0, 3\)"),  # page of another request
    ([[0, -2, -1]], [2], [10], "row 0 entry 1 is -2"),
    ([[0, 2, 1]], [2], [10], "row 0 entry 2 is 1; .* -1 after"),
    ([[2, 2, -1]], [2], [10], "same page twice"),
    ([[0, 1, -1]], [2], [10], "ends with page 1, not its last page 2"),
    ([[0, 2, -1]], [4], [10], r"lengths: expected values in \[0, 3\]"),
    ([[0, 2, -1]], [2], [13], r"seq_lens: expected values in \[0, 12\]"),
])
def test_bad_selections_are_rejected(selected, lengths, seq, match):
    P, r2t = hand_example()
    with pytest.raises(ShapeError, match=match):
        to_attention_metadata(torch.tensor(selected, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                              torch.tensor([True]), fb_of(seq, [0]), r2t, P)


def test_bad_shapes_and_dtypes():
    P, r2t = hand_example()
    sel, lens = torch.tensor([[0, 2, -1]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    mask = torch.tensor([True])
    with pytest.raises(ShapeError, match="selected: expected a 2-D tensor"):
        to_attention_metadata(sel[0], lens, mask, fb_of([10], [0]), r2t, P)
    with pytest.raises(ShapeError, match="sparse_mask: expected dtype torch.bool"):
        to_attention_metadata(sel, lens, mask.int(), fb_of([10], [0]), r2t, P)
    with pytest.raises(ShapeError, match=r"lengths: expected 1 rows"):
        to_attention_metadata(sel, torch.tensor([2, 2], dtype=torch.int32), mask, fb_of([10], [0]), r2t, P)
    with pytest.raises(ShapeError, match="req_to_token: expected dtype torch.int32"):
        to_attention_metadata(sel, lens, mask, fb_of([10], [0]), r2t.long(), P)
    with pytest.raises(ShapeError, match=r"req_pool_indices: expected values in"):
        to_attention_metadata(sel, lens, mask, fb_of([10], [3]), r2t, P)


def test_page_table_width_by_hand():
    assert page_table_width(3, 12, 4) == 3 and page_table_width(2, 13, 4) == 4 and page_table_width(9, 5, 1) == 9


def test_dense_row_past_its_tokens_is_refused():
    """A seq_len beyond the request's tokens would read padding page 0 as if it were KV."""
    P, r2t = hand_example()  # row 2 holds 5 tokens
    sel, lens = torch.full((1, 3), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ShapeError, match="forward_batch.seq_lens: expected lengths within each request's tokens"):
        to_attention_metadata(sel, lens, torch.tensor([False]), fb_of([9], [2]), r2t, P)
    table, kv, _ = to_attention_metadata(sel, lens, torch.tensor([False]), fb_of([5], [2]), r2t, P)
    assert table.tolist() == [[3, 9, 0]] and kv.tolist() == [5]
