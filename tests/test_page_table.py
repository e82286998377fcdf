"""The one-launch Triton adaptor (``kernels/page_table.py``) == the torch adaptor, exactly.

On CPU the kernel runs through Triton's interpreter (small shapes). Each case mixes dense rows
(``sparse_mask`` False or length 0) and sparse rows, lengths 0, 1 and page multiples, random
physical pages and request rows, and selections of every width.
"""

import types

import pytest
import torch
from aot_variants import PAGE_TABLE as AOT_VARIANTS
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_ref
from sparse_ref.adaptor import to_attention_metadata
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels.page_table import page_table_from_selection

DEVICE = sparse_ref.default_device()


def make_case(seq_lens, P, width, r2t_width=None, sparse_frac=0.6, seed=0, index_dtype=torch.int32,
              num_rows=None):
    """Random pool layout and a valid selection: (selected, lengths, mask, forward_batch, req_to_token)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    r2t_width = r2t_width or max([1, *seq_lens])
    num_rows = num_rows or bs + 2
    rows = torch.randperm(num_rows, generator=g)[:bs]
    total_pages = sum(-(-n // P) for n in seq_lens) + 1
    physical = (torch.randperm(total_pages * 3, generator=g)[:total_pages] + 1).tolist()  # never page 0
    r2t = torch.zeros(num_rows, r2t_width, dtype=torch.int32)
    r2t[:, :] = torch.randint(0, 1000, (num_rows, r2t_width), generator=g, dtype=torch.int32)  # stale slots
    selected = torch.full((bs, width), -1, dtype=index_dtype)
    lengths = torch.zeros(bs, dtype=index_dtype)
    mask = torch.rand(bs, generator=g) < sparse_frac
    for r, n_tok in enumerate(seq_lens):
        n = -(-n_tok // P)
        for j in range(n):
            page = physical.pop()
            for t in range(j * P, min(n_tok, (j + 1) * P)):
                r2t[rows[r], t] = page * P + t % P
        if n == 0 or width == 0 or not mask[r]:
            continue
        keep = int(torch.randint(0, min(width, n) + 1, (1,), generator=g))
        if keep == 0:
            continue  # a sparse-mask row with length 0 stays dense
        others = torch.randperm(n - 1, generator=g)[: keep - 1].sort().values if n > 1 else torch.zeros(0)
        kept = [*others.tolist(), n - 1]  # ascending, the last page last
        selected[r, : len(kept)] = torch.tensor(kept, dtype=index_dtype)
        lengths[r] = len(kept)
    fb = types.SimpleNamespace(seq_lens=torch.tensor(seq_lens, dtype=torch.int64), req_pool_indices=rows.long())
    return [t.to(DEVICE) for t in (selected, lengths, mask)] + [
        types.SimpleNamespace(seq_lens=fb.seq_lens.to(DEVICE), req_pool_indices=fb.req_pool_indices.to(DEVICE)),
        r2t.to(DEVICE)]


def assert_same(selected, lengths, mask, fb, r2t, P):
    want = to_attention_metadata(selected, lengths, mask, fb, r2t, P, backend="torch")
    got = to_attention_metadata(selected, lengths, mask, fb, r2t, P, backend="triton")
    for name, w, g_ in zip(("page_table", "kv_lens", "cu_kv_lens"), want, got, strict=True):
        assert g_.dtype == torch.int32 and g_.shape == w.shape, name
        assert torch.equal(g_.cpu(), w.cpu()), f"{name}:\n{g_}\n!=\n{w}"


@pytest.mark.parametrize("P", [1, 3, 16])
def test_mixed_rows_equal_torch(P):
    seq_lens = [0, 1, P, 2 * P, 5 * P + 1, 3 * P - 1, 7, 40]
    width = 5
    assert_same(*make_case(seq_lens, P, width, r2t_width=max(seq_lens) + 3, seed=P), P)


def test_all_dense_and_all_sparse():
    P = 4
    seq_lens = [33, 4, 1, 0, 16, 50]
    sel, lens, mask, fb, r2t = make_case(seq_lens, P, 6, r2t_width=52, sparse_frac=1.0, seed=1)
    assert_same(sel, lens, mask, fb, r2t, P)
    assert_same(sel, lens, torch.zeros_like(mask), fb, r2t, P)  # every row dense
    assert_same(sel, torch.zeros_like(lens), mask, fb, r2t, P)  # lengths 0: dense too


def test_selection_wider_than_the_context_and_int64_inputs():
    P = 2
    sel, lens, mask, fb, r2t = make_case([9, 3, 0], P, 12, r2t_width=10, sparse_frac=1.0, seed=2,
                                         index_dtype=torch.int64)
    assert_same(sel, lens, mask, fb, r2t, P)  # W_out = W = 12 > ceil(10 / 2)


def test_single_row_and_empty_batch():
    P = 16
    assert_same(*make_case([1000], P, 20, r2t_width=1024, sparse_frac=1.0, seed=3), P)
    sel, lens, mask, fb, r2t = make_case([], P, 4, r2t_width=32, seed=4)
    table, kv, cu = to_attention_metadata(sel, lens, mask, fb, r2t, P, backend="triton")
    assert table.shape == (0, 4) and kv.shape == (0,) and cu.tolist() == [0]


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=7), st.sampled_from([1, 2, 5, 8]),
       st.integers(1, 9), st.integers(0, 2**16))  # width 0: the torch checks cannot gather (not ours)
def test_random_layouts_equal_torch(seq_lens, P, width, seed):
    assert_same(*make_case(seq_lens, P, width, r2t_width=max(seq_lens) + seed % 5 + 1, seed=seed), P)


def test_writes_in_place_and_overwrites_stale_values():
    P = 4
    sel, lens, mask, fb, r2t = make_case([13, 0, 8], P, 3, r2t_width=20, seed=5)
    want = to_attention_metadata(sel, lens, mask, fb, r2t, P, backend="torch")
    out = tuple(torch.full_like(t, 777) for t in want)
    got = to_attention_metadata(sel, lens, mask, fb, r2t, P, out=out, backend="triton")
    assert all(a is b for a, b in zip(got, out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True))


def test_kernel_clamps_bad_values_into_the_row():
    """Unchecked values (as while a graph captures) never read outside the buffers or another row's pages."""
    P = 4
    sel, lens, mask, fb, r2t = make_case([12, 8], P, 3, r2t_width=12, sparse_frac=1.0, seed=6)
    bad_sel = torch.tensor([[99, -5, 2], [1, 0, 1]], dtype=torch.int32, device=DEVICE)
    bad_lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    table, kv, cu = page_table_from_selection(bad_sel, bad_lens, torch.ones(2, dtype=torch.bool, device=DEVICE),
                                              fb.seq_lens, fb.req_pool_indices, r2t, P, check_values=False)
    for r in range(2):
        n = -(-int(fb.seq_lens[r]) // P)
        own = {int(r2t[fb.req_pool_indices[r], j * P]) // P for j in range(n)}
        assert set(table[r].tolist()) <= own | {0}
    assert int(kv[1]) == (3 - 1) * P + 4  # lengths clamped to W = 3


def test_checks_raise_before_launch():
    P = 4
    sel, lens, mask, fb, r2t = make_case([12, 8], P, 3, r2t_width=12, seed=7)
    with pytest.raises(SparseRefError, match="lengths"):
        page_table_from_selection(sel, lens[:1], mask, fb.seq_lens, fb.req_pool_indices, r2t, P)
    with pytest.raises(SparseRefError, match="seq_lens"):
        page_table_from_selection(sel, lens, mask, fb.seq_lens + 100, fb.req_pool_indices, r2t, P)
    with pytest.raises(SparseRefError, match="req_pool_indices"):
        page_table_from_selection(sel, lens, mask, fb.seq_lens, fb.req_pool_indices + 50, r2t, P)
    with pytest.raises(SparseRefError, match="out page_table"):
        page_table_from_selection(sel, lens, mask, fb.seq_lens, fb.req_pool_indices, r2t, P,
                                  out=(torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
                                       torch.zeros(2, dtype=torch.int32, device=DEVICE),
                                       torch.zeros(3, dtype=torch.int32, device=DEVICE)))
    with pytest.raises(SparseRefError, match="backend"):
        to_attention_metadata(sel, lens, mask, fb, r2t, P, backend="cuda")


def test_aot_variants_listed():
    assert AOT_VARIANTS and all(len(v) == 4 for v in AOT_VARIANTS)


def test_many_rows_running_sum_crosses_chunks():
    """More rows than one chunk of the lengths program (64 under the interpreter): the carry is exercised."""
    P = 2
    g = torch.Generator().manual_seed(8)
    seq_lens = torch.randint(0, 9, (150,), generator=g).tolist()
    assert_same(*make_case(seq_lens, P, 3, r2t_width=10, seed=8), P)
