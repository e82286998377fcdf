"""The Triton Quest page-score kernel == the torch reference; its input checks; Quest retrieval on it == the loop.

Runs on CPU through Triton's interpreter (small sizes); the CUDA-graph test needs a GPU.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sparse_ref  # noqa: F401  (turns on the interpreter without a GPU, before the kernel module)
from sparse_ref import SparseConfig
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.algorithms.quest import quest_page_scores_reference, split_query_sign
from sparse_ref.errors import ConfigError, ShapeError, SparseRefError
from sparse_ref.kernels import quest as quest_kernels
from sparse_ref.kernels import tuning
from sparse_ref.kernels.quest import quest_page_scores
from sparse_ref.workloads import make_quest_decode_setup

DEVICE = sparse_ref.default_device()


def make_inputs(bs, max_pages, num_kv_heads, head_dim, *, num_pages=None, group=2, gqa_mode="mean",
                bound_dtype=torch.float32, seed=0, device=DEVICE):
    """Random bounds (min <= max), some invalid pages, page ids repeated across rows, queries of both signs."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = num_pages or max(2, bs * max_pages // 2 + 1)  # fewer pages than slots: rows share pages
    a = torch.randn(num_pages, num_kv_heads, head_dim, generator=gen)
    b = torch.randn(num_pages, num_kv_heads, head_dim, generator=gen)
    page_min, page_max = torch.minimum(a, b).to(bound_dtype), torch.maximum(a, b).to(bound_dtype)
    page_valid = torch.rand(num_pages, generator=gen) > 0.25
    page_valid[0] = False  # page 0 is padding in the pool
    pages = torch.randint(0, num_pages, (bs, max_pages), generator=gen)
    if bs > 1 and max_pages > 0:
        pages[1, 0] = pages[0, 0]  # the same physical page in two rows
    q = torch.randn(bs, num_kv_heads * group, head_dim, generator=gen) * 2
    q_pos, q_neg = split_query_sign(q, num_kv_heads, head_dim, gqa_mode)
    to = dict(device=device)
    return (q_pos.to(**to), q_neg.to(**to), page_min.to(**to), page_max.to(**to), page_valid.to(**to),
            pages.to(**to))


def assert_matches_reference(inputs, **knobs):
    """The kernel (launch ``knobs`` set in its TUNING table) against the torch reference."""
    q_pos, q_neg, page_min, page_max, page_valid, pages = inputs
    with tuning(quest_kernels.TUNING, **knobs):
        got = quest_page_scores(*inputs)
    want = quest_page_scores_reference(*inputs)
    assert got.dtype == torch.float32 and got.shape == pages.shape
    invalid = ~page_valid[pages.long()]
    assert bool(torch.isneginf(got[invalid]).all()), "an invalid page must score exactly -inf"
    assert bool(torch.isfinite(got[~invalid]).all())
    scale = (q_pos.abs().sum(dim=(1, 2)) + q_neg.abs().sum(dim=(1, 2)))[:, None].expand_as(want)
    torch.testing.assert_close(got[~invalid], want[~invalid], rtol=1e-5, atol=1e-6 * float(scale.max()) + 1e-6)
    return got


@pytest.mark.parametrize("bs,max_pages,num_kv_heads,head_dim", [
    (1, 1, 1, 8), (3, 7, 3, 12), (3, 33, 1, 16), (1, 33, 3, 8), (3, 1, 3, 16), (1, 7, 1, 12),
])
@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_kernel_matches_reference_awkward_sizes(bs, max_pages, num_kv_heads, head_dim, gqa_mode):
    inputs = make_inputs(bs, max_pages, num_kv_heads, head_dim, gqa_mode=gqa_mode, seed=bs * 100 + max_pages)
    assert_matches_reference(inputs)


@given(st.integers(1, 3), st.integers(1, 40), st.sampled_from([1, 2, 3]), st.sampled_from([8, 12, 16, 20]),
       st.sampled_from(["mean", "per_kv_head"]), st.integers(0, 2**31 - 1),
       st.sampled_from([(None, None, None), (2, 16, 1), (4, 32, 2), (32, 8, 4)]))
