"""``torchrun --standalone --nproc-per-node 2 -m sparse_ref.demo --tp 2``: the demo with its heads split over ranks.

Every rank runs ``sparse_ref.tensor_parallel.TensorParallelEngine`` (its heads) beside a one-process
``DecodeEngine`` (all heads), on the demo's planted workload, for four set-ups: Quest with the global
selection (one all-reduce of page scores per layer) and with the per-rank selection (none), DSA with its
selection hash-checked across ranks and with rank 0's broadcast. Rank 0 prints, per set-up, how often a
selection equals one process's, how often the ranks agree, the largest output difference from one
process, and what the exchanges moved. gloo on CPU, NCCL with one GPU per rank (``LOCAL_RANK``).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from sparse_ref.cli import is_rank_zero, json_safe
from sparse_ref.config import SparseConfig
from sparse_ref.engine import DecodeEngine
from sparse_ref.tensor_parallel import TensorParallelEngine

# (label, algorithm, quest_mode, dsa_mode)
SETUPS = (("quest, global", "quest", "global", "check"), ("quest, per_rank", "quest", "per_rank", "check"),
          ("dsa, check", "deepseek_dsa", "global", "check"), ("dsa, broadcast", "deepseek_dsa", "global", "broadcast"))


def run_setup(workload, label, algorithm, quest_mode, dsa_mode, *, context, batch, steps, budget, device) -> dict:
    """One set-up on every rank; returns this rank's counts (rank 0's are printed)."""
    cfg = SparseConfig(page_budget=max(budget // 16 - 2, 1), num_recent_pages=2, gqa_mode="per_kv_head")
    kw = dict(dsa_topk=min(budget, context + steps + 1), page_size=16, max_requests=batch,
              max_context_len=context + steps + 1,
              device=device)
    tp = TensorParallelEngine(workload, [algorithm] * workload.num_layers, cfg, quest_mode=quest_mode,
                              dsa_mode=dsa_mode, **kw)
    one = DecodeEngine(workload, [algorithm] * workload.num_layers, cfg, **kw)
    for i in range(batch):
        tp.add_request(context - 7 * i, key=i)
        one.add_request(context - 7 * i, key=i)
    rows = same = agree = 0
    err, seconds, mass, mass_one = 0.0, 0.0, 0.0, 0.0
    for _ in range(steps):
        start = time.perf_counter()
        (result, outs), ref = tp.step(), None
        seconds += time.perf_counter() - start
        ref = one.step()
        for trace, out, want in zip(result.layers, outs, ref.layers, strict=True):
            sel, mask = trace.metadata.selected, trace.metadata.sparse_mask
            everyone = [torch.empty_like(sel) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, sel.contiguous())  # (the demo's own look at every rank's selection)
            rows += int(mask.sum())
            same += int(((sel == want.metadata.selected).all(1) & mask).sum())
            agree += int((torch.stack(everyone).eq(sel).all(2).all(0) & mask).sum())
            err = max(err, float((out - want.out).abs().max()))
            mass += float(trace.mass_kept.mean()) / (steps * len(ref.layers))  # over this rank's heads
            mass_one += float(want.mass_kept.mean()) / (steps * len(ref.layers))  # over all heads
    exchanges = {what: {"calls": c, "bytes_per_call": b // max(c, 1), "ms_per_call": 1e3 * s / max(c, 1)}
                 for what, (c, b, s) in tp.comm.stats.items() if what in ("scores", "selection")}
    return {"setup": label, "sparse_rows": rows, "equal_to_one_process": same / max(rows, 1),
            "ranks_agree": agree / max(rows, 1), "max_abs_diff": err, "mass_kept": mass,
            "mass_kept_one_process": mass_one, "step_ms": 1e3 * seconds / steps,
            "exchanges": exchanges}


def format_rows(rows: list[dict]) -> str:
    head = (f"{'set-up':<16} {'= 1 process':>11} {'ranks agree':>11} {'max |diff|':>10} {'mass kept':>9} "
            f"{'(1 proc.)':>9} {'step ms':>8}  exchange per layer")
    lines = [head, "-" * len(head)]
    for r in rows:
        ex = "; ".join(f"{what}: {e['bytes_per_call']} B, {e['ms_per_call']:.3f} ms"
                       for what, e in r["exchanges"].items())
        lines.append(f"{r['setup']:<16} {r['equal_to_one_process']:>10.1%} {r['ranks_agree']:>11.1%} "
                     f"{r['max_abs_diff']:>10.1e} {r['mass_kept']:>9.3f} {r['mass_kept_one_process']:>9.3f} "
                     f"{r['step_ms']:>8.1f}  {ex or 'none'}")
    return "\n".join(lines)


def main_tp(args, workload, *, context: int, steps: int, budget: int) -> int:
    """The ``--tp`` run: every rank joins the process group torchrun set up, runs every set-up; rank 0 reports."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        if is_rank_zero():  # every rank sees the same mismatch: one line
            print(f"python -m sparse_ref.demo: error: argument --tp: expected {args.tp} processes, got "
                  f"WORLD_SIZE={world}. Fix: torchrun --standalone --nproc-per-node {args.tp} -m sparse_ref.demo "
                  f"--tp {args.tp}",
                  file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    try:
        if rank == 0:
            print(f"tensor parallel: {world} ranks ({dist.get_backend()}, {device.type}); "
                  f"{workload.num_q_heads} query / {workload.num_kv_heads} KV heads, {workload.num_q_heads // world} "
                  f"/ {workload.num_kv_heads // world} per rank; {args.batch} requests of ~{context} tokens, "
                  f"budget {budget}, {steps} steps; mass kept: rank 0's heads", flush=True)
        rows = [run_setup(workload, *setup, context=context, batch=args.batch, steps=steps, budget=budget,
                          device=device) for setup in SETUPS]
        if rank == 0:
            print(format_rows(rows))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(json_safe({"world_size": world, "backend": dist.get_backend(),
                                                           "device": device.type, "rows": rows}), indent=1,
                                                allow_nan=False))
                print(f"results written to {args.json}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # the --tp part of the demo, started from the demo's command line
    sys.exit("python -m sparse_ref.demo_tp: error: this module is the demo's --tp run. Fix: torchrun --standalone "
             "--nproc-per-node 2 -m sparse_ref.demo --tp 2 (2: the ranks)")
