"""The fused Triton page selection (kernels/page_select.py) against ``select_pages`` and the loop.

The property cases follow the retrieval tests: random batch sizes, seq_lens of 0, 1, below a
page, exact multiples and long; keep ratios and fixed budgets; recent and sink counts; tied
and non-finite scores; each by every plan of a row in registers (``KNOBS``): the plan the shapes pick,
direct (with and without the pairwise rank of the last bin: window rounds down to one key value), and
the delegates plan (with 2 slots every row overflows into its fallback).
"""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_ref  # (interpreter set-up before the kernel import)
from sparse_ref import checks
from sparse_ref.adaptor import to_attention_metadata
from sparse_ref.backend import choose_backend
from sparse_ref.config import SparseConfig
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import page_select as page_select_module
from sparse_ref.kernels.page_select import select_pages_to_table, select_pages_triton
from sparse_ref.selection import select_pages, select_pages_row, selection_width

DEVICE = sparse_ref.default_device()  # CUDA on a GPU machine, else CPU through the interpreter
BIG = 1 << 20
KNOBS = [{}, {"direct_ratio": BIG}, {"direct_ratio": BIG, "short_pair": 0}, {"direct_ratio": 0},
         {"direct_ratio": 0, "slots": 2}]  # the shapes' plan; direct (+ no pairwise rank); delegates (+ overflow)


def check_against_references(scores, seq_lens, mask, page_size, config, width=None):
    got_sel, got_len = select_pages_triton(scores, seq_lens, mask, page_size, config, width)
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


@pytest.mark.knobs
@settings(max_examples=25, deadline=None)
@given(bs=st.integers(1, 4), page_size=st.sampled_from([1, 3, 4, 16]), max_pages=st.integers(1, 24),
       config=configs(), ties=st.booleans(), nonfinite=st.booleans(), knobs=st.sampled_from(KNOBS),
       seed=st.integers(0, 2**16), data=st.data())
