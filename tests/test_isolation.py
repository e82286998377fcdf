"""No request touches another's KV through stale state, and every entry point refuses before it acts.

One test (at least) per class of the second adversarial pass, each failing on the code before it:
stale batches and replays (the engine, the graphed step, a hand-built batch), a launcher that trusted
its caller, half-applied operations, validated values that were not the ones used, exceptions of other
types escaping, bad input accepted, and the CLIs. Every refusal is checked to leave the state as it was.
"""

import dataclasses

import numpy as np
import pytest
import torch
import triton

import sparse_ref
from sparse_ref import (
    BatchError,
    ConfigError,
    KVCacheManager,
    PoolError,
    SparseConfig,
    SparseRefError,
    build_decode_batch,
    decode_step,
)
from sparse_ref.algorithms import QuestAlgorithm, create_sparse_algorithm, register_sparse_algorithm
from sparse_ref.algorithms.quest import quest_page_scores_reference
from sparse_ref.batch import ForwardBatch, ForwardMode, build_extend_batch
from sparse_ref.config import IndexerConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.engine_graph import GraphedDecodeStep
from sparse_ref.errors import UnknownAlgorithmError
from sparse_ref.hadamard import hadamard_matrix
from sparse_ref.kernels.page_table import page_table_from_selection
from sparse_ref.selection import selection_width, topk_reference
from sparse_ref.workloads import PlantedEngineWorkload

DEVICE = sparse_ref.default_device()  # the kernel launchers' tensors: CUDA on a GPU machine, else CPU (interpreter)
PAGE = 4
INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)


def engine(layers=("quest", None), **kw):
    wl = PlantedEngineWorkload(num_layers=len(layers), num_q_heads=4, num_kv_heads=2, head_dim=8, num_needles=2,
                               num_head_needles=1, local_window=4, indexer_config=INDEXER, seed=3)
    cfg = SparseConfig(page_budget=2, num_recent_pages=1, min_sparse_seq_len=8)
    settings = {"dsa_topk": 8, "page_size": PAGE, "max_requests": 3, "max_context_len": 48, "num_pages": 30,
                "backend": "torch", **kw}
    return DecodeEngine(wl, list(layers), cfg, **settings)


def snapshot(e):
    """Everything a step can write: the pools, req_to_token, the allocator, Quest bounds, the live set."""
    pool, algo = e.manager.token_to_kv_pool, e.coordinator.algorithms[0]
    tensors = [*pool.k_buffer, *pool.v_buffer, e.manager.req_to_token_pool.req_to_token]
    if algo is not None:
        tensors += [algo.page_min[0], algo.page_max[0], algo.page_valid[0]]
    return ([t.clone() for t in tensors], e.manager.allocator.available_pages(), e.manager.generation,
            [r.rid for r in e.live], [r.seq_len for r in e.live])


def assert_unchanged(before, after):
    (t0, *rest0), (t1, *rest1) = before, after
    assert rest0 == rest1
    assert all(torch.equal(a, b) for a, b in zip(t0, t1, strict=True))


# ---------------------------------------------------------------- 1. stale batches and replays
def test_replay_after_a_request_left_and_another_joined_is_refused_and_writes_nothing():
    e = engine()
    a, _ = e.add_request(13), e.add_request(9)
    g = GraphedDecodeStep(e)
    g.step()
    e.finish(a)
    e.add_request(11)  # takes a's row and (some of) its pages
    before = snapshot(e)
    for call in (g.replay, g.run_device_half):
        with pytest.raises(BatchError, match="the engine changed since step"):
            call()
        assert_unchanged(before, snapshot(e))


def test_replay_after_growth_or_before_any_step_is_refused_but_the_same_step_replays():
    e = engine()
    e.add_request(10)
    g = GraphedDecodeStep(e)
    with pytest.raises(BatchError, match="nothing to replay yet"):
        g.replay()
    g.step()
    after_step = snapshot(e)
    g.replay()  # the same step again: the same K/V and bounds written again
    assert_unchanged(after_step, snapshot(e))
    decode_step(e.manager, e.live)  # the request grows by a token outside the graph
    before = snapshot(e)
    with pytest.raises(BatchError, match="generation"):
        g.replay()
    assert_unchanged(before, snapshot(e))


