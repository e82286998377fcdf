"""The Triton Quest scoring (sign split + page mapping + scores in one launch) == the torch path; its input
checks; Quest retrieval on it == the loop and the torch scoring.

Runs on CPU through Triton's interpreter (small sizes); the CUDA-graph test needs a GPU.
``quest_page_scores_from_queries`` must equal ``quest_page_scores_reference(*split_query_sign(...),
pages=physical_pages)`` up to fp32 rounding of the group sum, and exactly ``-inf`` for pages without bounds.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sparse_ref
from sparse_ref import SparseConfig
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.algorithms.quest import quest_page_scores_reference, split_query_sign
from sparse_ref.errors import ConfigError, ShapeError, SparseRefError
from sparse_ref.kernels import quest as quest_kernels
from sparse_ref.kernels import tuning
from sparse_ref.kernels.quest import quest_page_scores_from_queries
from sparse_ref.workloads import make_planted_workload, make_quest_decode_setup

DEVICE = sparse_ref.default_device()
NAMES = ("queries", "page_min", "page_max", "page_valid", "req_to_token", "req_pool_indices")


def make_case(bs, max_pages, num_kv_heads, group, head_dim, P, q_dtype=torch.float32, bound_dtype=torch.float32,
              seed=0, device=DEVICE):
    """Random bounds (min <= max), some invalid pages (page 0 among them), a req_to_token with slots out of the
    pool's range (the kernel clamps them), rows in random order, queries of both signs."""
    g = torch.Generator().manual_seed(seed)
    num_pages = bs * max_pages + 3
    a = torch.randn(num_pages, num_kv_heads, head_dim, generator=g)
    b = torch.randn(num_pages, num_kv_heads, head_dim, generator=g)
    page_min, page_max = torch.minimum(a, b).to(bound_dtype), torch.maximum(a, b).to(bound_dtype)
    page_valid = torch.rand(num_pages, generator=g) > 0.2
    page_valid[0] = False  # page 0 is padding in the pool
    rows = torch.randperm(bs + 2, generator=g)[:bs]
    r2t = torch.randint(-3, num_pages * P + 5, (bs + 2, max(1, max_pages * P - (P > 1))), generator=g,
                        dtype=torch.int32)
    q = (torch.randn(bs, num_kv_heads * group, head_dim, generator=g) * 2).to(q_dtype)
    return [t.to(device) for t in (q, page_min, page_max, page_valid, r2t, rows)]


def reference(q, page_min, page_max, page_valid, r2t, rows, P, max_pages, gqa_mode):
    """The torch path: the sign split, the physical pages (clamped as the kernel clamps), the reference scores."""
    num_pages, num_kv_heads, head_dim = page_min.shape
    q_pos, q_neg = split_query_sign(q.float(), num_kv_heads, head_dim, gqa_mode)
    first = torch.clamp(torch.arange(max_pages, device=r2t.device) * P, max=r2t.shape[1] - 1)
    pages = (r2t[rows.long()[:, None], first[None, :]].long() // P).clamp(0, num_pages - 1)
    return quest_page_scores_reference(q_pos, q_neg, page_min, page_max, page_valid, pages), pages


def assert_matches_reference(case, P, max_pages, gqa_mode="mean", **knobs):
    """The kernel (launch ``knobs`` set in its TUNING table) against the torch path, on both query layouts."""
    q, page_min, page_max, page_valid, r2t, rows = case
    want, pages = reference(*case, P, max_pages, gqa_mode)
    invalid = ~page_valid[pages]
    for queries in (q, q.reshape(q.shape[0], -1)):  # [bs, H_q, D] and [bs, H_q * D]
        with tuning(quest_kernels.TUNING, **knobs):
            got = quest_page_scores_from_queries(queries, page_min, page_max, page_valid, r2t, rows, P, max_pages,
                                                 gqa_mode)
        assert got.shape == (q.shape[0], max_pages) and got.dtype == torch.float32
        assert bool(torch.isneginf(got[invalid]).all()), "a page without bounds must score exactly -inf"
        assert bool(torch.isfinite(got[~invalid]).all())
        torch.testing.assert_close(got[~invalid], want[~invalid], rtol=1e-5, atol=1e-4)
    return got


@pytest.mark.parametrize("bs,max_pages,num_kv_heads,group,head_dim,P", [
    (1, 1, 1, 1, 8, 1), (3, 7, 3, 4, 12, 4), (2, 33, 2, 1, 16, 3), (1, 20, 1, 8, 8, 16), (4, 5, 2, 3, 8, 2),
])
@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_kernel_matches_reference_awkward_sizes(bs, max_pages, num_kv_heads, group, head_dim, P, gqa_mode):
    case = make_case(bs, max_pages, num_kv_heads, group, head_dim, P, seed=bs + max_pages + group)
    assert_matches_reference(case, P, max_pages, gqa_mode)


@pytest.mark.knobs
@given(st.integers(1, 3), st.integers(1, 40), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 4]),
       st.sampled_from([8, 12, 20]), st.sampled_from([1, 4, 16]), st.sampled_from(["mean", "per_kv_head"]),
       st.integers(0, 2**31 - 1), st.sampled_from([(None, None, None), (2, 16, 1), (4, 32, 2), (32, 8, 4)]))