def test_property_matches_select_pages(bs, page_size, max_pages, config, ties, nonfinite, knobs, seed, data):
    cap = max_pages * page_size
    lens = st.one_of(st.sampled_from([0, 1, min(page_size - 1, cap), cap, (cap // page_size) * page_size]),
                     st.integers(0, cap))
    seq_lens = torch.tensor(data.draw(st.lists(lens, min_size=bs, max_size=bs)), dtype=torch.int64, device=DEVICE)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), device=DEVICE)
    scores = page_scores(bs, max_pages, seed, ties, nonfinite)
    saved = dict(page_select_module.TUNING)
    page_select_module.TUNING.update(knobs)
    try:
        check_against_references(scores, seq_lens, mask, page_size, config)
    finally:
        page_select_module.TUNING.update(saved)


@pytest.mark.parametrize("page_size", [1, 4])
def test_min_sparse_seq_len_boundary_through_the_kernel(page_size):
    """A row of exactly ``min_sparse_seq_len`` tokens goes sparse; one token shorter stays dense (``>=``)."""
    cfg = SparseConfig(page_budget=1, num_recent_pages=1, min_sparse_seq_len=6 * page_size + 1)
    at = cfg.min_sparse_seq_len
    seq = torch.tensor([at, at - 1, at + 1], device=DEVICE)
    sel, lens = check_against_references(page_scores(3, 8, 1, False, False), seq, torch.ones(3, dtype=torch.bool,
                                         device=DEVICE), page_size, cfg)
    assert lens.tolist()[0] == 2 and lens.tolist()[1] == 0 and lens.tolist()[2] == 2, lens


def test_rows_with_fewer_pages_than_sink_and_recent_stay_dense():
    """n < sink + recent: the history is empty, the budget table is read at entry 0 (the kernel clamps that read)."""
    cfg = SparseConfig(page_budget=2, num_recent_pages=3, num_sink_pages=2)
    seq = torch.tensor([1, 4, 9, 17, 20, 0], device=DEVICE)  # 1 .. 5 pages of 4, and an empty row
    sel, lens = check_against_references(page_scores(6, 6, 2, False, False), seq,
                                         torch.ones(6, dtype=torch.bool, device=DEVICE), 4, cfg)
    assert lens[:5].tolist() == [0] * 5 and int(lens[5]) == 0, "no row of <= sink + recent pages goes sparse"
    assert bool((sel[:5] == -1).all())


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
    check_against_references(scores, seq_lens, mask, 4, config, width=45)


@pytest.mark.knobs
@pytest.mark.parametrize("knobs", KNOBS[1:])
def test_adversarial_history(monkeypatch, knobs):
    """Ascending, periodic and plateau histories, by every plan (``KNOBS``)."""
    for name, value in knobs.items():
        monkeypatch.setitem(page_select_module.TUNING, name, value)
    config = SparseConfig(page_budget=5, num_recent_pages=2, num_sink_pages=1)
    n = 300
    period = torch.randn(16, generator=torch.Generator().manual_seed(1))
    scores = torch.stack([torch.arange(n).float(), period.repeat(n // 16 + 1)[:n],
                          torch.where(torch.arange(n) % 4 == 0, 1.0, 0.0), torch.full((n,), -0.0)]).to(DEVICE)
    seq_lens = torch.tensor([n * 4, n * 4 - 3, 777, n * 4], device=DEVICE)
    check_against_references(scores, seq_lens, torch.ones(4, dtype=torch.bool, device=DEVICE), 4, config)


@pytest.mark.knobs
@pytest.mark.parametrize("spread", [1e-3, 1e-6])
@pytest.mark.parametrize("knobs", [*KNOBS[1:4], {"direct_ratio": 0, "slots": 16}])
def test_packed_scores_are_exact(monkeypatch, spread, knobs):
    """Scores packed in a narrow range (like Quest bounds: ~5700 +- 2%) share their top 16 bits, so radix
    rounds on fixed bits would see one bin; the window rounds work on the scores' own range (and at 1e-6
    many scores tie exactly in fp32). The delegates plan must reach the exact k-th delegate (16 slots: ~85
    candidates at 16 bits, 7 at the exact delegate). Every plan."""
    for name, value in knobs.items():
        monkeypatch.setitem(page_select_module.TUNING, name, value)
    config = SparseConfig(page_budget=7, num_recent_pages=2, num_sink_pages=1)
    g = torch.Generator().manual_seed(11)
    scores = (5700.0 * (1 + spread * torch.randn(3, 90, generator=g))).to(DEVICE)
    seq_lens = torch.tensor([360, 301, 90 * 4 - 5], device=DEVICE)
    check_against_references(scores, seq_lens, torch.ones(3, dtype=torch.bool, device=DEVICE), 4, config)


def pool_layout(seq_lens, page_size, r2t_width, seed):
    """A req_to_token with random physical pages (never page 0, stale slots past each row) and random rows."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    num_rows = bs + 2
    rows = torch.randperm(num_rows, generator=g)[:bs]
    r2t = torch.randint(0, 1000, (num_rows, r2t_width), generator=g, dtype=torch.int32)
    total = sum(-(-n // page_size) for n in seq_lens) + 1
    physical = (torch.randperm(total * 3, generator=g)[:total] + 1).tolist()
    for r, n_tok in enumerate(seq_lens):
        for j in range(-(-n_tok // page_size)):
            page = physical.pop()
            t = torch.arange(j * page_size, min(n_tok, (j + 1) * page_size))
            r2t[rows[r], t] = (page * page_size + t % page_size).to(torch.int32)
    return rows.to(DEVICE), r2t.to(DEVICE)


def check_fused_table(scores, seq_lens, mask, page_size, config, rows, r2t, out=None):
    """select_pages_to_table == select_pages followed by the torch adaptor, all five outputs."""
    got = select_pages_to_table(scores, seq_lens, mask, page_size, config, rows, r2t, out=out)
    sel, lens = select_pages(scores.cpu(), seq_lens.cpu(), mask.cpu(), page_size, config)
    fb = types.SimpleNamespace(seq_lens=seq_lens.cpu(), req_pool_indices=rows.cpu())
    want = (sel, lens, *to_attention_metadata(sel, lens, mask.cpu(), fb, r2t.cpu(), page_size, backend="torch"))
    for name, g_, w in zip(("selected", "lengths", "page_table", "kv_lens", "cu_kv_lens"), got, want, strict=True):
        assert g_.dtype == torch.int32 and torch.equal(g_.cpu(), w), f"{name}:\n{g_}\n!=\n{w}"
    return got


@settings(max_examples=15, deadline=None)
@given(bs=st.integers(1, 5), page_size=st.sampled_from([1, 3, 16]), max_pages=st.integers(1, 20),
       extra=st.integers(0, 9), config=configs(), ties=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_fused_page_table_matches_select_then_adaptor(bs, page_size, max_pages, extra, config, ties, seed, data):
    r2t_width = max_pages * page_size + extra  # the table may be wider than the scored pages
    cap = max_pages * page_size
    lens = st.one_of(st.sampled_from([0, 1, cap, (cap // page_size) * page_size]), st.integers(0, cap))
    seq_list = data.draw(st.lists(lens, min_size=bs, max_size=bs))
    seq_lens = torch.tensor(seq_list, dtype=torch.int64, device=DEVICE)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), device=DEVICE)
    rows, r2t = pool_layout(seq_list, page_size, r2t_width, seed)
    check_fused_table(page_scores(bs, max_pages, seed, ties, nonfinite=ties), seq_lens, mask, page_size, config,
                      rows, r2t)


def test_fused_page_table_into_buffers_twice():
    """Written into preallocated buffers; a second call (the counter was reset) is right again."""
    config = SparseConfig(page_budget=3, num_recent_pages=2, num_sink_pages=1)
    seq_list = [70, 0, 13, 64, 5]
    rows, r2t = pool_layout(seq_list, 4, 72, seed=2)
    seq_lens = torch.tensor(seq_list, device=DEVICE)
    mask = torch.tensor([True, True, True, False, True], device=DEVICE)
    out = (torch.zeros(5, 18, dtype=torch.int32, device=DEVICE), torch.zeros(5, dtype=torch.int32, device=DEVICE),
           torch.zeros(6, dtype=torch.int32, device=DEVICE))
    for seed in (1, 2):
        got = check_fused_table(page_scores(5, 18, seed, ties=True, nonfinite=False), seq_lens, mask, 4, config,
                                rows, r2t, out=out)
        assert got[2] is out[0] and got[4] is out[2]
    one = check_fused_table(page_scores(1, 18, 5, ties=False, nonfinite=False), seq_lens[:1], mask[:1], 4, config,
                            rows[:1], r2t)  # bs=1: cu_kv_lens without the counter
    assert one[4].tolist() == [0, int(one[3][0])] and int(one[1][0]) == 1 + 3 + 2
    with pytest.raises(SparseRefError, match="out page_table: expected shape"):
        select_pages_to_table(page_scores(5, 18, 1, False, False), seq_lens, mask, 4, config, rows, r2t,
                              out=(out[0][:, :3], out[1], out[2]))
    with pytest.raises(SparseRefError, match="req_pool_indices: expected values in"):
        select_pages_to_table(page_scores(5, 18, 1, False, False), seq_lens, mask, 4, config, rows + 100, r2t)
    with pytest.raises(SparseRefError, match="req_to_token: expected dtype"):
        select_pages_to_table(page_scores(5, 18, 1, False, False), seq_lens, mask, 4, config, rows, r2t.long())


def test_fused_page_table_empty_batch_and_no_pages():
    """bs=0 (cu_kv_lens = [0]) and scores of 0 pages (every row dense, the table lists the rows' pages)."""
    config = SparseConfig(page_budget=2, num_recent_pages=1)
    rows, r2t = pool_layout([0, 0], 4, 12, seed=4)
    empty = select_pages_to_table(torch.zeros(0, 3, device=DEVICE), torch.zeros(0, dtype=torch.long, device=DEVICE),
                                  torch.zeros(0, dtype=torch.bool, device=DEVICE), 4, config, rows[:0], r2t)
    assert [tuple(t.shape) for t in empty] == [(0, 3), (0,), (0, 3), (0,), (1,)] and empty[4].tolist() == [0]
    check_fused_table(torch.zeros(2, 0, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE),
                      torch.tensor([True, False], device=DEVICE), 4, config, rows, r2t)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_retrieve_attention_metadata_equals_retrieve_then_adaptor(backend):
    """retrieve_attention_metadata (on the Triton side the fused selection + table) returns what retrieve_topk
    followed by the torch adaptor returns; a table of the wrong dtype is refused."""
    from sparse_ref.workloads import make_quest_decode_setup

    config = SparseConfig(page_budget=5, num_recent_pages=2, num_sink_pages=1)
    s = make_quest_decode_setup(bs=3, ctx=203, page_size=4, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                config=config, device=DEVICE, backend=backend)
    s.sparse_mask[1] = False
    r2t = s.workload.req_to_token
    got = s.algorithm.retrieve_attention_metadata(s.queries, 0, s.req_pool_indices, s.sparse_mask, s.forward_batch, r2t)
    sel, lens = s.algorithm.retrieve_topk(s.queries, 0, s.req_pool_indices, s.sparse_mask,
                                          forward_batch=s.forward_batch)
    want = (sel, lens, *to_attention_metadata(sel, lens, s.sparse_mask, s.forward_batch, r2t, 4))  # the torch table
    for name, g_, w in zip(("selected", "lengths", "page_table", "kv_lens", "cu_kv_lens"), got, want, strict=True):
        assert torch.equal(g_.cpu(), w.cpu()), name
    assert int(got[1][0]) == 1 + 5 + 2 and int(got[1][1]) == 0
    with pytest.raises(SparseRefError, match="req_to_token"):
        s.algorithm.retrieve_attention_metadata(s.queries, 0, s.req_pool_indices, s.sparse_mask, s.forward_batch,
                                                r2t.long())


def test_rows_too_long_for_registers(monkeypatch):
    """Beyond MAX_REGISTER_PAGES the kernel refuses; the Triton backend then runs the torch selection."""
    monkeypatch.setattr(page_select_module, "MAX_REGISTER_PAGES", 16)
    config = SparseConfig(keep_ratio=0.3, num_recent_pages=2, num_sink_pages=1)
    scores = page_scores(3, 30, seed=9, ties=True, nonfinite=True)
    seq_lens = torch.tensor([120, 57, 9], device=DEVICE)
    mask = torch.tensor([True, True, True], device=DEVICE)
    with pytest.raises(SparseRefError, match="at most 16 pages per row"):
        select_pages_triton(scores, seq_lens, mask, 4, config)
    triton = choose_backend("triton", DEVICE)
    got = triton.select_pages(scores, seq_lens, mask, 4, config)
    want = select_pages(scores, seq_lens, mask, 4, config)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rows, r2t = torch.arange(3, device=DEVICE), torch.arange(1, 1 + 3 * 120, dtype=torch.int32, device=DEVICE)
    fused = triton.select_to_table(scores, seq_lens, mask, 4, config, rows, r2t.view(3, 120))
    assert torch.equal(fused[0], want[0]) and torch.equal(fused[1], want[1])  # (the table: one Triton launch)


def test_kernel_clamps_bad_seq_lens(monkeypatch):
    """While a graph captures there is no host check: a too-long seq_len is clamped to the scored pages."""
    monkeypatch.setattr(checks, "capturing", lambda: True)
    config = SparseConfig(page_budget=2, num_recent_pages=1)
    scores = page_scores(2, 9, seed=4, ties=False, nonfinite=False)
    on = torch.tensor([True, True], device=DEVICE)
    sel, lengths = select_pages_triton(scores, torch.tensor([10**6, -4], device=DEVICE), on, 4, config)
    ref_sel, ref_len = select_pages(scores.cpu(), torch.tensor([36, 0]), on.cpu(), 4, config)
    assert torch.equal(sel.cpu(), ref_sel) and torch.equal(lengths.cpu(), ref_len)


@pytest.mark.parametrize("call, match", [
    (lambda s, q, m, c: select_pages_triton(s.double(), q, m, 4, c), "float32 or torch.float16"),
    (lambda s, q, m, c: select_pages_triton(s[0], q, m, 4, c), "2-D"),
    (lambda s, q, m, c: select_pages_triton(s.t(), q[:1].repeat(12), m[:1].repeat(12), 4, c), "unit stride"),
    (lambda s, q, m, c: select_pages_triton(s, q.float(), m, 4, c), "seq_lens: expected dtype"),
    (lambda s, q, m, c: select_pages_triton(s, q[:2], m, 4, c), r"seq_lens: expected shape \[3\]"),
    (lambda s, q, m, c: select_pages_triton(s, q, m.int(), 4, c), "sparse_mask: expected dtype torch.bool"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 0, c), r"page_size: expected an int in \[1"),
    (lambda s, q, m, c: select_pages_triton(s, q + 100, m, 4, c), r"seq_lens: expected values in \[0, 48\]"),
    (lambda s, q, m, c: select_pages_triton(s, q - 100, m, 4, c), r"seq_lens: expected values in \[0, 48\]"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, object()), "config: expected a sparse_ref.SparseConfig"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, c, width=-1), "width: expected an int in"),
    (lambda s, q, m, c: select_pages_triton(s, q, m, 4, c, width=2), "width: expected an int in"),
    (lambda s, q, m, c: select_pages_triton(s, q.to("meta"), m, 4, c), "seq_lens: expected a tensor with data"),
    (lambda s, q, m, c: select_pages_triton(s, q, m.to("meta"), 4, c), "sparse_mask: expected a tensor with data"),
])
def test_input_errors(call, match):
    scores = torch.randn(3, 12, device=DEVICE)
    with pytest.raises(SparseRefError, match=match) as info:
        call(scores, torch.tensor([5, 40, 48], device=DEVICE), torch.tensor([True, False, True], device=DEVICE),
             SparseConfig())
    assert "Fix" in str(info.value)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOBS[1:])
