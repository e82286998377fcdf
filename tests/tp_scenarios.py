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

import torch
import torch.distributed as dist

from sparse_ref.config import IndexerConfig, SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.tensor_parallel import RankWorkload, TensorParallelEngine
from sparse_ref.workloads import PlantedEngineWorkload

LAYERS = ["quest", "deepseek_dsa", None]
INDEXER = IndexerConfig(hidden_size=24, q_lora_rank=32, n_heads=2, head_dim=16, rope_dim=4, index_topk=8)
ENGINE = {"dsa_topk": 8, "page_size": 4, "max_requests": 3, "max_context_len": 64, "num_pages": 40,
          "attention_backend": "torch"}
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

    def attempt(name, fn):
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 (the test compares the types and messages of every rank)
            out[name] = f"{type(e).__name__}: {e}"

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