def test_kernel_matches_reference_random(bs, max_pages, num_kv_heads, group, head_dim, P, gqa_mode, seed, knobs):
    """Fresh inputs; launch knobs that split the page and H_kv*D loops differently must not change the result."""
    case = make_case(bs, max_pages, num_kv_heads, group, head_dim, P, seed=seed)
    block_p, block_hd, num_warps = knobs
    assert_matches_reference(case, P, max_pages, gqa_mode, block_p=block_p, block_hd=block_hd, num_warps=num_warps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_queries_and_bounds_accumulate_in_fp32(dtype):
    assert_matches_reference(make_case(3, 7, 3, 2, 12, 4, q_dtype=dtype, bound_dtype=dtype, seed=5), 4, 7)


def test_all_invalid_pages_and_the_out_buffer():
    q, page_min, page_max, page_valid, r2t, rows = make_case(3, 7, 1, 2, 8, 4, seed=1)
    out = torch.full((3, 7), 123.0, device=DEVICE)
    got = quest_page_scores_from_queries(q, page_min, page_max, torch.zeros_like(page_valid), r2t, rows, 4, 7,
                                         out=out)
    assert got.data_ptr() == out.data_ptr() and bool(torch.isneginf(out).all())


def test_empty_batch_and_no_pages():
    q, page_min, page_max, page_valid, r2t, rows = make_case(2, 4, 2, 2, 8, 2, seed=6)
    assert quest_page_scores_from_queries(q[:0], page_min, page_max, page_valid, r2t, rows[:0], 2, 4).shape == (0, 4)
    assert quest_page_scores_from_queries(q, page_min, page_max, page_valid, r2t, rows, 2, 0).shape == (2, 0)


@pytest.mark.parametrize("change,match", [
    (lambda a: {"req_pool_indices": a["req_pool_indices"] + 10}, r"req_pool_indices: expected values in \[0, "),
    (lambda a: {"req_pool_indices": a["req_pool_indices"].float()}, "req_pool_indices: expected dtype"),
    (lambda a: {"req_to_token": a["req_to_token"].long()}, "req_to_token: expected dtype"),
    (lambda a: {"queries": a["queries"][:, :4]}, "queries: expected"),  # 4 query heads over 3 KV heads
    (lambda a: {"queries": a["queries"][:1]}, "queries: expected"),
    (lambda a: {"queries": a["queries"].double()}, "queries: expected dtype"),
    (lambda a: {"queries": a["queries"].tolist()}, "queries: expected a torch.Tensor"),
    (lambda a: {"page_max": a["page_max"][:-1]}, "page_max: expected shape"),
    (lambda a: {"page_max": a["page_max"].half()}, "page_max: expected dtype"),
    (lambda a: {"page_min": a["page_min"].int(), "page_max": a["page_max"].int()}, "page_min: expected dtype"),
    (lambda a: {"page_valid": a["page_valid"].int()}, "page_valid: expected dtype"),
    (lambda a: {"page_valid": a["page_valid"][:-1]}, "page_valid: expected shape"),
    (lambda a: {"page_min": a["page_min"].transpose(1, 2).contiguous().transpose(1, 2)}, "page_min: expected a contig"),
])
def test_bad_inputs_raise_before_launch(change, match):
    args = dict(zip(NAMES, make_case(3, 7, 3, 2, 12, 4, seed=3), strict=True))
    args.update(change(args))
    with pytest.raises(SparseRefError, match=match) as info:
        quest_page_scores_from_queries(**args, page_size=4, max_pages=7)
    assert "Fix:" in str(info.value)


def test_bad_mode_sizes_knobs_and_out():
    case = make_case(2, 4, 2, 2, 8, 2, seed=6)
    with pytest.raises(SparseRefError, match="gqa_mode"):
        quest_page_scores_from_queries(*case, 2, 4, "max")
    with pytest.raises(SparseRefError, match="page_size"):
        quest_page_scores_from_queries(*case, 0, 4)
    with pytest.raises(SparseRefError, match="max_pages"):
        quest_page_scores_from_queries(*case, 2, -1)
    with pytest.raises(ShapeError, match="out: expected shape"):
        quest_page_scores_from_queries(*case, 2, 4, out=torch.empty(2, 5, device=DEVICE))
    for knobs in ({"block_p": 3}, {"block_p": 1}, {"block_hd": 4}, {"num_warps": 0}, {"block_hd": True}):
        with pytest.raises(SparseRefError, match="block_p|block_hd|num_warps"):
            with tuning(quest_kernels.TUNING, **knobs):
                pass


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU refusal without the interpreter")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ShapeError, match="CUDA device"):
        quest_page_scores_from_queries(*make_case(1, 3, 1, 1, 8, 2), 2, 3)


def test_scoring_backend_is_validated():
    with pytest.raises(ConfigError, match="backend"):
        QuestAlgorithm(SparseConfig(), backend="cuda")
    assert QuestAlgorithm(SparseConfig(), "cpu").backend.name == "torch"
    assert QuestAlgorithm(SparseConfig(), "cpu", backend="triton").backend.name == "triton"


@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_quest_retrieve_with_triton_scoring_equals_loop_and_torch(gqa_mode):
    cfg = SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1, gqa_mode=gqa_mode)
    setups = {b: make_quest_decode_setup(3, 150, 8, num_q_heads=6, num_kv_heads=3, head_dim=12, config=cfg,
                                         device=DEVICE, backend=b, seed=7) for b in ("torch", "triton")}
    s = setups["triton"]
    assert s.algorithm.backend.name == "triton"
    fb = s.forward_batch
    torch.testing.assert_close(s.algorithm.score_pages(s.queries, 0, s.req_pool_indices, fb),
                               setups["torch"].algorithm.score_pages(s.queries, 0, s.req_pool_indices, fb),
                               rtol=1e-5, atol=1e-4)
    batched, looped = s.retrieve(), s.retrieve(loop=True)
    assert torch.equal(batched[0], looped[0]) and torch.equal(batched[1], looped[1])


