"""The Triton Quest bounds update (``sparse_ref.kernels.quest_bounds``) against the torch update, bit for bit.

Kernel level: awkward shapes (page 5, 3 KV heads, head dim 12), lengths 0, 1, P - 1, P, P + 1 and a full row,
prefill ranges and decode steps, every K dtype and bounds dtype, keys that round inward in 16 bits or overflow
fp16, NaN keys; bad arguments. Algorithm level: ``QuestAlgorithm(backend="triton")`` beside a torch twin
on random admit / extend / decode / release sequences (``test_lifecycle_property.py``'s machine).
"""

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import invariant
from test_lifecycle_property import QuestLifecycle

import sparse_ref
from sparse_ref import build_extend_batch
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.algorithms.quest import round_bounds_outward
from sparse_ref.config import SparseConfig
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels.quest_bounds import update_page_bounds

P, H, D, NUM_PAGES = 5, 3, 12, 53
BOUNDS = (torch.float32, torch.bfloat16, torch.float16)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 keys > 65504


def make_case(seed: int, k_dtype: torch.dtype, bounds_dtype: torch.dtype, prefill: bool):
    """The case on the device under test (CUDA when present; else CPU and the interpreter)."""
    case = _make_case(seed, k_dtype, bounds_dtype, prefill)
    device = sparse_ref.default_device()
    return {name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in case.items()}


