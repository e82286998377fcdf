"""The backend object (``sparse_ref.backend``): one table chosen once, what each GPU runs, and nobody asks again.

The capabilities a tutorial audience brings (T4 7.5, A100 8.0, A10G 8.6, L4 8.9, H100/H200 9.0) are simulated
with ``SPARSE_REF_CAPABILITY``: the table changes, the machine does not (on a CPU the Triton side runs through
the interpreter, where FP8 and bf16 work, so a fallback is seen by which function ran, not by a failure).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import sparse_ref
from sparse_ref import backend as backend_module
from sparse_ref.backend import CAPABILITY_ENV, Backend, choose_backend
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.errors import ConfigError
from sparse_ref.kernels import dsa as dsa_kernels
from sparse_ref.kernels import page_table as page_table_kernels
from sparse_ref.workloads import PlantedEngineWorkload

PACKAGE = Path(sparse_ref.__file__).parent
DEVICE = sparse_ref.default_device()  # CUDA on a GPU machine, else CPU through the interpreter
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
TABLE = {  # capability -> the (operation, dtype) pairs that take the torch twin
    "7.5": {("attention", BF16), ("dsa_logits", FP8), ("dsa_logits", BF16), ("quest_scores", BF16),
            ("update_bounds", BF16)},
    "8.0": {("dsa_logits", FP8)}, "8.6": {("dsa_logits", FP8)}, "8.9": set(), "9.0": set(),
}


@pytest.mark.parametrize("capability", TABLE)
def test_each_capability_sends_what_it_cannot_run_to_torch(monkeypatch, capability):
    monkeypatch.setenv(CAPABILITY_ENV, capability)
    backend = choose_backend("triton", "cpu")
    assert backend.capability == tuple(int(x) for x in capability.split("."))
    assert set(backend.torch_for) == TABLE[capability]
    assert choose_backend("torch", "cpu").torch_for == ()  # the torch column has nothing to fall back from


def test_auto_is_torch_on_a_cpu_and_a_backend_passes_through():
    torch_side = choose_backend("auto", "cpu")
    assert isinstance(torch_side, Backend) and torch_side.name == "torch" and torch_side.capability is None
    assert choose_backend(torch_side) is torch_side
    assert choose_backend("triton", "cpu").name == "triton" and not choose_backend("triton", "cpu").compiled
    for bad in ("cuda", "Triton", None, 1):
        with pytest.raises(ConfigError, match="backend: expected one of"):
            choose_backend(bad, "cpu")


def test_auto_follows_the_device_not_the_machine(monkeypatch):
    """Beside a GPU (simulated), ``auto`` on a CPU device is the torch side and on ``cuda:0`` the compiled one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(CAPABILITY_ENV, "9.0")
    assert choose_backend("auto", "cpu").name == "torch"
    gpu = choose_backend("auto", "cuda:0")
    assert gpu.name == "triton" and gpu.compiled and gpu.capability == (9, 0) and not gpu.syncs


@pytest.mark.parametrize("value", ["8", "eight", "8.x", "-1.0"])
def test_a_bad_simulated_capability_is_refused(monkeypatch, value):
    monkeypatch.setenv(CAPABILITY_ENV, value)
    with pytest.raises(ConfigError, match=CAPABILITY_ENV):
        choose_backend("triton", "cpu")


def dsa_engine(backend, layers=("deepseek_dsa", None)):
    """Two requests through a DSA layer with FP8 indexer keys (the default) and a dense layer."""
    cfg = IndexerConfig(hidden_size=32, q_lora_rank=16, n_heads=4, head_dim=32, rope_dim=16, index_topk=8)
    wl = PlantedEngineWorkload(num_layers=len(layers), num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=1, local_window=4, indexer_config=cfg, seed=3)
    engine = DecodeEngine(wl, list(layers), SparseConfig(page_budget=2, num_recent_pages=1, min_sparse_seq_len=12),
                          dsa_topk=8, page_size=4, max_requests=2, max_context_len=64, backend=backend,
                          compare_dense=False, device=DEVICE)
    for n in (23, 30):
        engine.add_request(n)
    return engine


def test_fp8_logits_below_ada_take_the_torch_path_and_say_so_once(monkeypatch, capsys):
    """An A100 (8.0) with the default FP8 indexer keys: the engine's DSA layer runs the torch logits (the kernel is
    never called), prints one line once, and decodes what the torch engine decodes. (Handing the indexer the
    resolved "triton" once skipped its pre-Ada guard: the launcher's FP8 error at the first step.)"""
    def no_kernel(*args, **kwargs):
        raise AssertionError("the FP8 logits kernel ran on a GPU without FP8")

    want = [t.out for t in dsa_engine("torch").step().layers]
    monkeypatch.setattr(backend_module, "_said", set())  # (said once per process: this test's process may have)
    monkeypatch.setenv(CAPABILITY_ENV, "8.0")
    monkeypatch.setattr(dsa_kernels, "paged_indexer_logits", no_kernel)
    engine = dsa_engine("triton")
    assert engine.coordinator.indexers[0].backend is engine.backend and engine.backend.capability == (8, 0)
    got = [t.out for t in engine.step().layers]
    engine.step()
    lines = [line for line in capsys.readouterr().out.splitlines() if "FP8 keys" in line]
    assert lines == ["dsa logits: FP8 keys need compute capability 8.9; this GPU has 8.0, using the torch path"]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_at_ada_the_fp8_logits_run_the_kernel(monkeypatch):
    calls = []
    kernel = dsa_kernels.paged_indexer_logits
    monkeypatch.setattr(dsa_kernels, "paged_indexer_logits", lambda *a, **k: (calls.append(1), kernel(*a, **k))[1])
    monkeypatch.setenv(CAPABILITY_ENV, "8.9")
    dsa_engine("triton").step()
    assert calls  # (one per decode step of the DSA layer)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_adaptor_runs_the_engines_backend(monkeypatch, backend):
    """The dense metadata (forward_begin) and the DSA layer's page-size-1 table come from the engine's backend:
    with "torch" the page-table kernel never runs (it once did on a GPU, through the adaptor's own "auto" rule), with
    "triton" it runs for both."""
    calls = []
    kernel = page_table_kernels.page_table_from_selection
    monkeypatch.setattr(page_table_kernels, "page_table_from_selection",
                        lambda *a, **k: (calls.append(1), kernel(*a, **k))[1])
    dsa_engine(backend).step()
    assert len(calls) == (2 if backend == "triton" else 0)  # forward_begin, the DSA layer


def test_nothing_outside_the_backend_asks_which_side_it_holds():
    """No ``backend == "triton"``-style test and no kernel import outside ``backend.py`` (the kernels, the bench and
    the module that tells what runs where aside): the reading set reads as one computation."""
    asks = re.compile(r"""(backend|\.name)\s*[!=]=\s*["'](torch|triton)["']|uses_triton|resolve_backend""")
    imports = re.compile(r"^\s*(from sparse_ref\.kernels|import sparse_ref\.kernels|from sparse_ref import kernels)",
                         re.M)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "backend.py" or rel.startswith(("kernels/", "bench/")):
            continue
        text = path.read_text()
        found += [f"{rel}: {m.group(0)}" for pattern in (asks, imports) for m in pattern.finditer(text)]
    assert not found, found