@pytest.mark.parametrize("gqa_mode", ["mean", "per_kv_head"])
def test_quest_retrieve_on_the_kernel_equals_torch_scoring_with_a_one_token_request(gqa_mode):
    picks = {}
    for backend in ("torch", "triton"):
        wl = make_planted_workload([300, 77, 1, 160], page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=16,
                                   device=DEVICE, seed=3)
        algo = QuestAlgorithm(SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1, gqa_mode=gqa_mode),
                              DEVICE, backend=backend)
        wl.attach(algo)
        fb = wl.forward_batch
        scores = algo.score_pages(wl.queries, 0, fb.req_pool_indices, fb)
        picks[backend] = (scores, *algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices,
                                                     torch.ones(4, dtype=torch.bool, device=DEVICE), forward_batch=fb))
    (s_t, sel_t, len_t), (s_k, sel_k, len_k) = picks["torch"], picks["triton"]
    finite = torch.isfinite(s_t)
    assert torch.equal(finite, torch.isfinite(s_k))
    torch.testing.assert_close(s_k[finite], s_t[finite], rtol=1e-5, atol=1e-4)
    assert torch.equal(sel_t, sel_k) and torch.equal(len_t, len_k)


@pytest.mark.parametrize("bounds_dtype", [torch.bfloat16, torch.float16])
def test_16bit_bounds_pool_scores_the_same_on_kernel_and_torch(bounds_dtype):
    """QuestAlgorithm(bounds_dtype=16-bit): the kernel reads the 16-bit pool and matches the torch path."""
    cfg = SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1)
    scores = {}
    for backend in ("torch", "triton"):
        wl = make_planted_workload([150, 97, 130], page_size=8, num_q_heads=6, num_kv_heads=3, head_dim=12, seed=4,
                                   device=DEVICE)
        algo = QuestAlgorithm(cfg, DEVICE, backend=backend, bounds_dtype=bounds_dtype)
        wl.attach(algo)
        assert algo.page_min[0].dtype == bounds_dtype and algo.page_max[0].dtype == bounds_dtype
        fb = wl.forward_batch
        scores[backend] = algo.score_pages(wl.queries, 0, fb.req_pool_indices, fb)
    finite = torch.isfinite(scores["torch"])
    assert torch.equal(finite, torch.isfinite(scores["triton"])) and bool(finite.any())
    torch.testing.assert_close(scores["triton"][finite], scores["torch"][finite], rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    static = make_case(5, 300, 4, 2, 96, 16, device="cuda")
    out = torch.empty(5, 300, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quest_page_scores_from_queries(*static, 16, 300, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quest_page_scores_from_queries(*static, 16, 300, out=out)
    for seed in range(3):
        fresh = make_case(5, 300, 4, 2, 96, 16, device="cuda", seed=seed + 10)
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want, _ = reference(*fresh, 16, 300, "mean")
        invalid = torch.isneginf(want)
        assert torch.equal(torch.isneginf(out), invalid) and bool(invalid.any()) and bool((~invalid).any())
        torch.testing.assert_close(out[~invalid], want[~invalid], rtol=1e-5, atol=1e-3)