def test_gpu_benchmark_shape(monkeypatch, knobs):
    """32 x 8192 pages, k = 128, 4 recent pages (the benchmark shape), ties and NaN included."""
    config = SparseConfig(page_budget=128, num_recent_pages=4)
    scores = page_scores(32, 8192, seed=5, ties=False, nonfinite=True, device="cuda")
    scores[3] = 0.5
    seq_lens = torch.randint(1, 8192 * 16 + 1, (32,), device="cuda")
    seq_lens[0] = 8192 * 16
    mask = torch.ones(32, dtype=torch.bool, device="cuda")
    for name, value in knobs.items():  # (this shape picks the delegates plan: 8192 pages, k = 128)
        monkeypatch.setitem(page_select_module.TUNING, name, value)
    check_against_references(scores, seq_lens, mask, 16, config)


@pytest.mark.gpu
@pytest.mark.parametrize("pages", [2048, 8192])
def test_gpu_packed_quest_like_rows(pages):
    """bs=1 and bs=4 rows of Quest-like packed scores (5700 +- 2%, bf16-coarse: many exact ties) at the
    decode-step shapes (32K and 128K tokens of page 16, budget 123 + 1 sink + 4 recent)."""
    config = SparseConfig(page_budget=123, num_recent_pages=4, num_sink_pages=1)
    g = torch.Generator().manual_seed(pages)
    for bs in (1, 4):
        scores = 5700.0 * (1 + 0.02 * torch.randn(bs, pages, generator=g))
        scores = scores.to(torch.bfloat16).float().to("cuda")  # coarse: ties
        seq_lens = torch.full((bs,), pages * 16, device="cuda")
        seq_lens[-1] -= 7
        check_against_references(scores, seq_lens, torch.ones(bs, dtype=torch.bool, device="cuda"), 16, config)


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

    setup = make_quest_decode_setup(bs=8, ctx=4096, page_size=16, device="cuda", backend="triton")
    sel, lengths = setup.retrieve()
    ref_sel, ref_len = setup.retrieve(loop=True)
    assert torch.equal(sel, ref_sel) and torch.equal(lengths, ref_len)


