"""The engine's decode step reads no device value back to the host, and runs the one decode path.

The batch of a step is checked once (``check_engine_forward``): a batch that ``decode_step`` built from
the live requests at the manager's current generation needs no value read at all, a batch built by hand
is read back once, and a stale one is refused. The layers then run inside ``values_checked()``, so the
entry points' value checks (each one a host sync on a GPU) are skipped there, and only there.
"""

from __future__ import annotations

import pytest
import torch
from host_reads import count_host_reads

import sparse_ref
from sparse_ref.backend import choose_backend
from sparse_ref.batch import ForwardBatch, ForwardMode, decode_step
from sparse_ref.checks import check_range, skip_value_checks, values_checked
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.errors import BatchError, ShapeError
from sparse_ref.workloads import PlantedEngineWorkload

INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)
CONFIG = SparseConfig(page_budget=3, num_recent_pages=1, min_sparse_seq_len=12)


def engine(layers=("quest", "deepseek_dsa", None), device="cpu", backend="torch", prompts=(40, 23, 61)):
    wl = PlantedEngineWorkload(num_layers=len(layers), num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=7)
    e = DecodeEngine(wl, list(layers), CONFIG, dsa_topk=8, page_size=4, max_requests=4, max_context_len=96,
                     backend=backend, compare_dense=False, device=device)
    for n in prompts:
        e.add_request(n)
    return e


def hand_built(batch: ForwardBatch) -> ForwardBatch:
    """The same batch, built by hand (no builder stamp): its values are read back once."""
    return ForwardBatch(ForwardMode.DECODE, batch.req_pool_indices.clone(), batch.seq_lens.clone(),
                        batch.positions.clone(), batch.out_cache_loc.clone())


def test_value_checks_run_outside_and_skip_inside_values_checked():
    bad = torch.tensor([5])
    with pytest.raises(ShapeError, match="values in"):
        check_range("x", bad, 0, 3)
    assert not skip_value_checks()
    with values_checked():
        assert skip_value_checks()
        check_range("x", bad, 0, 3)  # the caller vouches for the values: nothing is read
    assert not skip_value_checks()


def test_values_checked_ends_with_its_block_even_on_error():
    with pytest.raises(RuntimeError), values_checked():
        raise RuntimeError("boom")
    assert not skip_value_checks()


@pytest.mark.parametrize("layers", [("quest", "deepseek_dsa", None), ("quest",) * 4])
def test_eager_step_reads_nothing_back(layers):
    """The host half builds the batch (``decode_step``) and the device half runs every layer (``forward``): neither
    reads a device value. (The workload's inputs are made on the host, like a model's activations: not counted.)"""
    e = engine(layers)
    e.step()
    with count_host_reads() as reads:
        batch = decode_step(e.manager, e.live)
    inputs = [e.decode_inputs(layer) for layer in range(len(layers))]
    with count_host_reads() as reads_forward:
        e.forward(batch, inputs)
    assert sum(reads.values()) == 0 and sum(reads_forward.values()) == 0, (dict(reads), dict(reads_forward))


def test_counter_sees_the_reads_of_a_hand_built_batch():
    """The counter is not blind: a batch without the builders' stamp is read back (once per batch, not per layer)."""
    counts = []
    for layers in (("quest",), ("quest", "quest", "quest")):
        e = engine(layers)
        batch = hand_built(decode_step(e.manager, e.live))
        inputs = [e.decode_inputs(layer) for layer in range(len(layers))]
        with count_host_reads() as reads:
            e.forward(batch, inputs)
        counts.append(sum(reads.values()))
    assert counts[0] > 0 and counts[0] == counts[1], counts


def test_outside_the_engine_the_entry_points_still_read_values():
    """Only the engine's step skips the value checks: a direct retrieve_topk call still checks its batch."""
    e = engine(("quest",))
    batch = decode_step(e.manager, e.live)
    q = e.decode_inputs(0)[0]
    algo = e.coordinator.algorithms[0]
    mask = torch.ones(batch.batch_size, dtype=torch.bool)
    with count_host_reads() as reads:
        algo.retrieve_topk(q, 0, batch.req_pool_indices, mask, forward_batch=batch)
    assert sum(reads.values()) > 0


