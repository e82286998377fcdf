"""The decode engine: many steps with requests joining and leaving, sparse against dense.

Properties, at every step (hypothesis drives the joins, leaves and steps):

* with a full budget (Quest keep ratio 1, DSA ``index_topk`` >= the context) sparse equals dense;
* with a small budget, each Quest/DSA output equals attention restricted to the selection,
  recomputed here from the K/V pool by hand;
* no request reads another's KV: every page-table entry names a page (or slot) its own request
  holds, below its length; every selection lies in ``[0, pages)`` of its own request;
* no stale state after pages are freed and reused: Quest bounds are valid exactly on the complete
  pages of live requests and equal the min/max of their keys; the indexer cache holds keys exactly
  for the live tokens; and a request replayed alone in a fresh engine gets the same selections and
  outputs as it did among the others.
"""

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ref.batch import build_decode_batch
from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.engine_graph import GraphedDecodeStep
from sparse_ref.errors import BatchError, ConfigError
from sparse_ref.workloads import PlantedEngineWorkload

PAGE = 4
MAX_CTX = 48
LAYERS = ["quest", "deepseek_dsa", None]
INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)


def workload(num_layers=3):
    return PlantedEngineWorkload(num_layers=num_layers, num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                                 num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=3)


def make_engine(config, dsa_topk, num_pages=30, max_requests=4, backend="torch", device="cpu"):
    return DecodeEngine(workload(), LAYERS, config, dsa_topk=dsa_topk, page_size=PAGE, max_requests=max_requests,
                        max_context_len=MAX_CTX, num_pages=num_pages, backend=backend, device=device)


def attention_over(engine, layer, q, req, positions):
    """Reference: softmax attention of ``q`` [H_q, D] over the request's tokens at ``positions`` (logical)."""
    pool = engine.manager.token_to_kv_pool
    slots = engine.manager.req_to_token_pool.req_to_token[req.req_pool_idx, positions].long()
    k, v = pool.get_key_buffer(layer)[slots], pool.get_value_buffer(layer)[slots]  # [T, H_kv, D]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [T, H_q, D]
    probs = torch.softmax(torch.einsum("hd,thd->ht", q, k) / math.sqrt(q.shape[1]), dim=-1)
    return torch.einsum("ht,thd->hd", probs, v)


def kept_positions(md, row, seq_len):
    """Logical token positions a row of the metadata reads."""
    if md.selected is None or int(md.lengths[row]) == 0:
        return torch.arange(seq_len)
    chosen = md.selected[row, : int(md.lengths[row])].long()
    if md.page_size == 1:
        return chosen
    pos = (chosen[:, None] * md.page_size + torch.arange(md.page_size)).flatten()
    return pos[pos < seq_len]