def test_kernel_matches_reference_random(bs, max_pages, num_kv_heads, head_dim, gqa_mode, seed, knobs):
    """Fresh inputs; launch knobs that split the page and H_kv*D loops differently must not change the result."""
    inputs = make_inputs(bs, max_pages, num_kv_heads, head_dim, gqa_mode=gqa_mode, seed=seed)
    block_p, block_hd, num_warps = knobs
    assert_matches_reference(inputs, block_p=block_p, block_hd=block_hd, num_warps=num_warps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_bounds_accumulate_in_fp32(dtype):
    assert_matches_reference(make_inputs(3, 7, 3, 12, bound_dtype=dtype, seed=5))


def test_all_invalid_and_int32_pages_and_out_buffer():
    q_pos, q_neg, page_min, page_max, page_valid, pages = make_inputs(3, 7, 1, 8, seed=1)
    out = torch.full(pages.shape, 123.0, device=DEVICE)
    got = quest_page_scores(q_pos, q_neg, page_min, page_max, torch.zeros_like(page_valid), pages.int(), out=out)
    assert got.data_ptr() == out.data_ptr() and bool(torch.isneginf(out).all())
    assert_matches_reference((q_pos, q_neg, page_min, page_max, page_valid, pages.int()))


def test_empty_batch_and_no_pages():
    q_pos, q_neg, page_min, page_max, page_valid, _ = make_inputs(1, 3, 1, 8)
    assert quest_page_scores(q_pos[:0], q_neg[:0], page_min, page_max, page_valid,
                             torch.zeros(0, 3, dtype=torch.long, device=DEVICE)).shape == (0, 3)
    assert quest_page_scores(q_pos, q_neg, page_min, page_max, page_valid,
                             torch.zeros(1, 0, dtype=torch.long, device=DEVICE)).shape == (1, 0)


def test_flat_queries_are_accepted():
    q_pos, q_neg, *rest = make_inputs(3, 7, 3, 12, seed=2)
    torch.testing.assert_close(quest_page_scores(q_pos.flatten(1), q_neg.flatten(1), *rest),
                               quest_page_scores(q_pos, q_neg, *rest))


def _bad(inputs, **change):
    names = ["q_pos", "q_neg", "page_min", "page_max", "page_valid", "pages"]
    args = dict(zip(names, inputs, strict=True))
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (lambda a: {"pages": a["pages"] + a["page_min"].shape[0]}, r"pages: expected values in \[0, "),
    (lambda a: {"pages": a["pages"] - 100}, r"pages: expected values in \[0, "),
    (lambda a: {"pages": a["pages"].float()}, "pages: expected dtype"),
    (lambda a: {"pages": a["pages"][0]}, "pages: expected a 2-D"),
    (lambda a: {"pages": a["pages"].t().contiguous().t()}, "pages: expected a contiguous"),
    (lambda a: {"q_pos": a["q_pos"].double()}, "q_pos: expected dtype"),
    (lambda a: {"q_neg": a["q_neg"][:, :1]}, "q_neg: expected shape"),
    (lambda a: {"q_pos": a["q_pos"][:1]}, r"q_pos: expected shape \[3, 3, 12\]"),
    (lambda a: {"page_max": a["page_max"][:-1]}, "page_max: expected shape"),
    (lambda a: {"page_max": a["page_max"].half()}, "page_max: expected dtype"),
    (lambda a: {"page_min": a["page_min"].int(), "page_max": a["page_max"].int()}, "page_min: expected dtype"),
    (lambda a: {"page_valid": a["page_valid"].int()}, "page_valid: expected dtype"),
    (lambda a: {"page_valid": a["page_valid"][:-1]}, "page_valid: expected shape"),
    (lambda a: {"page_min": a["page_min"].transpose(1, 2).contiguous().transpose(1, 2)}, "page_min: expected a contig"),
    (lambda a: {"q_pos": a["q_pos"].tolist()}, "q_pos: expected a torch.Tensor"),
])
def test_bad_inputs_raise_before_launch(change, match):
    inputs = make_inputs(3, 7, 3, 12, seed=3)
    args = _bad(inputs)
    args.update(change(args))
    with pytest.raises(ShapeError, match=match) as info:
        quest_page_scores(**args)
    assert "Fix:" in str(info.value)


