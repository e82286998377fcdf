"""What each rank runs in the tensor-parallel tests (tests/test_tensor_parallel.py), and the launcher.

``run_ranks(scenario, world, ...)`` starts ``world`` processes (spawn), joins them into a gloo group with a
timeout on every collective, runs ``scenario(rank, world, ...)`` in each and returns what each rank
returned or raised, as ``{rank: ("ok", value) | (error type name, message)}``. A process that is still
running after ``timeout`` seconds is killed and reported as ``("hung", "")``: no test can hang.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import socket
import time
import traceback
from functools import partial

import torch
import torch.distributed as dist

from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.errors import PoolError
from sparse_ref.tensor_parallel import RankGroup, RankWorkload, TensorParallelEngine
from sparse_ref.workloads import PlantedEngineWorkload

LAYERS = ["quest", "deepseek_dsa", None]
INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)
ENGINE = {"dsa_topk": 8, "page_size": 4, "max_requests": 3, "max_context_len": 64, "num_pages": 40,
          "backend": "torch"}
# joins (prompt length), leaves (index into the live requests) and decode steps, the same on every rank
SCRIPT = [("add", 21), ("add", 13), ("step",), ("step",), ("step",), ("add", 9), ("step",), ("step",),
          ("finish", 0), ("step",), ("step",), ("add", 17), ("step",), ("step",), ("step",), ("step",)]


def workload(num_kv_heads=4, seed=3, needles=(2, 2)):
    """``needles``: (needles every head sees, needles of one query head only)."""
    return PlantedEngineWorkload(num_layers=len(LAYERS), num_q_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads,
                                 head_dim=8, num_needles=needles[0], num_head_needles=needles[1], local_window=4,
                                 indexer_config=INDEXER, seed=seed)


def config(gqa_mode="mean", page_budget=2):
    return SparseConfig(page_budget=page_budget, num_recent_pages=1, min_sparse_seq_len=8, gqa_mode=gqa_mode)


def record(out: dict, name: str, fn, tp=None) -> None:
    """``out[name]``: "ok", or the type and message of what ``fn()`` raised on this rank (the tests compare every
    rank's); with ``tp``, also the live requests after it (``out[name + " state"]``)."""
    try:
        fn()
        out[name] = "ok"
    except Exception as e:  # noqa: BLE001 (the test compares the types and messages of every rank)
        out[name] = f"{type(e).__name__}: {e}"
    if tp is not None:
        out[name + " state"] = [(r.rid, r.seq_len) for r in tp.live]


def _apply(engine, op):
    if op[0] == "add":
        engine.add_request(op[1])
    elif op[0] == "finish":
        engine.finish(engine.live[op[1]])


def equality(rank, world, quest_mode, dsa_mode, gqa_mode, needles=(2, 2)):
    """TP=world against one process: global Quest and DSA selections equal one process over all heads (per-rank
    Quest: a one-process engine on this rank's heads), outputs equal within fp32 tolerance, at every step."""
    wl, cfg = workload(needles=needles), config(gqa_mode)
    tp = TensorParallelEngine(wl, LAYERS, cfg, quest_mode=quest_mode, dsa_mode=dsa_mode, **ENGINE)
    one = DecodeEngine(wl, LAYERS, cfg, **ENGINE)  # all heads, one process
    mine = DecodeEngine(RankWorkload(wl, rank, world), LAYERS, cfg, **ENGINE)  # this rank's heads, one process
    steps, sparse_rows, differs_from_one, max_err = 0, 0, 0, 0.0
    for op in SCRIPT:
        if op[0] != "step":
            for e in (tp, one, mine):
                _apply(e, op)
            continue
        (result, outs), ref, own = tp.step(), one.step(), mine.step()
        steps += 1
        for layer, (trace, out) in enumerate(zip(result.layers, outs, strict=True)):
            md, want = trace.metadata, (own if quest_mode == "per_rank" and LAYERS[layer] == "quest" else ref)
            if md.selected is not None:
                sparse_rows += int(md.sparse_mask.sum())
                assert torch.equal(md.selected, want.layers[layer].metadata.selected), (steps, layer)
                assert torch.equal(md.kv_lens, want.layers[layer].metadata.kv_lens), (steps, layer)
                differs_from_one += int(not torch.equal(md.selected, ref.layers[layer].metadata.selected))
            torch.testing.assert_close(trace.out, own.layers[layer].out, rtol=0, atol=0)  # this rank = its heads
            if want is ref:
                torch.testing.assert_close(out, ref.layers[layer].out, rtol=1e-5, atol=1e-6)
                max_err = max(max_err, float((out - ref.layers[layer].out).abs().max()))
    return {"steps": steps, "sparse_rows": sparse_rows, "differs_from_one": differs_from_one, "max_err": max_err}


def refusals(rank, world):
    """Each bad set-up, in turn: what this rank raised (every rank must raise the same, none may hang)."""
    out = {}
    wl, cfg = workload(), config()

    attempt = partial(record, out)

    attempt("heads", lambda: TensorParallelEngine(workload(num_kv_heads=3), LAYERS, cfg, **ENGINE))
    attempt("config", lambda: TensorParallelEngine(wl, LAYERS, config(page_budget=2 + rank), **ENGINE))
    attempt("mode", lambda: TensorParallelEngine(wl, LAYERS, cfg, quest_mode="sometimes", **ENGINE))
    tp = TensorParallelEngine(wl, LAYERS, cfg, **ENGINE)
    tp.add_request(20)
    tp.step()
    from sparse_ref.batch import decode_step

    batch = decode_step(tp.engine.manager, tp.live)
    tp.engine.coordinator.forward_begin(batch)
    # out of step: rank 0 retrieves layer 0 (Quest: the scores' all-reduce) while rank 1 retrieves layer 1 (DSA:
    # the selection's hash); their exchanges meet, disagree on the tag, and both raise
    inputs = tp.engine.decode_inputs(rank)
    kw = {} if rank == 0 else {"x": inputs[3], "q_lora": inputs[4]}
    attempt("order", lambda: tp.engine.coordinator.attention_begin(rank, inputs[0], batch, **kw))
    return out


def agreement(rank, world):
    """Calls one rank makes differently: each must raise on every rank before any state changes, and the ranks
    must go on together afterwards. Returns what each attempt raised and the state after it."""
    out = {}
    wl, cfg = workload(), config()

    attempt = partial(record, out)

    attempt("mode on one rank", lambda: TensorParallelEngine(wl, LAYERS, cfg, quest_mode="global" if rank == 0
                                                             else "sometimes", **ENGINE))
    tp = TensorParallelEngine(wl, LAYERS, cfg, **ENGINE)
    attempt("key", lambda: tp.add_request(20, key=rank), tp)
    attempt("needles", lambda: tp.add_request(20, needle_depths=[0.1 * (rank + 1)]), tp)
    attempt("prompt", lambda: tp.add_request(20 + rank), tp)
    attempt("too long on one rank", lambda: tp.add_request(20 if rank == 0 else 10_000), tp)
    tp.add_request(20)
    tp.step()
    attempt("step against finish", (lambda: tp.step()) if rank == 0 else (lambda: tp.finish(tp.live[0])), tp)
    attempt("after", lambda: tp.step(), tp)  # the ranks go on together
    return out


def outcomes(rank, world):
    """Calls that fail on some ranks, with the same arguments on every rank: pages taken out of band on rank 1 (the
    pools compared before each call: refused everywhere, nothing changed); a refusal of rank 1's own checks; an
    error that is not a project error during add_request on every rank (rolled back everywhere: the engine goes
    on), then on rank 1 only, and during rank 1's step's forward with no exchange inside (per-rank Quest and a
    dense layer). Returns what each attempt raised on this rank and the live requests after it."""
    out = {}
    attempt = partial(record, out)

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    def refuse(*args, **kwargs):
        raise PoolError("no room on this rank (simulated)")

    tp = TensorParallelEngine(workload(), LAYERS, config(), **ENGINE)
    tp.add_request(20)  # 5 full pages: its next step needs a page
    allocator = tp.engine.manager.allocator
    taken = allocator.alloc(2) if rank == 1 else []
    attempt("add, pages out of band", lambda: tp.add_request(21), tp)
    attempt("step, pages out of band", tp.step, tp)
    allocator.free(taken[::-1])  # back as they were (the free list is a stack)
    attempt("step after", tp.step, tp)
    workload_of = tp.engine.workload
    if rank == 1:
        workload_of.request = refuse
    attempt("add, refused on rank 1", lambda: tp.add_request(9), tp)
    if rank == 1:
        del workload_of.request
    workload_of.prefill = oom
    attempt("add, out of memory everywhere", lambda: tp.add_request(9), tp)
    del workload_of.prefill
    attempt("after the add failed everywhere", tp.step, tp)
    if rank == 1:
        workload_of.prefill = oom
    attempt("add, out of memory", lambda: tp.add_request(9), tp)
    attempt("after the failed add", tp.step, tp)
    tp = TensorParallelEngine(workload(), ["quest", None, None], config(), quest_mode="per_rank", **ENGINE)
    tp.add_request(20)
    if rank == 1:
        tp.engine.attend = oom
    attempt("step, out of memory", tp.step, tp)
    attempt("after the failed step", tp.step, tp)
    return out


def failure_in_step(rank, world, layers, kind):
    """Rank 1 fails inside a step before the step's first exchange (global Quest's scores, DSA's selection): its
    workload's decode raises out of memory, or an interrupt, while the others wait in that exchange. Returns what
    the step, and the one after, raised on this rank (an interrupt too)."""
    out = {}
    tp = TensorParallelEngine(workload(num_kv_heads=2 * world), layers, config(), **ENGINE)
    tp.add_request(20)
    if rank == 1:
        def fail(*args, **kwargs):
            raise KeyboardInterrupt() if kind == "interrupt" else RuntimeError("CUDA out of memory (simulated)")
        tp.engine.workload.decode = fail
    try:
        tp.step()
        out["step"] = "ok"
    except BaseException as e:  # noqa: BLE001 (an interrupt is what this rank must see again)
        out["step"] = f"{type(e).__name__}: {e}"
    record(out, "after", tp.step)
    return out


def out_of_band(rank, world):
    """Changes rank 1 makes outside the tensor-parallel engine, each caught on every rank at the next exchange: two
    different exchanges at one layer, a page taken before a join (the pools differ), a request admitted through
    rank 1's own engine, a page taken before a leave (only the free pages differ), a request finished, or a step
    run, on rank 1's engine alone. Returns what each attempt raised on this rank."""
    out = {}
    attempt = partial(record, out)

    comm, t = RankGroup(), torch.zeros(4)
    attempt("kind", lambda: comm.all_reduce_sum(t, "scores", 0) if rank == 0 else comm.broadcast(t, "selection", 0))
    tp = TensorParallelEngine(workload(), LAYERS, config(), **ENGINE)
    if rank == 1:
        tp.engine.manager.allocator.alloc(1)
    attempt("join", lambda: tp.add_request(20), tp)
    attempt("after the join", tp.step, tp)
    tp = TensorParallelEngine(workload(), LAYERS, config(), **ENGINE)
    if rank == 1:
        tp.engine.add_request(9)  # admitted through rank 1's own engine, not the tensor-parallel one
    attempt("admitted on one rank", lambda: tp.add_request(20))
    tp = TensorParallelEngine(workload(), LAYERS, config(), **ENGINE)
    tp.add_request(20)
    if rank == 1:
        tp.engine.manager.allocator.alloc(1)
    attempt("leave", lambda: tp.finish(tp.live[0]))
    per_rank = (workload(), ["quest", None, None], config())
    for name, change in (("live", lambda e: e.finish(e.live[1])), ("lengths", lambda e: e.step())):
        tp = TensorParallelEngine(*per_rank, quest_mode="per_rank", **ENGINE)
        tp.add_request(20)
        tp.add_request(13)
        if rank == 1:
            change(tp.engine)
        attempt(f"step, other {name}", tp.step)
    return out


def layer_tag(rank, world):
    """Both ranks at a Quest scores all-reduce, but of different layers: the tag (with the layer) tells them apart."""
    layers = ["quest", "quest", None]
    tp = TensorParallelEngine(workload(), layers, config(), **ENGINE)
    tp.add_request(20)
    from sparse_ref.batch import decode_step

    batch = decode_step(tp.engine.manager, tp.live)
    tp.engine.coordinator.forward_begin(batch)
    q = tp.engine.decode_inputs(rank)[0]
    try:
        tp.engine.coordinator.attention_begin(rank, q, batch)
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def summed_scores(rank, world):
    """Global Quest's page scores on every rank equal one process's scores over all heads: the all-reduce is a sum
    (a mean or a maximum would select the same pages in some cases, and score differently)."""
    tp = TensorParallelEngine(workload(), LAYERS, config("per_kv_head"), **ENGINE)
    one = DecodeEngine(workload(), LAYERS, config("per_kv_head"), **ENGINE)
    for e in (tp, one):
        e.add_request(23)
    from sparse_ref.batch import decode_step

    got = []
    for e, inputs_of in ((tp.engine, tp.engine), (one, one)):
        batch = decode_step(e.manager, e.live)
        q = inputs_of.decode_inputs(0)[0]
        algo = e.coordinator.algorithms[0]
        got.append(algo.score_pages(q, 0, batch.req_pool_indices, batch))
    scored = torch.isfinite(got[1])  # pages with bounds (complete pages); the rest are -inf on both
    assert torch.equal(scored, torch.isfinite(got[0])) and int(scored.sum()) >= 4
    return float((got[0][scored] - got[1][scored]).abs().max()), float(got[1][scored].abs().max())


def disagreement(rank, world, dsa_mode):
    """DSA with ties broken differently per rank (rank 0: lower id, rank 1: higher id) on coarse scores."""
    from sparse_ref.selection import topk_reference

    wl = workload()
    tp = TensorParallelEngine(wl, LAYERS, config(), dsa_mode=dsa_mode, **ENGINE)
    indexer = tp.engine.coordinator.indexers[1]

    def select(scores, positions, order="index"):
        coarse = (scores * 0.5).round()  # many ties
        if rank == 1:  # ties to the HIGHER id: a valid top-k too, as an atomics-ordered kernel could give
            coarse = coarse + torch.arange(scores.shape[1]) * (0.5 / scores.shape[1])
        k = indexer.config.index_topk
        return topk_reference(coarse, k, positions.long() + 1, order=order, width=k)

    indexer.select = select
    tp.add_request(30)
    kept = []
    for _ in range(3):
        result, _ = tp.step()
        kept.append(result.layers[1].metadata.selected.clone())
    return torch.stack(kept).tolist()


def _rank_main(scenario, rank, world, port, results, args):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        try:
            results.put((rank, "ok", scenario(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 (reported to the parent, which fails the test)
        results.put((rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario, *args, world=2, timeout=120.0):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(scenario, rank, world, port, results, args), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    while len(out) < world and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = (status, value)
        except queue.Empty:
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    for rank in range(world):
        out.setdefault(rank, ("hung", ""))
    return out
