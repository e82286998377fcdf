"""The Triton radix top-k (kernels/topk.py) against ``topk_reference`` on awkward inputs.

On CPU the kernels run through Triton's interpreter, so sizes stay small; the ``gpu`` tests
run the realistic sizes (128K and 1M columns, k up to 4096) and CUDA-graph capture.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_ref  # (interpreter set-up before the kernel import)
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels.topk import topk
from sparse_ref.selection import topk_reference

DEVICE = sparse_ref.default_device()  # CUDA on a GPU machine, else CPU through the interpreter
SPECIALS = [float("nan"), float("-inf"), float("inf"), -0.0, 0.0]


def make_scores(R, N, *, seed, ties=False, specials=False, dtype=torch.float32, device=DEVICE):
    """Random scores; with ``ties`` few distinct values, with ``specials`` NaN / +-inf / -0.0 sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-3, 4, (R, N), generator=g).float() / 2
    else:
        x = torch.randn(R, N, generator=g)
    if specials and R * N:
        pick = torch.randint(0, len(SPECIALS), (R, N), generator=g)
        where = torch.rand(R, N, generator=g) < 0.25
        x = torch.where(where, torch.tensor(SPECIALS)[pick], x)
    return x.to(dtype).to(device)


def check(scores, k, lengths=None, order="score", **kw):
    got = topk(scores, k, lengths, order=order, **kw)
    ref = topk_reference(scores.cpu(), k if isinstance(k, int) else k.cpu(),
                         None if lengths is None else lengths.cpu(), order="index" if order == "none" else order,
                         width=kw.get("width"))
    got = got.cpu()
    assert got.dtype == torch.int32 and got.shape == ref.shape
    # ids as sets first (a clearer failure), then the exact order
    for r in range(got.shape[0]):
        assert set(got[r][got[r] >= 0].tolist()) == set(ref[r][ref[r] >= 0].tolist()), f"row {r}"
    assert torch.equal(got, ref)
    return got


def test_awkward_rows_both_orders():
    """Ties, specials, lengths 0/1/full and k beyond the row, in one batch (N not a power of two)."""
    x = make_scores(6, 37, seed=1, specials=True)
    x[1] = 1.5  # an all-equal row: ties to the lower id
    x[2, :10] = torch.tensor([-0.0, 0.0, -0.0, 0.0, float("nan"), float("-inf"), float("inf"), 0.0, -0.0, 1.0],
                             device=DEVICE)
    lengths = torch.tensor([37, 30, 10, 1, 0, 25], device=DEVICE)
    for order in ("score", "index", "none"):
        check(x, 9, lengths, order=order)
    check(x, 40, lengths)  # k larger than every row: fewer ids, -1 padded


def test_forced_row_splitting_matches():
    """The split path (partial histograms combined with atomics) on a small row."""
    x = make_scores(3, 70, seed=2, ties=True, specials=True)
    lengths = torch.tensor([70, 41, 3], device=DEVICE)
    check(x, 13, lengths, splits=4)
    check(x, 13, lengths, order="index", splits=7)


def test_tile_loop_path_matches(monkeypatch):
    """One program per row looping over tiles (used for unsplit rows too long for registers), forced small."""
    monkeypatch.setitem(topk_module.TUNING, "register_row", 0)
    x = make_scores(3, 53, seed=12, ties=True, specials=True)
    check(x, 7, torch.tensor([53, 20, 0], device=DEVICE), splits=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    check(make_scores(2, 29, seed=3, ties=True, specials=True, dtype=dtype), 6)


def test_edge_sizes():
    """N = 0 and 1, k = 0, zero rows."""
    assert topk(torch.empty(3, 0, device=DEVICE), 4).tolist() == [[-1] * 4] * 3
    check(make_scores(2, 1, seed=4), 3)
    assert topk(make_scores(2, 5, seed=5), 0).shape == (2, 0)
    assert topk(torch.empty(0, 5, device=DEVICE), 2).shape == (0, 2)


def test_per_row_k_tensor():
    x = make_scores(4, 23, seed=6, ties=True)
    k = torch.tensor([0, 3, 23, 7], device=DEVICE)
    check(x, k, width=8)
    check(x, k, order="index")  # width read from k.max() eagerly


@settings(max_examples=10, deadline=None)
@given(R=st.integers(1, 3), N=st.integers(0, 60), k=st.integers(0, 66), ties=st.booleans(), specials=st.booleans(),
       splits=st.sampled_from([None, 1, 2, 3]), order=st.sampled_from(["score", "index"]),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
       data=st.data())
def test_property_matches_reference(R, N, k, ties, specials, splits, order, dtype, seed, data):
    x = make_scores(R, N, seed=seed, ties=ties, specials=specials, dtype=dtype)
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, N), min_size=R, max_size=R)), device=DEVICE)
    check(x, k, lengths, order=order, splits=splits)


