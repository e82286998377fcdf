"""``GraphedDecodeStep``: the engine's device half of a decode step as one CUDA graph.

CPU: the static-tensor step equals ``engine.step()`` step after step (across page boundaries), the
device half makes no host sync while "capturing", and every broken assumption is refused before
anything changes. GPU: the captured graph, replayed for many steps, equals the eager engine.
"""

import sys
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparse_ref import checks
from sparse_ref.backend import choose_backend
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.engine_graph import GraphedDecodeStep
from sparse_ref.errors import BatchError, ConfigError, PoolError
from sparse_ref.workloads import PlantedEngineWorkload

PAGE = 4
LAYERS = ["quest", "deepseek_dsa", None]
INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)


def make_engine(device="cpu", backend="torch", layers=LAYERS, max_context_len=48, num_pages=None, head_dim=8,
                dtype=torch.float32, gqa="mean"):
    wl = PlantedEngineWorkload(num_layers=len(layers), num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
                               num_needles=2, num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=3)
    config = SparseConfig(page_budget=2, num_recent_pages=1, min_sparse_seq_len=9, gqa_mode=gqa)
    engine = DecodeEngine(wl, layers, config, dsa_topk=6, page_size=PAGE, max_requests=4,
                          max_context_len=max_context_len, num_pages=num_pages, backend=backend,
                          compare_dense=False, dtype=dtype, device=device)
    for n in (22, 5, 13):  # 5 < min_sparse_seq_len: that row stays dense until it grows past 9
        engine.add_request(n)
    return engine


def quest_state(engine):
    algo = engine.coordinator.algorithms[0]
    return algo.page_min[0].clone(), algo.page_max[0].clone(), algo.page_valid[0].clone()