def test_forward_with_a_batch_built_before_a_request_left_and_another_joined_is_refused():
    e = engine()
    a, b = e.add_request(13), e.add_request(9)
    batch = decode_step(e.manager, e.live)
    inputs = [e.decode_inputs(layer) for layer in range(2)]
    e.finish(a)
    c = e.add_request(batch.seq_lens[0].item())  # same row, same length: only the slots can tell
    assert c.req_pool_idx == a.req_pool_idx
    e.live = [c, b]  # the live order of the stale batch
    before = snapshot(e)
    with pytest.raises(BatchError):
        e.forward(batch, inputs)
    assert_unchanged(before, snapshot(e))


def test_forward_with_the_previous_steps_batch_is_refused_and_the_current_one_runs():
    e = engine()
    e.add_request(10)
    old = decode_step(e.manager, e.live)
    inputs = [e.decode_inputs(layer) for layer in range(2)]
    e.forward(old, inputs)
    new = decode_step(e.manager, e.live)
    before = snapshot(e)
    with pytest.raises(BatchError, match="the batch of the live requests now"):
        e.forward(old, inputs)
    assert_unchanged(before, snapshot(e))
    traces, _ = e.forward(new, [e.decode_inputs(layer) for layer in range(2)])
    assert len(traces) == 2


def quest_env():
    m = KVCacheManager.create(max_requests=3, max_context_len=32, num_pages=20, page_size=PAGE, head_dim=4)
    reqs = [m.admit(10), m.admit(7)]
    pool = m.token_to_kv_pool
    for r in reqs:
        slots = m.req_to_token_pool.req_to_token[r.req_pool_idx, : r.seq_len].long()
        pool.set_kv(0, slots, torch.randn(len(slots), 1, 4), torch.randn(len(slots), 1, 4))
    algo = QuestAlgorithm(SparseConfig(page_budget=1, num_recent_pages=1))
    algo.initialize_representation_pool(0, 1, pool, m.req_to_token_pool)
    algo.construct_representations(0, build_extend_batch(m, reqs), pool.get_key_buffer(0))
    return m, reqs, algo


@pytest.mark.parametrize("field", ["out_cache_loc", "positions"])
def test_retrieve_topk_refuses_a_batch_whose_slots_disagree_with_req_to_token(field):
    m, reqs, algo = quest_env()
    fb = build_decode_batch(m, reqs)
    if field == "out_cache_loc":  # the other request's slot: its K/V would be overwritten
        bad = dataclasses.replace(fb, out_cache_loc=fb.out_cache_loc.flip(0))
    else:  # positions and lengths one token back: the slots then name the previous token's
        bad = dataclasses.replace(fb, positions=fb.positions - 1, seq_lens=fb.seq_lens - 1)
    q, mask = torch.randn(2, 1, 4), torch.ones(2, dtype=torch.bool)
    with pytest.raises(BatchError, match="out_cache_loc"):
        algo.retrieve_topk(q, 0, bad.req_pool_indices, mask, forward_batch=bad)
    sel, lens = algo.retrieve_topk(q, 0, fb.req_pool_indices, mask, forward_batch=fb)  # the true batch runs
    assert sel.shape[0] == 2 and (lens >= 0).all()


def test_update_representations_refuses_another_requests_slots_before_writing_bounds():
    m, reqs, algo = quest_env()
    fb = decode_step(m, reqs)
    bad = dataclasses.replace(fb, out_cache_loc=fb.out_cache_loc.flip(0))
    bounds = [t.clone() for t in (algo.page_min[0], algo.page_max[0], algo.page_valid[0])]
    with pytest.raises(BatchError, match="out_cache_loc"):
        algo.update_representations(0, bad, m.token_to_kv_pool.get_key_buffer(0))
    assert all(torch.equal(a, b) for a, b in zip(bounds, (algo.page_min[0], algo.page_max[0], algo.page_valid[0]),
                                                 strict=True))


# ---------------------------------------------------------------- 2. a launcher applies the adaptor's contract
def launcher_env():
    m = KVCacheManager.create(max_requests=2, max_context_len=32, num_pages=12, page_size=PAGE, head_dim=4,
                              device=DEVICE)
    req = m.admit(9)  # 3 pages
    return m, req