def test_kernel_clamps_bad_lengths(monkeypatch):
    """While a CUDA graph captures, lengths are not checked on the host: the kernel clamps them to [0, N]."""
    monkeypatch.setattr(topk_module, "capturing", lambda: True)
    x = make_scores(3, 11, seed=7)
    got = topk(x, 4, torch.tensor([-5, 99, 6], device=DEVICE))
    assert torch.equal(got.cpu(), topk_reference(x.cpu(), 4, torch.tensor([0, 11, 6])))


# ---------------------------------------------------------------------------------------------
# Input errors: raised before any launch, naming the argument, what was expected and the fix.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda x: topk(x.double(), 2), "float32, float16 or bfloat16"),
    (lambda x: topk(x[0], 2), "2-D"),
    (lambda x: topk(x.t(), 2), "unit stride"),
    (lambda x: topk(x.tolist(), 2), "torch.Tensor"),
    (lambda x: topk(x, -1), "k must be an int >= 0"),
    (lambda x: topk(x, 2.5), "k must be an int >= 0"),
    (lambda x: topk(x, 5000), "at most 4096"),
    (lambda x: topk(x, 2, order="random"), "order must be one of"),
    (lambda x: topk(x, torch.tensor([1.0, 2.0, 3.0], device=x.device)), "k as a tensor"),
    (lambda x: topk(x, torch.tensor([1, 2], device=x.device)), "k as a tensor"),
    (lambda x: topk(x, torch.tensor([1, -2, 3], device=x.device)), "k must be >= 0"),
    (lambda x: topk(x, 2, torch.tensor([1.0, 2.0, 3.0], device=x.device)), "lengths must be an int32/int64"),
    (lambda x: topk(x, 2, torch.tensor([1, 2], device=x.device)), "lengths must be an int32/int64"),
    (lambda x: topk(x, 2, torch.tensor([1, 2, 9], device=x.device)), r"lengths must lie in \[0, 8\]"),
    (lambda x: topk(x, 2, torch.tensor([-1, 2, 3], device=x.device)), r"lengths must lie in \[0, 8\]"),
    (lambda x: topk(x, 2, out=torch.empty(3, 2, dtype=torch.int64, device=x.device)), "out must be"),
    (lambda x: topk(x, 2, splits=0), "splits must be"),
    (lambda x: topk(x, 2, width=-1), "width must be an int >= 0"),
    (lambda x: topk(x.to("meta"), 2), "must be on a CUDA device"),
    (lambda x: topk(x, 2, torch.tensor([1, 2, 3], device="meta")), "same device"),
])
def test_input_errors(call, match):
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(SparseRefError, match=match) as info:
        call(x)
    assert "Fix" in str(info.value)


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, CUDA graphs
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("R, N, k, splits", [(4, 131072, 2048, None), (1, 131072, 2048, None), (8, 16384, 512, None),
                                              (5, 10_000, 4096, None), (3, 20_000, 100, 1),
                                              (2, 1 << 20, 4096, None), (3, 100_003, 4096, 5), (64, 65536, 2048, 1)])
def test_gpu_large_rows(R, N, k, splits):
    x = make_scores(R, N, seed=8, device="cuda")
    x[0, ::7] = 0.25  # a big block of ties
    lengths = torch.randint(N // 2, N + 1, (R,), device="cuda")
    check(x, k, lengths, splits=splits)
    check(x, k, lengths, order="index", splits=splits)


@pytest.mark.gpu
def test_gpu_matches_torch_topk_sets():
    x = torch.randn(16, 65536, device="cuda")
    got = topk(x, 2048)
    ref = torch.topk(x, 2048, dim=1).indices.int()
    assert torch.equal(got, ref)  # distinct random values: torch.topk's sorted order is the same


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    x = make_scores(8, 40_000, seed=9, ties=True, device="cuda")
    lengths = torch.randint(0, 40_001, (8,), device="cuda")
    out = torch.empty(8, 512, dtype=torch.int32, device="cuda")
    topk(x, 512, lengths, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk(x, 512, lengths, out=out)
    for seed in (10, 11):
        x.copy_(make_scores(8, 40_000, seed=seed, device="cuda"))
        lengths.copy_(torch.randint(0, 40_001, (8,)))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), topk_reference(x.cpu(), 512, lengths.cpu()))