def test_bad_launch_knobs_and_bad_out():
    inputs = make_inputs(3, 7, 1, 8)
    for knobs in ({"block_p": 3}, {"block_p": 1}, {"block_hd": 4}, {"num_warps": 0}, {"block_hd": True}):
        with pytest.raises(SparseRefError, match="expected a power of two"), tuning(quest_kernels.TUNING, **knobs):
            quest_page_scores(*inputs)
    with pytest.raises(ShapeError, match="out: expected shape"):
        quest_page_scores(*inputs, out=torch.empty(3, 8, device=DEVICE))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU refusal without the interpreter")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ShapeError, match="CUDA device"):
        quest_page_scores(*make_inputs(1, 3, 1, 8))


def test_scoring_backend_is_validated():
    with pytest.raises(ConfigError, match="scoring_backend"):
        QuestAlgorithm(SparseConfig(), scoring_backend="cuda")
    assert QuestAlgorithm(SparseConfig(), "cpu").uses_triton_scoring() is False
    assert QuestAlgorithm(SparseConfig(), "cpu", scoring_backend="triton").uses_triton_scoring() is True


@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_quest_retrieve_with_triton_scoring_equals_loop_and_torch(gqa_mode):
    cfg = SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1, gqa_mode=gqa_mode)
    setups = {b: make_quest_decode_setup(3, 150, 8, num_q_heads=6, num_kv_heads=3, head_dim=12, config=cfg,
                                         device=DEVICE, scoring_backend=b, seed=7) for b in ("torch", "triton")}
    s = setups["triton"]
    assert s.algorithm.uses_triton_scoring()
    fb = s.forward_batch
    torch.testing.assert_close(s.algorithm.score_pages(s.queries, 0, s.req_pool_indices, fb),
                               setups["torch"].algorithm.score_pages(s.queries, 0, s.req_pool_indices, fb),
                               rtol=1e-5, atol=1e-4)
    batched, looped = s.retrieve(), s.retrieve(loop=True)
    assert torch.equal(batched[0], looped[0]) and torch.equal(batched[1], looped[1])


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    q_pos, q_neg, page_min, page_max, page_valid, pages = make_inputs(5, 300, 4, 96, num_pages=1000, device="cuda")
    static = [t.clone() for t in (q_pos, q_neg, page_min, page_max, page_valid, pages)]
    out = torch.empty(pages.shape, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quest_page_scores(*static, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quest_page_scores(*static, out=out)
    for seed in range(3):
        fresh = make_inputs(5, 300, 4, 96, num_pages=1000, device="cuda", seed=seed + 10)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = quest_page_scores_reference(*fresh)
        invalid = torch.isneginf(want)
        assert torch.equal(torch.isneginf(out), invalid) and bool(invalid.any()) and bool((~invalid).any())
        torch.testing.assert_close(out[~invalid], want[~invalid], rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("bounds_dtype", [torch.bfloat16, torch.float16])
def test_16bit_bounds_pool_scores_the_same_on_kernel_and_torch(bounds_dtype):
    """QuestAlgorithm(bounds_dtype=16-bit): the kernel reads the 16-bit pool and matches the torch path."""
    from sparse_ref.workloads import make_planted_workload

    cfg = SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1)
    scores = {}
    for backend in ("torch", "triton"):
        wl = make_planted_workload([150, 97, 130], page_size=8, num_q_heads=6, num_kv_heads=3, head_dim=12, seed=4,
                                   device=DEVICE)
        algo = QuestAlgorithm(cfg, DEVICE, scoring_backend=backend, bounds_dtype=bounds_dtype)
        wl.attach(algo)
        assert algo.page_min[0].dtype == bounds_dtype and algo.page_max[0].dtype == bounds_dtype
        fb = wl.forward_batch
        scores[backend] = algo.score_pages(wl.queries, 0, fb.req_pool_indices, fb)
    finite = torch.isfinite(scores["torch"])
    assert torch.equal(finite, torch.isfinite(scores["triton"])) and bool(finite.any())
    torch.testing.assert_close(scores["triton"][finite], scores["torch"][finite], rtol=1e-5, atol=1e-4)