@pytest.mark.parametrize("case", ["all-padding-long", "past-the-request", "negative", "duplicate", "not-last"])
def test_page_table_from_selection_refuses_what_the_adaptor_refuses(case):
    m, req = launcher_env()
    r2t = m.req_to_token_pool.req_to_token
    rows, seq = torch.tensor([req.req_pool_idx], device=DEVICE), torch.tensor([9], device=DEVICE)
    sel, lens = {"all-padding-long": ([-1, -1], 0), "past-the-request": ([0, 3], 2), "negative": ([-2, 2], 2),
                 "duplicate": ([2, 2], 2), "not-last": ([0, 1], 2)}[case]
    if case == "all-padding-long":
        seq = torch.tensor([30], device=DEVICE)  # a 9-token request read as 30 tokens: 12..29 from padding page 0
    with pytest.raises(SparseRefError):
        page_table_from_selection(torch.tensor([sel], dtype=torch.int32, device=DEVICE),
                                  torch.tensor([lens], dtype=torch.int32, device=DEVICE),
                                  torch.tensor([True], device=DEVICE), seq, rows, r2t, PAGE)


def test_page_table_from_selection_accepts_the_adaptor_contract():
    m, req = launcher_env()
    r2t = m.req_to_token_pool.req_to_token
    t = dict(device=DEVICE)
    table, kv_lens, cu = page_table_from_selection(
        torch.tensor([[0, 2]], dtype=torch.int32, **t), torch.tensor([2], dtype=torch.int32, **t),
        torch.tensor([True], **t), torch.tensor([9], **t), torch.tensor([req.req_pool_idx], **t), r2t, PAGE)
    pages = r2t[req.req_pool_idx, ::PAGE][:3].long() // PAGE
    assert table[0, :2].tolist() == [int(pages[0]), int(pages[2])]
    assert kv_lens.tolist() == [PAGE + 1] and cu.tolist() == [0, PAGE + 1]


# ---------------------------------------------------------------- 3. all-or-nothing
def test_finish_with_an_equal_request_of_another_engine_changes_nothing():
    e1, e2 = engine(), engine()
    a, other = e1.add_request(10), e2.add_request(10)
    assert (a.rid, a.req_pool_idx, a.seq_len) == (other.rid, other.req_pool_idx, other.seq_len)
    assert a != other, "requests compare by identity"
    before = snapshot(e1)
    with pytest.raises(PoolError, match="a live request of this engine"):
        e1.finish(other)
    assert_unchanged(before, snapshot(e1))
    free = e1.manager.allocator.available_pages()
    e1.finish(a)  # the true owner still frees it
    assert e1.live == [] and e1.manager.allocator.available_pages() > free


def test_finish_twice_is_refused_the_second_time():
    e = engine()
    a = e.add_request(10)
    e.finish(a)
    before = snapshot(e)
    with pytest.raises(PoolError):
        e.finish(a)
    assert_unchanged(before, snapshot(e))


# ---------------------------------------------------------------- 4. the checked value is the one stored
@pytest.mark.parametrize("make", [torch.tensor, np.int64, int])
def test_config_stores_plain_ints(make):
    cfg = SparseConfig(page_budget=make(3), num_recent_pages=make(2), num_sink_pages=make(1),
                       min_sparse_seq_len=make(8))
    for name in ("page_budget", "num_recent_pages", "num_sink_pages", "min_sparse_seq_len"):
        value = getattr(cfg, name)
        assert type(value) is int, (name, type(value))
    assert cfg.selection_width(10) == SparseConfig(page_budget=3, num_recent_pages=2, num_sink_pages=1,
                                                   min_sparse_seq_len=8).selection_width(10)


def test_config_with_a_tensor_selects_like_ints_through_quest():
    m, reqs, _ = quest_env()
    q, mask = torch.randn(2, 1, 4), torch.ones(2, dtype=torch.bool)
    fb = build_decode_batch(m, reqs)
    out = []
    for cfg in (SparseConfig(page_budget=1, num_recent_pages=torch.tensor(1)),
                SparseConfig(page_budget=1, num_recent_pages=1)):
        algo = QuestAlgorithm(cfg)
        algo.initialize_representation_pool(0, 1, m.token_to_kv_pool, m.req_to_token_pool)
        algo.construct_representations(0, build_extend_batch(m, reqs), m.token_to_kv_pool.get_key_buffer(0))
        out.append(algo.retrieve_topk(q, 0, fb.req_pool_indices, mask, forward_batch=fb))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("value", [10**400, float("inf"), float("nan"), torch.tensor(0.5).repeat(2)])