@pytest.mark.gpu
def test_gpu_fused_page_table_graph_replays():
    """select_pages_to_table captured once in a CUDA graph, replayed on new scores and lengths: every output
    equals select_pages + the torch adaptor (the in-kernel counter resets itself between replays)."""
    config = SparseConfig(page_budget=123, num_recent_pages=4, num_sink_pages=1)
    bs, pages, P = 6, 2048, 16
    seq_list = [pages * P, 1, 0, 5000, pages * P - 9, 777]
    rows, r2t = pool_layout(seq_list, P, pages * P + 5, seed=3)
    seq_lens = torch.tensor(seq_list, device="cuda")
    mask = torch.tensor([True, True, True, True, True, False], device="cuda")
    scores = page_scores(bs, pages, seed=1, ties=False, nonfinite=True, device="cuda")
    out = (torch.zeros(bs, pages + 1, dtype=torch.int32, device="cuda"), torch.zeros(bs, dtype=torch.int32,
           device="cuda"), torch.zeros(bs + 1, dtype=torch.int32, device="cuda"))
    check_fused_table(scores, seq_lens, mask, P, config, rows, r2t, out=out)  # compile, eager check
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = select_pages_to_table(scores, seq_lens, mask, P, config, rows, r2t, out=out)
    for seed in (2, 3, 4):
        scores.copy_(5700.0 * (1 + 0.02 * page_scores(bs, pages, seed=seed, ties=False, nonfinite=False)))
        seq_lens[3] = 100 * seed
        graph.replay()
        torch.cuda.synchronize()
        sel, lens = select_pages(scores.cpu(), seq_lens.cpu(), mask.cpu(), P, config)
        fb = types.SimpleNamespace(seq_lens=seq_lens.cpu(), req_pool_indices=rows.cpu())
        want = (sel, lens, *to_attention_metadata(sel, lens, mask.cpu(), fb, r2t.cpu(), P, backend="torch"))
        for name, g_, w in zip(("selected", "lengths", "page_table", "kv_lens", "cu_kv_lens"), got, want,
                               strict=True):
            assert torch.equal(g_.cpu(), w), name