def _make_case(seed: int, k_dtype: torch.dtype, bounds_dtype: torch.dtype, prefill: bool):
    """Keys of three magnitudes (tiny, unit, beyond fp16), a shuffled pool, requests of awkward lengths."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-6, 1.0, 7e4])[torch.randint(0, 3, (NUM_PAGES * P, 1, 1), generator=g)]
    k = (torch.randn(NUM_PAGES * P, H, D, generator=g) * scale).to(k_dtype)
    seq = torch.tensor([0, 1, P - 1, P, P + 1, 7 * P, 3 * P + 2])
    bs, width = seq.shape[0], 7 * P
    pages = 1 + torch.randperm(NUM_PAGES - 1, generator=g)[: bs * (width // P)].view(bs, width // P)
    rows = torch.randperm(bs, generator=g)
    req_to_token = torch.zeros(bs, width, dtype=torch.int32)
    req_to_token[rows] = (pages[:, :, None] * P + torch.arange(P)).reshape(bs, width).int()
    prefix = torch.minimum(torch.randint(0, width, (bs,), generator=g), seq) if prefill else None
    page_min = torch.randn(NUM_PAGES, H, D, generator=g).to(bounds_dtype)
    valid = torch.rand(NUM_PAGES, generator=g) > 0.5
    return dict(k_buffer=k, page_min=page_min, page_max=page_min + 1, page_valid=valid,
                req_to_token=req_to_token, req_pool_indices=rows, seq_lens=seq, page_size=P, prefix_lens=prefix)


def torch_update(case: dict):
    """What QuestAlgorithm's torch hooks write: per completed page, min/max of its keys rounded outward."""
    mn, mx, valid = case["page_min"].clone(), case["page_max"].clone(), case["page_valid"].clone()
    k_pages = case["k_buffer"].view(NUM_PAGES, P, H, D)
    for r in range(case["seq_lens"].shape[0]):
        seq = int(case["seq_lens"][r])
        prefix = max(seq - 1, 0) if case["prefix_lens"] is None else int(case["prefix_lens"][r])
        for j in range(prefix // P, seq // P):
            page = int(case["req_to_token"][case["req_pool_indices"][r], j * P]) // P
            keys = k_pages[page].float()
            mn[page], mx[page] = round_bounds_outward(keys.amin(0), keys.amax(0), mn.dtype)
            valid[page] = True
    return mn, mx, valid


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def run_kernel(case: dict):
    out = {name: case[name].clone() for name in ("page_min", "page_max", "page_valid")}
    update_page_bounds(**(case | out))
    return out["page_min"], out["page_max"], out["page_valid"]


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("bounds_dtype", BOUNDS, ids=str)
@pytest.mark.parametrize("k_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_writes_the_torch_bounds_bit_for_bit(k_dtype, bounds_dtype, prefill):
    for seed in range(2):
        case = make_case(seed, k_dtype, bounds_dtype, prefill)
        want, got = torch_update(case), run_kernel(case)
        assert torch.equal(got[2], want[2]), "page_valid"
        for name, a, b in zip(("page_min", "page_max"), got[:2], want[:2], strict=True):
            assert torch.equal(bits(a), bits(b)), f"{name}: {int((a != b).sum())} values differ (seed {seed})"
        assert not torch.equal(got[2], case["page_valid"]) or prefill, "the decode case completed no page"


def test_pages_not_completed_this_step_are_untouched():
    case = make_case(3, torch.float32, torch.float32, prefill=False)
    case["seq_lens"] = case["seq_lens"] * 0 + P + 1  # every request one token into its second page: nothing completes
    got = run_kernel(case)
    for a, b in zip(got, (case["page_min"], case["page_max"], case["page_valid"]), strict=True):
        assert torch.equal(a, b)


def test_16bit_bounds_still_bound_every_key_and_nan_propagates():
    case = make_case(4, torch.float32, torch.float16, prefill=True)
    case["prefix_lens"] = torch.zeros_like(case["seq_lens"])
    case["page_valid"].zero_()  # so that the valid pages after the call are the ones it built
    page = int(case["req_to_token"][case["req_pool_indices"][5], 0]) // P  # the full row's first page
    case["k_buffer"][page * P + 2, 1, 4] = float("nan")
    mn, mx, valid = run_kernel(case)
    keys = case["k_buffer"].view(NUM_PAGES, P, H, D)[valid].float()
    lo, hi = mn[valid].float()[:, None], mx[valid].float()[:, None]
    ok = torch.isnan(lo) | ((lo <= keys) & (keys <= hi))  # (a NaN key makes its column's bounds NaN)
    assert ok.all(), "a 16-bit bound moved inward past a key"
    assert torch.isnan(mn[page, 1, 4]) and torch.isnan(mx[page, 1, 4]) and not torch.isnan(mn[page, 0]).any()
    want = torch_update(case)
    assert torch.equal(torch.isnan(mn), torch.isnan(want[0])) and torch.equal(valid, want[2])


def test_unchecked_indices_stay_inside_the_pools():
    """During capture the caller's value checks are skipped: a wild row or length is clamped, never followed."""
    case = make_case(5, torch.float32, torch.float32, prefill=False)
    case["req_pool_indices"] = case["req_pool_indices"] * 0 + 10**6
    case["seq_lens"] = case["seq_lens"] * 0 + 10**6
    got = run_kernel(case)  # the last row's last page completes (clamped length 35 = 7 pages)
    assert int(got[2].sum()) <= int(case["page_valid"].sum()) + 1


@pytest.mark.parametrize("bad, match", [
    (dict(k_buffer=torch.zeros(NUM_PAGES * P - 1, H, D)), "k_buffer"),
    (dict(page_max=torch.zeros(NUM_PAGES, H, D, dtype=torch.float16)), "page_max"),
    (dict(page_valid=torch.zeros(NUM_PAGES, dtype=torch.int8)), "page_valid"),
    (dict(req_to_token=torch.zeros(3, 35, dtype=torch.int64)), "req_to_token"),
    (dict(seq_lens=torch.zeros(2, dtype=torch.int32)), "seq_lens"),
    (dict(prefix_lens=torch.zeros(7)), "prefix_lens"),
    (dict(page_size=0), "page_size"),
])
def test_bad_arguments_are_refused_before_the_launch(bad, match):
    case = make_case(6, torch.float32, torch.float32, prefill=True)
    before = case["page_min"].clone()
    bad = {name: v.to(before.device) if isinstance(v, torch.Tensor) else v for name, v in bad.items()}
    with pytest.raises(SparseRefError, match=match):
        update_page_bounds(**(case | bad))
    assert torch.equal(case["page_min"], before)


# ----------------------------------------------------------------------------- random lifecycles


class QuestKernelLifecycle(QuestLifecycle):
    """The Quest lifecycle with the Triton bounds update (and Triton scoring), beside a torch twin fed the same
    steps: after every step the two layers' pools are equal bit for bit (and the parent's invariants hold)."""

    def attach(self):
        pools = (self.m.token_to_kv_pool, self.m.req_to_token_pool)
        self.algo = QuestAlgorithm(SparseConfig(page_budget=1, num_recent_pages=1), backend="triton")
        self.twin = QuestAlgorithm(SparseConfig(page_budget=1, num_recent_pages=1), backend="torch")
        for algo in (self.algo, self.twin):
            algo.initialize_representation_pool(0, 1, *pools)

    def prefilled(self, req, prefix, index):
        super().prefilled(req, prefix, index)
        fb = build_extend_batch(self.m, [req], [prefix])
        self.twin.construct_representations(0, fb, self.m.token_to_kv_pool.get_key_buffer(0))

    def decoded(self, reqs, fb):
        super().decoded(reqs, fb)
        self.twin.update_representations(0, fb, self.m.token_to_kv_pool.get_key_buffer(0))

    @invariant()
    def kernel_pools_equal_torch_pools(self):
        if hasattr(self, "twin"):
            for name in ("page_min", "page_max", "page_valid"):
                assert torch.equal(getattr(self.algo, name)[0], getattr(self.twin, name)[0]), name


QuestKernelLifecycle.TestCase.settings = settings(max_examples=12, stateful_step_count=15, deadline=None)
# The machine's pools live on the CPU: with a GPU present Triton compiles instead of interpreting and refuses
# CPU tensors, so there the kernel-level tests above (on CUDA) carry the comparison.
TestQuestKernelLifecycle = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU pools need the interpreter")(
    QuestKernelLifecycle.TestCase)