def test_config_refuses_what_a_float_cannot_hold(value):
    with pytest.raises(ConfigError, match="keep_ratio"):
        SparseConfig(keep_ratio=value)


# ---------------------------------------------------------------- 5. only SparseRefError escapes
def test_engine_and_graph_refuse_bad_objects_with_sparse_ref_errors():
    with pytest.raises(SparseRefError, match="device"):
        engine(device="tpu")
    with pytest.raises(SparseRefError, match="engine"):
        GraphedDecodeStep(object())


def test_coordinator_hooks_refuse_repeats_and_layers_out_of_range():
    e = engine()
    a = e.add_request(10)
    coord = e.coordinator
    with pytest.raises(PoolError, match="begun already"):
        coord.on_request_begin(a, 10)
    batch = decode_step(e.manager, e.live)
    coord.forward_begin(batch)
    q = e.decode_inputs(0)[0]
    for layer in (-1, 2, 1.0):
        with pytest.raises(SparseRefError, match="layer"):
            coord.attention_begin(layer, q, batch)
        with pytest.raises(SparseRefError, match="layer"):
            coord.attention_end(layer, batch)
    e.finish(a)
    with pytest.raises(PoolError, match="no request"):
        coord.on_request_end(a)


def test_quest_reference_refuses_pages_out_of_range():
    h, d, n = 1, 4, 5
    args = [torch.randn(1, h, d), torch.randn(1, h, d), torch.randn(n, h, d), torch.randn(n, h, d),
            torch.ones(n, dtype=torch.bool)]
    assert quest_page_scores_reference(*args, torch.tensor([[0, 4]])).shape == (1, 2)
    for pages in ([[0, 5]], [[-1, 2]]):
        with pytest.raises(SparseRefError, match="pages"):
            quest_page_scores_reference(*args, torch.tensor(pages))


def test_a_registered_algorithm_that_does_not_import_is_an_unknown_algorithm():
    register_sparse_algorithm("broken_for_test", "sparse_ref.no_such_module:Algo")
    register_sparse_algorithm("broken_attr_for_test", "sparse_ref.selection:NoSuchClass")
    for name in ("broken_for_test", "broken_attr_for_test"):
        with pytest.raises(UnknownAlgorithmError, match="does not import"):
            create_sparse_algorithm(name, SparseConfig())


# ---------------------------------------------------------------- 6. bad input refused
@pytest.mark.parametrize("kw, name", [({"num_pages": 0}, "num_pages"), ({"num_pages": 1}, "num_pages"),
                                      ({"compare_dense": "no"}, "compare_dense"), ({"dsa_topk": 0}, "dsa_topk")])
def test_engine_refuses_bad_settings(kw, name):
    with pytest.raises(SparseRefError, match=name):
        engine(**kw)


def test_small_entry_points_refuse_values_they_used_to_accept():
    cfg = SparseConfig(page_budget=2)
    with pytest.raises(SparseRefError, match="max_pages"):
        selection_width(-1, cfg)
    with pytest.raises(SparseRefError, match="lengths"):
        topk_reference(torch.randn(2, 5), 3, torch.tensor([6, 2]))
    with pytest.raises(SparseRefError, match="lengths"):
        topk_reference(torch.randn(2, 5), 3, torch.tensor([-1, 2]))
    for n in (True, 6, 0):
        with pytest.raises(SparseRefError):
            hadamard_matrix(n)
    for field in ("rope_theta", "layer_norm_eps"):
        with pytest.raises(ConfigError, match=field):
            IndexerConfig(**{field: float("inf")})


def test_forward_batch_with_duplicate_rows_or_scrambled_extend_positions_is_refused():
    m = KVCacheManager.create(max_requests=3, max_context_len=32, num_pages=20, page_size=PAGE, head_dim=4)
    a, b = m.admit(6), m.admit(5)
    ext = build_extend_batch(m, [a, b])
    with pytest.raises(BatchError, match="positions"):
        dataclasses.replace(ext, positions=ext.positions.flip(0))
    dec = build_decode_batch(m, [a, b])
    with pytest.raises(BatchError, match="req_pool_indices"):
        ForwardBatch(ForwardMode.DECODE, dec.req_pool_indices[[0, 0]], dec.seq_lens[[0, 0]],
                     dec.positions[[0, 0]], dec.out_cache_loc[[0, 0]])


