"""The selection references (sparse_ref.selection) against brute force written from the spec in plain Python.

Inputs are drawn to be awkward: ties, NaN, -inf, +inf, -0.0, k larger than the row, lengths 0 and 1,
rows that are not powers of two, fp16 and bf16 scores.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref import ShapeError, SparseConfig, SparseRefError
from sparse_ref.selection import select_pages, select_pages_row, selection_width, topk_reference

SPECIAL = [float("nan"), float("-inf"), float("inf"), -0.0, 0.0, 1.0, -1.0, 0.5, 2.0]
score_values = st.one_of(st.sampled_from(SPECIAL), st.integers(-3, 3).map(float),
                         st.floats(-1e4, 1e4, allow_nan=False, width=16))


def is_candidate(x: float) -> bool:
    return not math.isnan(x) and x != float("-inf")


def brute_topk(row: list[float], k: int, length: int, order: str, width: int) -> list[int]:
    """Spec: candidates are j < length, not NaN, not -inf; best k by (score desc, id asc); -1 padded."""
    cands = [j for j in range(min(length, len(row))) if is_candidate(row[j])]
    best = sorted(cands, key=lambda j: (-(row[j] + 0.0), j))[:k]
    if order == "index":
        best.sort()
    return (best + [-1] * width)[:width]


@st.composite
def score_matrices(draw, max_rows=5, max_cols=19):
    R = draw(st.integers(0, max_rows))
    N = draw(st.integers(0, max_cols))
    rows = [[draw(score_values) for _ in range(N)] for _ in range(R)]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return torch.tensor(rows, dtype=torch.float32).reshape(R, N).to(dtype)


@given(scores=score_matrices(), k=st.integers(0, 25), data=st.data(), order=st.sampled_from(["score", "index"]))
def test_topk_reference_matches_brute_force(scores, k, data, order):
    R, N = scores.shape
    lengths = torch.tensor([data.draw(st.integers(0, N)) for _ in range(R)], dtype=torch.int64)
    out = topk_reference(scores, k, lengths, order=order)
    assert out.dtype == torch.int32 and out.shape == (R, k)
    rows = scores.float().tolist()
    for r in range(R):
        assert out[r].tolist() == brute_topk(rows[r], k, int(lengths[r]), order, k), (rows[r], k, int(lengths[r]))


@given(scores=score_matrices(), data=st.data())
def test_topk_reference_per_row_k_and_width(scores, data):
    R, N = scores.shape
    ks = torch.tensor([data.draw(st.integers(0, N + 3)) for _ in range(R)], dtype=torch.int64)
    width = data.draw(st.integers(0, N + 4))
    out = topk_reference(scores, ks, None, width=width)
    assert out.shape == (R, width)
    rows = scores.float().tolist()
    for r in range(R):
        assert out[r].tolist() == brute_topk(rows[r], int(ks[r]), N, "score", width)
    if R:
        assert topk_reference(scores, ks).shape == (R, int(ks.max()))


@pytest.mark.parametrize("bad", [-1, 9])
def test_topk_reference_refuses_lengths_outside_the_row(bad):
    """A length names how many entries of its row are valid: outside [0, N] it names entries that do not exist."""
    s = torch.zeros(2, 8)
    with pytest.raises(ShapeError, match=r"lengths: expected values in \[0, 8\]"):
        topk_reference(s, 2, torch.tensor([3, bad]))
    assert topk_reference(s, 2, torch.tensor([3, 8])).tolist() == [[0, 1], [0, 1]]


def test_topk_reference_handpicked():
    nan, inf = float("nan"), float("inf")
    s = torch.tensor([[1.0, nan, 3.0, -inf, 3.0, -0.0, 0.0, inf]])
    assert topk_reference(s, 8).tolist() == [[7, 2, 4, 0, 5, 6, -1, -1]]
    assert topk_reference(s, 3, order="index").tolist() == [[2, 4, 7]]
    assert topk_reference(s, 4, torch.tensor([1])).tolist() == [[0, -1, -1, -1]]
    assert topk_reference(s, 2, torch.tensor([0])).tolist() == [[-1, -1]]
    assert topk_reference(torch.tensor([[-0.0, 0.0, -0.0]]), 2).tolist() == [[0, 1]]  # the two zeros tie
    assert topk_reference(torch.full((2, 3), nan), 2).tolist() == [[-1, -1], [-1, -1]]
    assert topk_reference(torch.zeros(0, 5), 3).shape == (0, 3)


def test_topk_reference_errors():
    with pytest.raises(ShapeError, match="scores: expected dtype"):
        topk_reference(torch.zeros(2, 3, dtype=torch.int32), 1)
    with pytest.raises(ShapeError, match="scores: expected a 2-D"):
        topk_reference(torch.zeros(3), 1)
    with pytest.raises(SparseRefError, match=r"k: expected an int in \[0, 9223372036854775807\], got -1"):
        topk_reference(torch.zeros(2, 3), -1)
    with pytest.raises(SparseRefError, match=r"order: expected one of \('score', 'index'\)"):
        topk_reference(torch.zeros(2, 3), 1, order="desc")
    with pytest.raises(ShapeError, match="lengths: expected dtype"):
        topk_reference(torch.zeros(2, 3), 1, torch.zeros(2))


# ---------------------------------------------------------------- page selection


def brute_select(row: list[float], seq_len: int, P: int, c: SparseConfig, sparse: bool) -> list[int]:
    """The page rule of selection.py's docstring, written out in plain Python."""
    n = -(-seq_len // P)
    if not sparse or seq_len < c.min_sparse_seq_len or n == 0:
        return []
    recent = min(c.num_recent_pages, n)
    recent_start = n - recent
    sink = min(c.num_sink_pages, recent_start)
    k = c.history_budget(recent_start - sink)
    if sink + k + recent >= n:
        return []
    cands = [j for j in range(sink, recent_start) if is_candidate(row[j])]
    top = sorted(cands, key=lambda j: (-(row[j] + 0.0), j))[:k]
    return sorted(list(range(sink)) + top + list(range(recent_start, n)))


configs = st.builds(
    lambda recent, sink, min_len, ratio, budget, use_budget: SparseConfig(
        num_recent_pages=recent, num_sink_pages=sink, min_sparse_seq_len=min_len,
        keep_ratio=None if use_budget else ratio, page_budget=budget if use_budget else None),
    st.integers(1, 4), st.integers(0, 3), st.integers(0, 30), st.floats(0.01, 1.0), st.integers(1, 6), st.booleans(),
)


@given(scores=score_matrices(max_rows=6, max_cols=23), P=st.integers(1, 5), config=configs, data=st.data())
def test_select_pages_matches_row_version_and_brute_force(scores, P, config, data):
    bs, max_pages = scores.shape
    seq_lens = torch.tensor([data.draw(st.integers(0, max_pages * P)) for _ in range(bs)], dtype=torch.int64)
    mask = torch.tensor([data.draw(st.booleans()) for _ in range(bs)], dtype=torch.bool)
    selected, lengths = select_pages(scores, seq_lens, mask, P, config)
    W = selection_width(max_pages, config)
    assert selected.dtype == torch.int32 and lengths.dtype == torch.int32
    assert selected.shape == (bs, W) and lengths.shape == (bs,)
    assert W <= max_pages
    rows = scores.float().tolist()
    for r in range(bs):
        want = brute_select(rows[r], int(seq_lens[r]), P, config, bool(mask[r]))
        row = select_pages_row(scores[r], int(seq_lens[r]), P, config, sparse=bool(mask[r]))
        assert row.dtype == torch.int32 and row.tolist() == want
        assert int(lengths[r]) == len(want) <= W, "selection_width bounds every row"
        assert selected[r].tolist() == want + [-1] * (W - len(want))
        n = -(-int(seq_lens[r]) // P)
        assert all(0 <= p < n for p in want), "a row only names its own pages"
        if want:
            assert n - 1 in want, "the last page (the current token) is always kept"


@given(config=configs, max_pages=st.integers(0, 40), P=st.integers(1, 4))
def test_selection_width_is_reached_or_bounds(config, max_pages, P):
    """W bounds every possible row length; when some row goes sparse, the longest row reaches W."""
    W = selection_width(max_pages, config)
    scores = torch.randn(max_pages * P + 1, max_pages) if max_pages else torch.zeros(1, 0)
    seq = torch.arange(scores.shape[0], dtype=torch.int64)
    _, lengths = select_pages(scores, seq, torch.ones_like(seq, dtype=torch.bool), P, config)
    assert int(lengths.max()) <= W
    if int(lengths.max()) > 0 and config.min_sparse_seq_len <= max_pages * P:
        assert int(lengths[-1]) == W or int(lengths[-1]) == 0


def test_select_pages_handpicked():
    config = SparseConfig(num_recent_pages=2, num_sink_pages=1, page_budget=2)
    nan, inf = float("nan"), float("inf")
    # 10 pages of 4 tokens; history = pages 1..7
    s = torch.tensor([[9.0, 1.0, nan, 5.0, -inf, 5.0, inf, 0.0, 7.0, 7.0]])
    sel, n = select_pages(s, torch.tensor([38]), torch.tensor([True]), 4, config)
    assert sel.tolist() == [[0, 3, 6, 8, 9]] and n.tolist() == [5]
    # too short to gain anything: dense
    sel, n = select_pages(s, torch.tensor([20]), torch.tensor([True]), 4, config)
    assert n.tolist() == [0] and sel.tolist() == [[-1] * 5]
    sel, n = select_pages(s, torch.tensor([38]), torch.tensor([False]), 4, config)
    assert n.tolist() == [0]


def test_select_pages_input_errors():
    c = SparseConfig()
    s = torch.zeros(2, 4)
    ok_len, ok_mask = torch.tensor([3, 4]), torch.tensor([True, True])
    with pytest.raises(SparseRefError, match=r"seq_lens: expected values in \[0, 16\].*got min 3, max 17"):
        select_pages(s, torch.tensor([3, 17]), ok_mask, 4, c)
    with pytest.raises(ShapeError, match=r"seq_lens: expected 2 rows \(one per row of scores\), got shape \(3,\)"):
        select_pages(s, torch.tensor([1, 2, 3]), ok_mask, 4, c)
    with pytest.raises(ShapeError, match="sparse_mask: expected dtype torch.bool"):
        select_pages(s, ok_len, torch.tensor([1, 1]), 4, c)
    with pytest.raises(SparseRefError, match=r"page_size: expected an int in \[1, 2147483647\], got 0"):
        select_pages(s, ok_len, ok_mask, 0, c)


def test_reference_input_checks_name_the_argument():
    """Bad lengths, k and width shapes raise instead of broadcasting or cutting rows off."""
    import pytest

    from sparse_ref.config import SparseConfig
    from sparse_ref.errors import SparseRefError
    from sparse_ref.selection import select_pages, select_pages_row, selection_width, topk_reference

    scores = torch.randn(3, 10)
    with pytest.raises(SparseRefError, match="lengths"):
        topk_reference(scores, 2, torch.tensor([5]))
    with pytest.raises(SparseRefError, match="k: expected 3 rows"):
        topk_reference(scores, torch.tensor([2]))
    with pytest.raises(SparseRefError, match=r"k: expected values in \[0, "):
        topk_reference(scores, torch.tensor([2, -1, 3]))
    cfg = SparseConfig(page_budget=2, num_recent_pages=2)
    need = selection_width(10, cfg)
    seq = torch.tensor([160, 100, 3])
    mask = torch.ones(3, dtype=torch.bool)
    with pytest.raises(SparseRefError, match=rf"width: expected an int in \[{need}, inf\]"):
        select_pages(scores, seq, mask, 16, cfg, width=need - 1)
    wide, lengths = select_pages(scores, seq, mask, 16, cfg, width=need + 3)
    narrow, lengths2 = select_pages(scores, seq, mask, 16, cfg)
    assert torch.equal(wide[:, :need], narrow) and (wide[:, need:] == -1).all() and torch.equal(lengths, lengths2)
    with pytest.raises(SparseRefError, match="seq_len"):
        select_pages_row(scores[0, :3], 100, 16, cfg)
