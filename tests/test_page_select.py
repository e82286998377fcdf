"""The fused Triton page selection (kernels/page_select.py) against ``select_pages`` and the loop.

The property cases follow the retrieval tests: random batch sizes, seq_lens of 0, 1, below a
page, exact multiples and long; keep ratios and fixed budgets; recent and sink counts; tied
and non-finite scores; and the split-row path forced at small sizes.
"""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_ref  # (interpreter set-up before the kernel import)
from sparse_ref.config import SparseConfig
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import page_select as page_select_module
from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels.page_select import select_pages_triton
from sparse_ref.selection import select_pages, select_pages_row, selection_width

DEVICE = sparse_ref.default_device()  # CUDA on a GPU machine, else CPU through the interpreter


def check_against_references(scores, seq_lens, mask, page_size, config, width=None, splits=None):
    got_sel, got_len = select_pages_triton(scores, seq_lens, mask, page_size, config, width, splits=splits)
    ref_sel, ref_len = select_pages(scores.cpu(), seq_lens.cpu(), mask.cpu(), page_size, config, width)
    assert torch.equal(got_sel.cpu(), ref_sel), (got_sel, ref_sel)
    assert torch.equal(got_len.cpu(), ref_len)
    # and the loop (what retrieve_topk_loop runs per request)
    for i in range(scores.shape[0]):
        row = select_pages_row(scores[i].cpu(), int(seq_lens[i]), page_size, config, sparse=bool(mask[i]))
        n = int(got_len[i])
        assert got_sel[i, :n].cpu().tolist() == row.tolist()[: got_sel.shape[1]]
    return got_sel, got_len


def page_scores(bs, max_pages, seed, ties, nonfinite, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 3, (bs, max_pages), generator=g).float() if ties else torch.randn(bs, max_pages, generator=g)
    if nonfinite and bs * max_pages:
        specials = torch.tensor([float("nan"), float("-inf"), float("inf"), -0.0])
        pick = torch.randint(0, 4, (bs, max_pages), generator=g)
        s = torch.where(torch.rand(bs, max_pages, generator=g) < 0.2, specials[pick], s)
    return s.to(device)


@st.composite
def configs(draw):
    if draw(st.booleans()):
        budget = dict(keep_ratio=draw(st.sampled_from([0.1, 0.25, 0.3, 0.5, 1 / 3, 0.7, 1.0])))
    else:
        budget = dict(page_budget=draw(st.integers(1, 6)))
    return SparseConfig(**budget, num_recent_pages=draw(st.integers(1, 3)), num_sink_pages=draw(st.integers(0, 2)),
                        min_sparse_seq_len=draw(st.sampled_from([0, 0, 5, 40])))


@settings(max_examples=25, deadline=None)
@given(bs=st.integers(1, 4), page_size=st.sampled_from([1, 3, 4, 16]), max_pages=st.integers(1, 24),
       config=configs(), ties=st.booleans(), nonfinite=st.booleans(), splits=st.sampled_from([None, 2, 3]),
       seed=st.integers(0, 2**16), data=st.data())