def test_builder_stamp_goes_stale_when_a_request_moves():
    e = engine(("quest",))
    batch = decode_step(e.manager, e.live)
    assert batch.is_current(e.manager, e.live)
    assert not batch.is_current(e.manager, e.live[:2])  # another set of requests
    assert not hand_built(batch).is_current(e.manager, e.live)
    e.manager.grow(e.live[0], 1)
    assert not batch.is_current(e.manager, e.live)


def test_a_stale_stamped_batch_is_refused_before_any_write():
    e = engine(("quest",))
    old = decode_step(e.manager, e.live)
    inputs = [e.decode_inputs(0)]
    e.finish(e.live[2])
    e.add_request(61)  # same shape as the one that left: only the generation tells them apart
    e.manager.grow(e.live[2], 1)
    k_before = e.manager.token_to_kv_pool.get_key_buffer(0).clone()
    with pytest.raises(BatchError, match="generation"):
        e.forward(old, inputs)
    assert torch.equal(e.manager.token_to_kv_pool.get_key_buffer(0), k_before)


def test_engine_runs_the_fused_retrieval_the_bench_times(monkeypatch):
    """One decode path: the engine's page layers and the bench's sparse step both call retrieve_attention_metadata,
    which (Triton selection) runs select_pages_to_table once per layer and no separate adaptor launch."""
    from sparse_ref.bench.decode_setup import decode_step_setup
    from sparse_ref.kernels import page_select, page_table

    calls = []
    for module, name in ((page_select, "select_pages_to_table"), (page_select, "select_pages_triton"),
                         (page_table, "page_table_from_selection")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])
    device = sparse_ref.default_device()
    e = engine(("quest", None, "quest"), device=device, backend="triton", prompts=(40, 61))  # what "auto" picks on CUDA
    e.step()
    assert calls == ["page_table_from_selection"] + ["select_pages_to_table"] * 2, calls  # (forward_begin: dense)
    calls.clear()
    s = decode_step_setup(2, 4, 2, 16, 200, 16, 128, torch.float32, device, kv_dtype=torch.float32)
    s.algo.backend = choose_backend("triton", device)
    calls.clear()  # (the set-up built the dense step's table: on CUDA one page-table launch)
    s.sparse_step()
    assert calls == ["select_pages_to_table"], calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_eager_step_has_no_host_sync():
    """On CUDA, torch itself refuses every synchronizing call inside the step's device half."""
    e = engine(("quest", "deepseek_dsa", None, "quest"), device="cuda", backend="auto")
    e.step()
    batch = decode_step(e.manager, e.live)  # the host half uploads the step's lengths and slots (host -> device)
    inputs = [e.decode_inputs(layer) for layer in range(4)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        traces, _ = e.forward(batch, inputs)  # the device half: every layer, no value read back
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(traces) == 4 and all(bool(torch.isfinite(t.out).all()) for t in traces)
    torch.cuda.set_sync_debug_mode("error")
    try:  # the debug mode is on: a value read back raises (the check above is not blind)
        with pytest.raises(RuntimeError, match="synchroniz"):
            int(batch.seq_lens[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_stamped_batch_edited_or_rebuilt_is_checked_again():
    """The builders' stamp covers the batch's tensors: a field replaced (dataclasses.replace) or edited in place
    loses the trust, so the values are read back and another request's slot is refused."""
    import dataclasses

    e = engine(("quest",))
    inputs = [None]
    batch = decode_step(e.manager, e.live)
    inputs = [e.decode_inputs(0)]
    other = batch.out_cache_loc.flip(0)  # each token pointed at another request's slot
    replaced = dataclasses.replace(batch, out_cache_loc=other)
    assert batch.is_current(e.manager, e.live) and not replaced.is_current(e.manager, e.live)
    k_before = e.manager.token_to_kv_pool.get_key_buffer(0).clone()
    with pytest.raises(BatchError, match="out_cache_loc"):
        e.forward(replaced, inputs)
    batch.out_cache_loc.copy_(other)  # in place: the version counter moves
    assert not batch.is_current(e.manager, e.live)
    with pytest.raises(BatchError, match="out_cache_loc"):
        e.forward(batch, inputs)
    assert torch.equal(e.manager.token_to_kv_pool.get_key_buffer(0), k_before)
