"""Entry-point checks found by review: each bad call raises a SparseRefError naming the argument,
and strided index tensors give the same answer as contiguous ones."""

import pytest
import torch

import sparse_ref  # noqa: F401  (interpreter set-up before the kernel imports)
from sparse_ref.config import SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels.page_select import select_pages_triton
from sparse_ref.selection import select_pages
from sparse_ref.workloads import PlantedEngineWorkload


def tiny_workload(**kwargs):
    return PlantedEngineWorkload(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, **kwargs)


def test_engine_refuses_page_size_zero_and_mismatched_configs():
    with pytest.raises(SparseRefError, match="page_size"):
        DecodeEngine(tiny_workload(), ["quest"], page_size=0)
    with pytest.raises(SparseRefError, match="config"):
        DecodeEngine(tiny_workload(), ["quest"], [SparseConfig(), SparseConfig()])


def test_engine_finish_twice_is_a_clear_error():
    engine = DecodeEngine(tiny_workload(), ["quest"], page_size=4, max_context_len=64)
    req = engine.add_request(20)
    engine.finish(req)
    with pytest.raises(SparseRefError, match="finish"):
        engine.finish(req)


def test_workload_checks_heads_and_needle_depths():
    with pytest.raises(SparseRefError, match="num_kv_heads"):
        PlantedEngineWorkload(num_layers=1, num_q_heads=4, num_kv_heads=0)
    with pytest.raises(SparseRefError, match="needle_depths"):
        tiny_workload().request(0, 100, needle_depths=[-0.5])


def test_page_budget_tensor_is_stored_as_int():
    config = SparseConfig(page_budget=torch.tensor(3))
    assert type(config.page_budget) is int and config.page_budget == 3


def test_strided_seq_lens_and_mask_select_like_contiguous():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 20, generator=gen)
    seq_lens = torch.tensor([[70, 0], [33, 0], [80, 0]])[:, 0]  # a strided view
    mask = torch.tensor([[True, False], [True, False], [False, True]])[:, 0]
    assert not seq_lens.is_contiguous() and not mask.is_contiguous()
    config = SparseConfig(page_budget=3, num_recent_pages=2)
    got = select_pages_triton(scores, seq_lens, mask, 4, config)
    want = select_pages(scores, seq_lens.contiguous(), mask.contiguous(), 4, config)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