def assert_same_step(got, want, exact_floats=True):
    for a, b in zip(got, want, strict=True):
        if exact_floats:
            assert torch.equal(a.out, b.out), a.layer
        else:
            torch.testing.assert_close(a.out, b.out, rtol=1e-5, atol=1e-5)
        for name in ("page_table", "kv_lens", "selected", "lengths", "sparse_mask"):
            x, y = getattr(a.metadata, name), getattr(b.metadata, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (a.layer, name)


def test_static_step_equals_the_eager_engine_across_page_boundaries():
    eager, graphed = make_engine(), make_engine()
    step = GraphedDecodeStep(graphed)
    for _ in range(6):  # lengths 22/5/13 -> 28/11/19: every request fills a page and takes a fresh one
        want = eager.step().layers
        got = step.step()
        assert_same_step(got, want)
        for a, b in zip(quest_state(graphed), quest_state(eager), strict=True):
            assert torch.equal(a, b)
    assert [r.seq_len for r in graphed.live] == [r.seq_len for r in eager.live] == [28, 11, 19]
    assert step.batch.seq_lens.tolist() == [28, 11, 19]


class HostOps(TorchDispatchMode):
    """Records the ops a CUDA graph capture refuses: host syncs and tensors made from host values."""

    REFUSED = {"aten.lift_fresh.default", "aten._local_scalar_dense.default", "aten.equal.default",
               "aten.is_nonzero.default", "aten.nonzero.default"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in self.REFUSED:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_device_half_makes_no_host_sync_while_capturing(backend, device, monkeypatch):
    """Pretend to capture (every check that reads device data is then skipped) and record the refused ops."""
    if device.type == "cuda" and backend == "torch":
        pytest.skip("on CUDA the graph takes the Triton kernel (it refuses the torch reference)")
    engine = make_engine(device=device, backend=backend, head_dim=16)
    step = GraphedDecodeStep(engine)
    step.step()  # the host half, and an eager first run
    want = [(t.out.clone(), t.metadata.page_table.clone()) for t in step.traces]
    real = checks.capturing
    for name, module in list(sys.modules.items()):
        if name.startswith("sparse_ref") and getattr(module, "capturing", None) is real:
            monkeypatch.setattr(module, "capturing", lambda: True)
    with HostOps() as ops:
        got = step.run_device_half()  # the same step again: what the graph holds
    assert ops.seen == []
    for (out, table), trace in zip(want, got, strict=True):
        assert torch.equal(trace.out, out) and torch.equal(trace.metadata.page_table, table)


def test_the_host_half_does_sync():
    """The check above can fail: the host half (decode_step's checks) records refused ops."""
    engine = make_engine()
    step = GraphedDecodeStep(engine)
    with HostOps() as ops:
        step.step()
    assert ops.seen


def test_refuses_a_changed_batch_before_changing_anything():
    engine = make_engine()
    step = GraphedDecodeStep(engine)
    step.step()
    lens = [r.seq_len for r in engine.live]
    engine.finish(engine.live[1])
    with pytest.raises(BatchError, match="a request joined or left"):
        step.step()
    assert [r.seq_len for r in engine.live] == [lens[0], lens[2]]  # nobody grew
    engine.add_request(7)
    with pytest.raises(BatchError, match="capture a new GraphedDecodeStep"):
        step.step()
    GraphedDecodeStep(engine).step()  # a new capture for the new batch works


def test_refuses_no_requests_and_the_torch_kernel_on_cuda():
    engine = make_engine()
    for r in list(engine.live):
        engine.finish(r)
    with pytest.raises(BatchError, match="engine.live"):
        GraphedDecodeStep(engine)
    fake = SimpleNamespace(live=[object()], device=torch.device("cuda"), backend=choose_backend("torch", "cuda"))
    with pytest.raises(ConfigError, match="backend"):
        GraphedDecodeStep(fake)


def test_out_of_pages_or_context_fails_on_the_host_before_the_replay():
    engine = make_engine(num_pages=13)  # 22/5/13 tokens take 6+2+4 = 12 of the 12 usable pages
    step = GraphedDecodeStep(engine)
    step.step()  # 23/6/14: every last page still has room
    step.step()
    lens = [r.seq_len for r in engine.live]
    with pytest.raises(PoolError):  # 25 > 24 tokens: request 0 needs a 7th page, none is free
        for _ in range(3):
            step.step()
            lens = [r.seq_len for r in engine.live]
    assert [r.seq_len for r in engine.live] == lens  # all or nothing: the failed step grew nobody
    short = make_engine(max_context_len=23)
    step = GraphedDecodeStep(short)
    step.step()
    with pytest.raises(PoolError, match="max_context_len"):
        step.step()


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", ["mean", "per_kv_head"])
def test_cuda_graph_replays_equal_the_eager_engine(gqa):
    """Captured once, replayed for 40 steps (pages fill, fresh pages come): outputs, tables and bounds as eager."""
    layers = ["quest", None, "quest", "deepseek_dsa"]
    kw = dict(device="cuda", backend="triton", layers=layers, max_context_len=160, head_dim=64, dtype=torch.bfloat16,
              gqa=gqa)
    eager, graphed = make_engine(**kw), make_engine(**kw)
    step = GraphedDecodeStep(graphed)
    for i in range(40):
        if i == 20:
            step.run_device_half()  # an eager run of the device half in between (as the bench does) changes nothing
        want = eager.step().layers
        got = step.step()
        assert step.graph is not None
        assert_same_step(got, want, exact_floats=False)
        for layer in (0, 2):
            a, b = (e.coordinator.algorithms[layer] for e in (graphed, eager))
            for name in ("page_min", "page_max", "page_valid"):
                assert torch.equal(getattr(a, name)[layer], getattr(b, name)[layer]), (i, layer, name)
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite is the full-size bench: run it directly")
def test_bench_engine_suite_runs_on_cpu(tmp_path):
    """The ``engine`` suite at its tiny CPU sizes (interpreter, no graph): one row with the step and its parts."""
    from sparse_ref import bench

    result = bench.main(["engine", "--quick", "--allow-cpu", "--out", str(tmp_path / "engine.json")])
    (row,) = result["rows"]
    assert row["op"] == "engine_step" and result["cpu_only"]
    assert set(row["parts_us"]) == {"K/V append", "retrieval + page table", "attention", "representation update",
                                    "dense metadata (once per step)"}
    assert row["ours_us"] > 0 and row["torch_us"] > 0 and row["sum_of_parts_per_layer_us"] > 0
    assert "eager" in row["ours_timing"]