def test_property_matches_select_pages(bs, page_size, max_pages, config, ties, nonfinite, splits, seed, data):
    cap = max_pages * page_size
    lens = st.one_of(st.sampled_from([0, 1, min(page_size - 1, cap), cap, (cap // page_size) * page_size]),
                     st.integers(0, cap))
    seq_lens = torch.tensor(data.draw(st.lists(lens, min_size=bs, max_size=bs)), dtype=torch.int64, device=DEVICE)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), device=DEVICE)
    scores = page_scores(bs, max_pages, seed, ties, nonfinite)
    check_against_references(scores, seq_lens, mask, page_size, config, splits=splits)


def test_typical_batch_and_explicit_widths():
    """Long rows, short rows, a dense row; then wider static widths (narrower ones are refused)."""
    config = SparseConfig(keep_ratio=0.25, num_recent_pages=2, num_sink_pages=1)
    scores = page_scores(5, 40, seed=3, ties=True, nonfinite=True)
    seq_lens = torch.tensor([160, 3, 64, 0, 97], dtype=torch.int32, device=DEVICE)
    mask = torch.tensor([True, True, True, True, False], device=DEVICE)
    sel, lengths = check_against_references(scores, seq_lens, mask, 4, config)
    assert sel.shape == (5, selection_width(40, config))
    assert lengths[0] > 0 and lengths[4] == 0
    check_against_references(scores, seq_lens, mask, 4, config, width=40)
    check_against_references(scores, seq_lens, mask, 4, config, width=45, splits=2)


def test_tile_loop_path_matches(monkeypatch):
    """The one-program-per-row tile loop (rows too long for registers), forced at a small size."""
    monkeypatch.setitem(topk_module.TUNING, "register_row", 0)
    config = SparseConfig(keep_ratio=0.3, num_recent_pages=2, num_sink_pages=1)
    scores = page_scores(3, 30, seed=9, ties=True, nonfinite=True)
    seq_lens = torch.tensor([120, 57, 9], device=DEVICE)
    check_against_references(scores, seq_lens, torch.tensor([True, True, True], device=DEVICE), 4, config, splits=1)


def test_kernel_clamps_bad_seq_lens(monkeypatch):
    """While a graph captures there is no host check: a too-long seq_len is clamped to the scored pages."""
    monkeypatch.setattr(page_select_module, "capturing", lambda: True)
    config = SparseConfig(page_budget=2, num_recent_pages=1)
    scores = page_scores(2, 9, seed=4, ties=False, nonfinite=False)
    on = torch.tensor([True, True], device=DEVICE)
    sel, lengths = select_pages_triton(scores, torch.tensor([10**6, -4], device=DEVICE), on, 4, config)
    ref_sel, ref_len = select_pages(scores.cpu(), torch.tensor([36, 0]), on.cpu(), 4, config)
    assert torch.equal(sel.cpu(), ref_sel) and torch.equal(lengths.cpu(), ref_len)


@pytest.mark.parametrize("call, match", [
    (lambda s, q, m, c: select_pages_triton(s.double(), q, m, 4, c), "float32, float16 or bfloat16"),
    (lambda s, q, m, c: select_pages_triton(s[0], q, m, 4, c), "2-D"),
    (lambda s, q, m, c: select_pages_triton(s.t(), q[:1].repeat(12), m[:1].repeat(12), 4, c), "unit stride"),
    (lambda s, q, m, c: select_pages_triton(s, q.float(), m, 4, c), "seq_lens must be a 1-D"),
    (lambda s, q, m, c: select_pages_triton(s, q[:2], m, 4, c), "seq_lens must be a 1-D"),
    (lambda s, q, m, c: select_pages_triton(s, q, m.int(), 4, c), "sparse_mask must be a 1-D"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 0, c), "page_size must be a positive int"),
    (lambda s, q, m, c: select_pages_triton(s, q + 100, m, 4, c), r"seq_lens must lie in \[0, 48\]"),
    (lambda s, q, m, c: select_pages_triton(s, q - 100, m, 4, c), r"seq_lens must lie in \[0, 48\]"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, object()), "config must look like a SparseConfig"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, SimpleNamespace(**{**vars(c), "num_recent_pages": -1})),
     r"config.num_recent_pages must be an int >= 0"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, SimpleNamespace(**{**vars(c), "keep_ratio": 1.5})),
     r"config.keep_ratio must be in \(0, 1\]"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, SimpleNamespace(**{**vars(c), "page_budget": 0})),
     r"config.page_budget must be an int >= 1"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, c, width=-1), "width must be an int >= "),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, c, width=2), "narrower output would cut rows off"),
    (lambda s, q, m, c: select_pages_triton(s, q.to("meta"), m, 4, c), "same device"),
])
def test_input_errors(call, match):
    scores = torch.randn(3, 12, device=DEVICE)
    with pytest.raises(SparseRefError, match=match) as info:
        call(scores, torch.tensor([5, 40, 48], device=DEVICE), torch.tensor([True, False, True], device=DEVICE),
             SparseConfig())
    assert "Fix" in str(info.value) or "config." in str(info.value)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_gpu_benchmark_shape(splits):
    """32 x 8192 pages, k = 128, 4 recent pages (the benchmark shape), ties and NaN included."""
    config = SparseConfig(page_budget=128, num_recent_pages=4)
    scores = page_scores(32, 8192, seed=5, ties=False, nonfinite=True, device="cuda")
    scores[3] = 0.5
    seq_lens = torch.randint(1, 8192 * 16 + 1, (32,), device="cuda")
    seq_lens[0] = 8192 * 16
    mask = torch.ones(32, dtype=torch.bool, device="cuda")
    check_against_references(scores, seq_lens, mask, 16, config, splits=splits)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    config = SparseConfig(keep_ratio=0.1, num_recent_pages=4, num_sink_pages=1)
    bs, pages = 16, 2048
    scores = page_scores(bs, pages, seed=6, ties=True, nonfinite=True, device="cuda")
    seq_lens = torch.randint(0, pages * 16 + 1, (bs,), device="cuda")
    mask = torch.rand(bs, device="cuda") < 0.8
    select_pages_triton(scores, seq_lens, mask, 16, config)  # compile + cache the budget table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sel, lengths = select_pages_triton(scores, seq_lens, mask, 16, config)
    for seed in (7, 8):
        scores.copy_(page_scores(bs, pages, seed=seed, ties=True, nonfinite=True))
        seq_lens.copy_(torch.randint(0, pages * 16 + 1, (bs,)))
        sel.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        ref_sel, ref_len = select_pages(scores.cpu(), seq_lens.cpu(), mask.cpu(), 16, config)
        assert torch.equal(sel.cpu(), ref_sel) and torch.equal(lengths.cpu(), ref_len)


@pytest.mark.gpu
def test_gpu_quest_retrieve_topk_triton_equals_loop():
    """The GPU backend of the batched retrieve_topk returns exactly what the per-request loop does."""
    from sparse_ref.workloads import make_quest_decode_setup

    setup = make_quest_decode_setup(bs=8, ctx=4096, page_size=16, device="cuda", selection_backend="triton")
    sel, lengths = setup.retrieve()
    ref_sel, ref_len = setup.retrieve(loop=True)
    assert torch.equal(sel, ref_sel) and torch.equal(lengths, ref_len)