def check_isolation(engine, result):
    """Every table entry and selection belongs to its own request; outputs match attention over the selection."""
    reqs = {r.rid: r for r in engine.live}
    rtt = engine.manager.req_to_token_pool.req_to_token
    for trace in result.layers:
        md = trace.metadata
        for row, rid in enumerate(result.rids):
            req, seq_len = reqs[rid], int(result.seq_lens[row])
            kv_len, ps = int(md.kv_lens[row]), md.page_size
            used = md.page_table[row, : -(-kv_len // ps)].long()
            own = set(req.pages) if ps > 1 else set(rtt[req.req_pool_idx, :seq_len].tolist())
            assert set(used.tolist()) <= own, f"layer {trace.layer} request {rid} reads pages it does not own"
            assert bool((md.page_table[row, -(-kv_len // ps):] == 0).all())  # the rest is padding page 0
            if md.selected is not None:
                chosen = md.selected[row][md.selected[row] >= 0]
                assert int(chosen.numel()) == int(md.lengths[row]) or not bool(md.sparse_mask[row])
                assert bool((chosen < -(-seq_len // ps)).all())
                if seq_len < engine.coordinator.configs[trace.layer].min_sparse_seq_len:
                    assert int(md.lengths[row]) == 0 and kv_len == seq_len  # dense below the threshold
            positions = kept_positions(md, row, seq_len)
            assert kv_len == len(positions)
            expected = attention_over(engine, trace.layer, trace_queries(engine, trace.layer, rid, seq_len), req,
                                      positions)
            torch.testing.assert_close(trace.out[row], expected, rtol=1e-4, atol=1e-5)


def trace_queries(engine, layer, rid, seq_len):
    return engine.workload.decode(engine.plans[rid], layer, seq_len - 1)[0]


def check_no_stale_state(engine):
    """Quest bounds and indexer keys exist exactly for the live requests' data, and match it."""
    P = engine.manager.page_size
    rtt = engine.manager.req_to_token_pool.req_to_token
    complete = {p for r in engine.live for p in r.pages[: r.seq_len // P]}
    live_slots = {s for r in engine.live for s in rtt[r.req_pool_idx, : r.seq_len].tolist()}
    for layer, algo in enumerate(engine.coordinator.algorithms):
        if algo is not None and algo.name == "quest":
            valid = set(algo.page_valid[layer].nonzero().flatten().tolist())
            assert valid == complete, f"layer {layer}: bounds on pages {valid ^ complete} disagree with live data"
            keys = engine.manager.token_to_kv_pool.get_key_buffer(layer).view(-1, P, *algo.page_min[layer].shape[1:])
            for p in complete:
                assert torch.equal(algo.page_min[layer][p], keys[p].amin(0))
                assert torch.equal(algo.page_max[layer][p], keys[p].amax(0))
        if layer in engine.coordinator.indexers:
            cache = engine.coordinator.indexers[layer].cache
            written = set(cache.written[layer].nonzero().flatten().tolist())
            assert written == live_slots, f"layer {layer}: indexer keys at slots {written ^ live_slots}"


OPS = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 30)), st.just(("step",)), st.just(("step",)),
                         st.just(("step",)), st.just(("graph",)), st.just(("stale",)),
                         st.tuples(st.just("finish"), st.integers(0, 3))), min_size=4, max_size=16)


def engine_state(e):
    """Everything a forward can write (K/V, req_to_token, Quest bounds, indexer keys) and the host bookkeeping."""
    pool, m = e.manager.token_to_kv_pool, e.manager
    tensors = [*pool.k_buffer, *pool.v_buffer, m.req_to_token_pool.req_to_token]
    for layer, algo in enumerate(e.coordinator.algorithms):
        if algo is not None and algo.name == "quest":
            tensors += [algo.page_min[layer], algo.page_max[layer], algo.page_valid[layer]]
    for layer, indexer in e.coordinator.indexers.items():
        tensors += [indexer.cache.written[layer].clone()]
    return [t.clone() for t in tensors], m.generation, m.allocator.available_pages(), [r.seq_len for r in e.live]


def replay_stale(e, saved):
    """Replay the last step's batch (eager forward and graphed replay): refused once the engine moved on, the
    same writes again before; either way nothing changes."""
    generation, batch, inputs, graph = saved
    before = engine_state(e)
    for replay in (lambda: e.forward(batch, inputs), None if graph is None else graph.replay):
        if replay is None:
            continue
        if generation != e.manager.generation:
            with pytest.raises(BatchError):
                replay()
        else:
            replay()
        after = engine_state(e)
        assert after[1:] == before[1:] and all(torch.equal(a, b) for a, b in zip(after[0], before[0], strict=True))
FIRST = st.lists(st.tuples(st.just("add"), st.integers(1, 30)), min_size=1, max_size=2)


def run(ops, engines):
    """Apply the same joins/leaves/steps to each engine; yield the step results side by side."""
    history = {}  # rid -> (prompt_len, steps, last outputs per layer, last selections per layer)
    saved = {}  # engine index -> (generation, batch, inputs, graph) of its last step
    for op in ops:
        ref = engines[0]
        if op[0] == "stale":
            for i, e in enumerate(engines):
                if i in saved:
                    replay_stale(e, saved[i])
            continue
        if op[0] == "add":
            pages = -(-op[1] // PAGE) + 1
            if len(ref.live) < 4 and ref.manager.allocator.available_pages() >= pages:
                for e in engines:
                    req = e.add_request(op[1])
                history[req.rid] = [op[1], 0, None]
        elif op[0] == "finish" and ref.live:
            i = op[1] % len(ref.live)
            for e in engines:
                e.finish(e.live[i])
        elif op[0] in ("step", "graph") and ref.live:
            need = sum(ref.manager.pages_needed(r) for r in ref.live)
            if need > ref.manager.allocator.available_pages() or max(r.seq_len for r in ref.live) >= MAX_CTX:
                continue
            graphs = [GraphedDecodeStep(e) if op[0] == "graph" else None for e in engines]
            results = [e.step() if g is None else g.step() for e, g in zip(engines, graphs, strict=True)]
            layers = results[-1] if op[0] == "graph" else results[-1].layers
            for i, (e, g) in enumerate(zip(engines, graphs, strict=True)):  # the batch this step ran
                saved[i] = (e.manager.generation, build_decode_batch(e.manager, e.live),
                            [e.decode_inputs(layer) for layer in range(len(LAYERS))], g)
            for row, r in enumerate(ref.live):
                history[r.rid][1] += 1
                history[r.rid][2] = [(t.out[row].clone(), None if t.metadata.selected is None else
                                      t.metadata.selected[row].clone()) for t in layers]
            if op[0] == "step":
                yield engines, results
    yield engines, history


@settings(max_examples=8, deadline=None)
@given(first=FIRST, ops=OPS, budget=st.integers(1, 3), recent=st.integers(1, 2), min_sparse=st.sampled_from([0, 9, 20]),
       gqa=st.sampled_from(["mean", "per_kv_head"]), topk=st.integers(1, 12))
def test_engine_lifecycle(first, ops, budget, recent, min_sparse, gqa, topk):
    full = make_engine(SparseConfig(keep_ratio=1.0), dsa_topk=MAX_CTX)
    sparse = make_engine(SparseConfig(page_budget=budget, num_recent_pages=recent, min_sparse_seq_len=min_sparse,
                                      gqa_mode=gqa), dsa_topk=topk)
    for _engines, results in run(first + ops, [full, sparse]):
        if isinstance(results, dict):
            history = results
            break
        for trace in results[0].layers:  # full budget: sparse == dense at every step
            torch.testing.assert_close(trace.out, trace.dense_out, rtol=1e-5, atol=1e-5)
            assert bool((trace.mass_kept > 1 - 1e-5).all()) and bool((trace.recall == 1).all())
        check_isolation(sparse, results[1])
        check_no_stale_state(sparse)
        check_no_stale_state(full)
    # Replay every live request alone, in a fresh engine: same selections, same outputs.
    for req in sparse.live:
        prompt_len, n_steps, last = history[req.rid]
        if n_steps == 0:
            continue
        alone = make_engine(sparse.coordinator.configs[0], dsa_topk=topk)
        alone.add_request(prompt_len, key=req.rid)
        for _ in range(n_steps):
            result = alone.step()
        for (out, sel), trace in zip(last, result.layers, strict=True):
            torch.testing.assert_close(trace.out[0], out, rtol=1e-4, atol=1e-5)
            if sel is not None:
                assert torch.equal(trace.metadata.selected[0], sel)


def test_freed_pages_are_reused_without_stale_state():
    engine = make_engine(SparseConfig(page_budget=1, num_recent_pages=1), dsa_topk=4, num_pages=12, max_requests=2)
    first = engine.add_request(30)
    for _ in range(3):
        engine.step()
    old_pages = set(first.pages)
    engine.finish(first)
    check_no_stale_state(engine)  # nothing left of the first request
    second = engine.add_request(21)  # 6 pages, all of them from the first request
    assert set(second.pages) <= old_pages
    check_no_stale_state(engine)
    result = engine.step()
    check_isolation(engine, result)
    alone = make_engine(SparseConfig(page_budget=1, num_recent_pages=1), dsa_topk=4, num_pages=12, max_requests=2)
    alone.add_request(21, key=second.rid)
    for a, b in zip(alone.step().layers, result.layers, strict=True):
        torch.testing.assert_close(a.out, b.out, rtol=1e-4, atol=1e-5)


def test_workload_is_independent_of_the_batch():
    wl = workload()
    plan = wl.request(7, 20)
    a = wl.decode(plan, 1, 25)
    wl.request(8, 33)
    b = wl.decode(plan, 1, 25)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    k, v, x = wl.prefill(plan, 0)
    assert k.shape == (20, 2, 8) and x.shape == (20, INDEXER.hidden_size)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ConfigError, match="one entry per workload layer"):
        DecodeEngine(workload(), ["quest"])
    with pytest.raises(ConfigError, match="backend"):
        DecodeEngine(workload(), LAYERS, backend="cuda")
    with pytest.raises(ConfigError, match="each entry must be one of"):
        DecodeEngine(workload(), ["quest", "snapkv", None])
    with pytest.raises(ConfigError, match="prompt_len"):
        make_engine(SparseConfig(), dsa_topk=4).add_request(0)


@pytest.mark.skipif(importlib.util.find_spec("sparse_ref.kernels.decode_attention") is None,
                    reason="sparse_ref.kernels.decode_attention is not installed yet")
def test_triton_backend_matches_torch_through_the_engine(device):
    """The kernel on CUDA, or through Triton's interpreter on CPU, against the torch reference."""
    config = SparseConfig(page_budget=2, num_recent_pages=1)
    engines = [make_engine(config, dsa_topk=6, backend=b, device=device) for b in ("torch", "triton")]
    for e in engines:
        e.add_request(23)
        e.add_request(9)
    for _ in range(2):
        ref, tri = (e.step() for e in engines)
        for a, b in zip(ref.layers, tri.layers, strict=True):
            torch.testing.assert_close(b.out, a.out, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_cuda_engine_matches_cpu_engine():
    """On CUDA every "auto" backend picks Triton (Quest scoring, page selection, attention when installed)."""
    config = SparseConfig(page_budget=3, num_recent_pages=2, gqa_mode="per_kv_head")
    wl = PlantedEngineWorkload(num_layers=3, num_q_heads=8, num_kv_heads=2, head_dim=64, num_needles=4,
                               num_head_needles=2, seed=5)
    engines = [DecodeEngine(wl, LAYERS, config, dsa_topk=96, max_requests=3, max_context_len=1200, device=d,
                            backend="auto") for d in ("cpu", "cuda")]
    for e in engines:
        for n in (1000, 333, 17):
            e.add_request(n)
    rows = differing = 0
    for step in range(20):  # crosses page boundaries: the bounds of completed pages are built on the GPU too
        if step == 10:
            for e in engines:
                e.finish(e.live[1])
                e.add_request(500)
        cpu, gpu = (e.step() for e in engines)
        for a, b in zip(cpu.layers, gpu.layers, strict=True):
            same = torch.ones(len(cpu.rids), dtype=torch.bool)
            if a.metadata.selected is not None:  # a near-tie may round the other way on the GPU
                same = (a.metadata.selected == b.metadata.selected.cpu()).all(dim=1)
            rows += len(same)
            differing += int((~same).sum())
            torch.testing.assert_close(b.out.cpu()[same], a.out[same], rtol=1e-3, atol=1e-4)
    assert differing <= rows // 20, f"{differing} of {rows} rows selected differently on the GPU"


@pytest.mark.parametrize("layers", [["quest"], ["deepseek_dsa"]])
def test_the_coordinator_goes_sparse_at_exactly_min_sparse_seq_len(layers):
    """Rows of exactly min_sparse_seq_len tokens are sparse and one token shorter dense, on both layer kinds;
    the dense row then reads its whole context (its kv_len is its seq_len)."""
    wl = PlantedEngineWorkload(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=3)
    cfg = SparseConfig(page_budget=1, num_recent_pages=1, min_sparse_seq_len=21)
    e = DecodeEngine(wl, layers, cfg, dsa_topk=4, page_size=PAGE, max_requests=2, max_context_len=MAX_CTX,
                     num_pages=30, backend="torch")
    e.add_request(20), e.add_request(19)  # the step decodes token 21 and token 20
    md = e.step().layers[0].metadata
    assert md.sparse_mask.tolist() == [True, False]
    assert int(md.kv_lens[1]) == 20 and int(md.kv_lens[0]) < 21