def test_set_kv_refuses_complex_and_integer_values_and_keeps_the_pool():
    m = KVCacheManager.create(max_requests=1, max_context_len=16, num_pages=6, page_size=PAGE, head_dim=4)
    pool = m.token_to_kv_pool
    before = pool.k_buffer[0].clone()
    slots = torch.tensor([4, 5])
    for bad in (torch.randn(2, 1, 4, dtype=torch.complex64), torch.ones(2, 1, 4, dtype=torch.int64)):
        with pytest.raises(SparseRefError, match="k"):
            pool.set_kv(0, slots, bad, torch.randn(2, 1, 4))
    assert torch.equal(before, pool.k_buffer[0])


# ---------------------------------------------------------------- 7. the CLIs exit 2 naming the flag
@pytest.mark.parametrize("argv, flag", [(["--context", "0"], "--context"), (["--steps", "0"], "--steps"),
                                        (["--batch", "-1"], "--batch"), (["--budgets", "64", "0"], "--budgets"),
                                        (["--out", ""], "--out"), (["--quick", "--batch", "100"], "--context"),
                                        (["--quick", "--batch", "1000", "--context", "9000"], "--batch"),
                                        (["--quick", "--out", "plot.txt"], "--out"),
                                        (["--quick", "--budgets", "100000000"], "--budgets"),
                                        (["--quick", "--context", "1000000000000"], "--context"),
                                        (["--quick", "--context", "1e12"], "--context"),
                                        (["--quick", "--json", "x.json"], "--json"),
                                        (["--quick", "--tp", "3"], "--tp")])
def test_demo_exits_2_naming_the_flag(argv, flag, capsys, tmp_path, monkeypatch):
    """Every flag, and every combination of them, is checked before any work: one line, exit 2, no folder made."""
    from sparse_ref import demo

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    assert info.value.code == 2
    out = capsys.readouterr()
    (err,) = out.err.strip().splitlines()  # one line
    assert flag in err and "Traceback" not in err and out.out == "", err
    assert list(tmp_path.iterdir()) == [], "nothing was run or written"


def test_demo_and_bench_refuse_an_output_they_cannot_write(tmp_path, capsys):
    from sparse_ref import bench, demo

    (tmp_path / "a_file").write_text("")
    for main, argv in ((demo.main, ["--out", str(tmp_path / "a_file" / "demo.png")]),  # its folder is a file
                       (demo.main, ["--out", str(tmp_path)]),
                       (bench.main, ["topk", "--allow-cpu", "--out", str(tmp_path)]),
                       (bench.main, ["topk", "--allow-cpu", "--out", ""])):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "--out" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"], "nothing was run or written"


# ---------------------------------------------------------------- every public launcher checks before it launches
def launcher_cases():
    from sparse_ref.kernels.decode_attention import paged_decode_attention
    from sparse_ref.kernels.page_select import select_pages_to_table, select_pages_triton
    from sparse_ref.kernels.quest import quest_page_scores_from_queries
    from sparse_ref.kernels.topk import topk

    m, req = launcher_env()
    t = dict(device=DEVICE)
    r2t, rows = m.req_to_token_pool.req_to_token, torch.tensor([req.req_pool_idx], **t)
    kb = m.token_to_kv_pool.get_key_buffer(0)
    q, table = torch.randn(1, 2, 4, **t), torch.tensor([[1, 2, 3]], dtype=torch.int32, **t)
    kv = torch.tensor([9], dtype=torch.int32, **t)
    bounds = (torch.zeros(12, 1, 4, **t), torch.zeros(12, 1, 4, **t), torch.ones(12, dtype=torch.bool, **t))
    cfg, scores = SparseConfig(page_budget=1, num_recent_pages=1), torch.randn(1, 3, **t)
    seq, mask = torch.tensor([9], **t), torch.tensor([True], **t)
    return {
        "attention-page-past-the-pool": (lambda: paged_decode_attention(q, kb, kb, table + 20, kv, PAGE), "page_table"),
        "attention-kv-past-the-table": (lambda: paged_decode_attention(q, kb, kb, table, kv + 4, PAGE), "kv_lens"),
        "attention-int-q": (lambda: paged_decode_attention(q.long(), kb, kb, table, kv, PAGE), "q"),
        "quest-row-out-of-range": (lambda: quest_page_scores_from_queries(q, *bounds, r2t, rows + 5, PAGE, 3),
                                   "req_pool_indices"),
        "quest-page-size-0": (lambda: quest_page_scores_from_queries(q, *bounds, r2t, rows, 0, 3), "page_size"),
        "select-page-size-float-tensor": (lambda: select_pages_triton(scores, seq, mask, torch.tensor(4.0), cfg),
                                          "page_size"),
        "select-page-size-1d-tensor": (lambda: select_pages_triton(scores, seq, mask, torch.tensor([PAGE]), cfg),
                                       "page_size"),
        "select-seq-past-the-scores": (lambda: select_pages_triton(scores, seq + 8, mask, PAGE, cfg), "seq_lens"),
        "select-table-seq-on-padding": (lambda: select_pages_to_table(torch.randn(1, 8, **t), seq + 20, mask, PAGE,
                                                                      cfg, rows, r2t), "seq_lens"),
        "topk-negative-k": (lambda: topk(scores, -1), "k"),
        "topk-lengths-past-the-row": (lambda: topk(scores, 2, torch.tensor([4], **t)), "lengths"),
    }


@pytest.mark.parametrize("case", list(launcher_cases()))
def test_public_launchers_refuse_bad_input_before_launching(case, monkeypatch):
    call, name = launcher_cases()[case]
    import triton.runtime.interpreter as interpreter

    launched = []
    for cls in (interpreter.InterpretedFunction, triton.runtime.JITFunction):  # CPU and GPU launches
        monkeypatch.setattr(cls, "run", lambda *a, **k: launched.append(a))
    with pytest.raises(SparseRefError, match=name):
        call()
    assert launched == [], "nothing launched before the refusal"


def test_an_integer_scalar_page_size_is_taken_as_its_int():
    """Decision: numpy and 0-d torch integers are ints everywhere (normalised once, then used)."""
    from sparse_ref.kernels.page_select import select_pages_triton
    from sparse_ref.selection import select_pages

    cfg = SparseConfig(page_budget=1, num_recent_pages=1)
    scores, seq, mask = torch.randn(2, 5), torch.tensor([17, 9]), torch.tensor([True, True])
    for select in (select_pages, select_pages_triton):
        if select is select_pages_triton:
            scores, seq, mask = scores.to(DEVICE), seq.to(DEVICE), mask.to(DEVICE)
        want = select(scores, seq, mask, PAGE, cfg)
        for page in (torch.tensor(PAGE), np.int32(PAGE)):
            assert all(torch.equal(a, b) for a, b in zip(select(scores, seq, mask, page, cfg), want, strict=True))


@pytest.mark.parametrize("pad", [0, 2, -2])
def test_entries_after_a_rows_length_must_be_minus_one_in_the_adaptor_and_the_launcher(pad):
    """A stale id after ``lengths[r]`` (a buffer reused without its -1 padding) is refused by both."""
    from sparse_ref.adaptor import to_attention_metadata

    m, req = launcher_env()
    r2t = m.req_to_token_pool.req_to_token
    fb = build_decode_batch(m, [req])
    sel = torch.tensor([[0, 2, pad]], dtype=torch.int32, device=DEVICE)
    lens, mask = torch.tensor([2], dtype=torch.int32, device=DEVICE), torch.tensor([True], device=DEVICE)
    with pytest.raises(SparseRefError, match="-1 after"):
        to_attention_metadata(sel, lens, mask, fb, r2t, PAGE)
    with pytest.raises(SparseRefError, match="-1 after"):
        page_table_from_selection(sel, lens, mask, fb.seq_lens, fb.req_pool_indices, r2t, PAGE)
    sel[0, 2] = -1
    table, kv_lens, _ = to_attention_metadata(sel, lens, mask, fb, r2t, PAGE)
    assert kv_lens.tolist() == [PAGE + fb.seq_lens.item() - 2 * PAGE]
