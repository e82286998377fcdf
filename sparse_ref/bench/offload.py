"""Suite ``offload``: KV offload to host memory with a per-request hot buffer (``DecodeEngine(offload_buffer=B)``).

Four measurements, each beside its baseline in the same run:

* **hit rate** of the hot buffer per decode step (1 Quest layer, 1 DSA layer; budget 2048, a 4096-slot
  buffer), on the planted workload and on a drifting one (``query_drift``): the engine's own counts, and the
  bytes it moved per step beside ``(1 - hit rate) x tokens read x bytes per token``;
* **swap-in bandwidth** on a miss-heavy step (every token a miss): host-to-device GB/s of the two kernels,
  beside ``copy_`` of the same bytes from pinned memory (the copy engine) and the same kernels with the
  "host" pool in device memory;
* **step time**, offload against all-on-device (1 Quest layer, CUDA-graph replay of one engine step, L2
  cold), at bs 1, 8, 64 and 32K / 128K context, at a 5% miss share (``MISS``): before each replay the hot
  buffers are restored to a state missing that share of the tokens they hold; and the step's parts, each
  timed alone the same way (bounds update, the swap-in with its positions, attention over either table);
* **capacity**: the device bytes each engine allocates per 128K request (``torch.cuda.memory_allocated``,
  engines of 1 and 2 requests) and the requests that fit in a fixed device-memory cap, and in host RAM.
"""

from __future__ import annotations

import statistics
from functools import partial
from types import SimpleNamespace

import torch

from sparse_ref.adaptor import Metadata
from sparse_ref.bench.timing import eager_cold, row
from sparse_ref.config import SparseConfig
from sparse_ref.offload import lru_order

BUDGET, BUFFER, PAGE = 2048, 4096, 16
CAP_GIB, HOST_GIB = 16, 100  # device memory cap for the KV side; host RAM the pinned pools may use


def _engine(layers, bs, ctx, budget, buffer, device, workload=None, **kw):
    from sparse_ref.engine import DecodeEngine
    from sparse_ref.workloads import PlantedEngineWorkload

    recent, sink = 4, 1
    config = SparseConfig(page_budget=max(budget // PAGE - recent - sink, 1), num_recent_pages=recent,
                          num_sink_pages=sink)
    wl = workload or PlantedEngineWorkload(num_layers=len(layers), num_q_heads=kw.pop("h_q", 32),
                                           num_kv_heads=kw.pop("h_kv", 8), head_dim=kw.pop("d", 128), seed=0)
    return DecodeEngine(wl, layers, config, dsa_topk=budget, page_size=PAGE, max_requests=bs, max_context_len=ctx,
                        backend="triton", compare_dense=False,
                        offload_buffer=buffer, device=device, **kw)


def hit_rates(device, timer, copy_bw, quick, on_cpu):
    """Per-step hit rate of the hot buffer on the planted and the drifting workload (Quest, DSA)."""
    from sparse_ref.workloads import PlantedEngineWorkload

    bs, ctx, steps = (2, 300, 6) if on_cpu else (8, 32768, 24 if quick else 64)
    budget, buffer = (96, 192) if on_cpu else (BUDGET, BUFFER)
    rows = []
    for drift in (0.0, 0.05):
        for algo in ("quest", "deepseek_dsa"):
            wl = PlantedEngineWorkload(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=64, query_drift=drift,
                                       seed=1)
            engine = _engine([algo], bs, ctx + steps, budget, buffer, device, workload=wl)
            for i in range(bs):
                engine.add_request(ctx - 13 * i)
            per_step, bytes_moved, read = [], [], []
            for _ in range(steps):
                r = engine.step()
                per_step.append(r.offload_hits / max(r.offload_hits + r.offload_misses, 1))
                bytes_moved.append(r.offload_misses * engine.offload.hot.token_bytes)
                read.append(r.offload_hits + r.offload_misses)
            steady = statistics.mean(per_step[1:])
            formula = [(1 - h) * n * engine.offload.hot.token_bytes for h, n in zip(per_step, read, strict=True)]
            name = "planted" if drift == 0 else f"drift {drift} rad/step"
            print(f"  hit rate {algo:<13} {name:<20} first step {per_step[0]:.3f}, steady {steady:.4f} "
                  f"(min {min(per_step[1:]):.4f}); {statistics.mean(bytes_moved[1:]) / 1e6:.2f} MB/step", flush=True)
            rows.append(dict(op="offload_hit_rate", shape=f"bs={bs} ctx={ctx} budget={budget} buffer={buffer}",
                             k=budget, distribution=name, l2="-", torch_us=float("nan"), ours_us=float("nan"),
                             speedup=None, tbps=None, pct_copy_bw=None, algorithm=algo, steps=steps,
                             hit_rate_steady=round(steady, 4), hit_rate_min=round(min(per_step[1:]), 4),
                             hit_rate_per_step=[round(h, 4) for h in per_step], bytes_per_step=bytes_moved,
                             formula_bytes_per_step=[round(f) for f in formula], tokens_read_per_step=read,
                             note="step 1 starts from an empty buffer (all misses); steady = mean of steps 2..N"))
            del engine
    return rows


def swap_in_bandwidth(device, timer, copy_bw, quick, on_cpu):
    """GB/s of the swap-in on a step where every token misses: pinned host pool vs the copy engine vs HBM."""
    from sparse_ref.kernels.swap_in import swap_in
    from sparse_ref.offload import HotBuffer

    bs, size, h_kv, d = (2, 8, 2, 16) if on_cpu else (8, BUDGET, 8, 128)
    n, slots, rows = size - 1, 2 * size + 1, []
    on = {"device": device}
    hot = HotBuffer(1, bs, size, h_kv, d, slots, torch.bfloat16, device)
    r2t = torch.arange(1, 1 + bs * slots, dtype=torch.int32, **on).view(bs, slots)
    sets = [torch.cat([torch.arange(p, 2 * n, 2, dtype=torch.int32, **on), torch.tensor([2 * n], dtype=torch.int32,
                                                                                         **on)]) for p in (0, 1)]
    counts, seq_lens = torch.full((bs,), n + 1, dtype=torch.int32, **on), torch.full((bs,), 2 * n + 1, **on)
    new = torch.randn(bs, h_kv, d, **on)
    moved = bs * n * hot.token_bytes
    sparse = torch.ones(bs, dtype=torch.bool, **on)

    batch = SimpleNamespace(req_pool_indices=torch.arange(bs, **on), seq_lens=seq_lens,
                            out_cache_loc=r2t[:, 2 * n].long())  # the newest token's slot (position seq_len - 1)

    table = torch.zeros(bs, n + 1, dtype=torch.int32, **on)

    def call(positions, host_k, host_v):  # the positions as a selection of single tokens (page size 1)
        return swap_in(hot, 0, Metadata(table, counts, 1, positions, counts, sparse), batch, (new, new),
                       SimpleNamespace(k=[host_k], v=[host_v]), r2t)

    pin = torch.cuda.is_available()
    for where in ("pinned host", "device"):
        pool = [torch.randn(1 + bs * slots, h_kv, d, **on).to(torch.bfloat16) for _ in range(2)]
        if where == "pinned host":
            pool = [t.cpu().pin_memory() if pin else t.cpu() for t in pool]
        # the two sets alternate: every token of every call misses
        ours = timer.cold([partial(call, s.expand(bs, -1).contiguous(), *pool) for s in sets])
        if where == "pinned host":
            dst = torch.empty(moved // 2, dtype=torch.bfloat16, **on)
            src = torch.empty(moved // 2, dtype=torch.bfloat16, pin_memory=pin)
            base = timer.cold([partial(dst.copy_, src, non_blocking=True)])
        else:
            base = float("nan")
        gbps = moved / (ours * 1e-6) / 1e9
        rows.append(row(f"bs={bs} misses={n}/row {h_kv}x{d} bf16", n, f"from {where}", "cold", base, ours,
                        moved, copy_bw, "offload_swap_in", swap_in_gbps=round(gbps, 2),
                        baseline="copy_ of the same bytes from pinned host memory (the copy engine, contiguous)"
                        if where == "pinned host" else "none", baseline_gbps=None if base != base else
                        round(moved / (base * 1e-6) / 1e9, 2), h2d_bytes=moved))
        print(f"    swap-in from {where}: {gbps:.1f} GB/s ({moved / 1e6:.1f} MB)", flush=True)
    return rows


def _restore_to(engine, miss: float, gen):
    """A function that puts the hot buffers back into their state after the captured step, less a ``miss`` share
    of the tokens each row holds (emptied slots, first in the LRU list: the next replay misses exactly those)."""
    hot = engine.offload.hot
    token, last_used, slot_of = hot.token.clone(), hot.last_used.clone(), hot.slot_of.clone()
    drop = (torch.rand(token.shape, generator=gen, device=token.device) < miss) & (token >= 0)
    layer, row, _ = drop.nonzero(as_tuple=True)
    slot_of[layer, row, token[drop].long()] = -1
    token[drop] = -1
    lru = lru_order(token, last_used)

    def restore():
        hot.token.copy_(token)
        hot.last_used.copy_(last_used)
        hot.slot_of.copy_(slot_of)
        hot.lru.copy_(lru)
    return restore, int(drop.sum())


def _parts_us(engine, step, timer, restore, reps) -> dict:
    """The step's parts, each captured alone (on a GPU) and replayed with the hot buffers restored before each:
    the bounds update and attention on both engines; the swap-in (both launches) with offload."""
    from sparse_ref.bench.timing import capture_graph
    from sparse_ref.kernels.decode_attention import paged_decode_attention

    (trace,), batch, (q, k, v, _, _) = step.traces, step.batch, step.inputs[0]
    md, hot_md, pool = trace.metadata, trace.offload, engine.manager.token_to_kv_pool
    parts = {"bounds update": partial(engine.coordinator.algorithms[0].update_representations, 0, batch,
                                      pool.get_key_buffer(0))}
    if hot_md is None:
        parts["attention (page-16 table)"] = partial(paged_decode_attention, q, pool.k_buffer[0], pool.v_buffer[0],
                                                     md.page_table, md.kv_lens, md.page_size)
    else:
        parts["swap-in (both launches)"] = partial(engine.offload.read, 0, batch, md, k, v,
                                                   engine.manager.req_to_token_pool.req_to_token)
        parts["attention (page-1 hot table)"] = partial(paged_decode_attention, q, *engine.offload.buffers(0),
                                                        hot_md.page_table, hot_md.kv_lens, 1)
    out = {}
    for name, fn in parts.items():
        restore()
        replay = capture_graph(fn).replay if timer.on_gpu else fn
        out[name] = round(eager_cold(timer, replay, reps, restore), 1)
    return out


def _filled_engine(bs, ctx, buffer, device):
    """A 1-layer Quest engine of ``bs`` random prompts of ``ctx - PAGE`` tokens (prefilled on the device, as the
    engine suite does), host layers filled in chunks; bounds built by the Quest kernel."""
    from sparse_ref.batch import build_extend_batch

    engine = _engine(["quest"], bs, ctx, BUDGET if device.type == "cuda" else 96, buffer, device,
                     bounds_dtype=torch.bfloat16, dtype=torch.bfloat16, **({} if device.type == "cuda" else
                                                                          dict(h_q=4, h_kv=2, d=16)))
    pool, gen = engine.manager.token_to_kv_pool, torch.Generator(device=device).manual_seed(0)
    for buf in pool.k_buffer + pool.v_buffer:
        for chunk in buf.split(1 << 18):
            chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device, dtype=chunk.dtype))
    for i in range(bs):
        req = engine.manager.admit(ctx - PAGE)
        engine.plans[req.rid] = engine.workload.request(i, ctx - PAGE)
        engine.coordinator.on_request_begin(req, ctx - PAGE)
        engine.live.append(req)
        engine.written[req.rid] = ctx - PAGE
    engine.coordinator.attention_end(0, build_extend_batch(engine.manager, engine.live))
    return engine


MISS = 0.05  # the step suite's miss share: the target hit rate (95%); the hit-rate suite measures the real one


def step_times(device, timer, copy_bw, quick, on_cpu, miss=MISS):
    """Offload against all-on-device: one Quest layer's whole engine step, replayed from one CUDA graph."""
    from sparse_ref.engine_graph import GraphedDecodeStep

    shapes = [(2, 300)] if on_cpu else [(1, 32768), (8, 32768), (64, 32768), (8, 131072)] if quick else \
        [(bs, ctx) for ctx in (32768, 131072) for bs in (1, 8, 64)]
    reps, rows = (3 if on_cpu else (20 if quick else 50)), []
    for bs, ctx in shapes:
        us, parts = {}, {}
        for mode in ("device", "offload"):
            engine = _filled_engine(bs, ctx, None if mode == "device" else (192 if on_cpu else BUFFER), device)
            pool = engine.manager.token_to_kv_pool
            shape = (f"bs={bs} ctx={ctx} {engine.workload.num_q_heads}x{pool.num_kv_heads}x{pool.head_dim} bf16 "
                     f"P={PAGE}")
            step = GraphedDecodeStep(engine)
            step.step()
            restore, dropped = _restore_to(engine, miss, torch.Generator(device=device).manual_seed(1)) \
                if mode == "offload" else ((lambda: None), 0)
            us[mode] = eager_cold(timer, step.replay, reps, restore)
            parts[mode] = _parts_us(engine, step, timer, restore, reps)
            del step, engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row(shape, BUDGET, f"miss {miss:.3f}", "cold",
                        us["device"], us["offload"], 0, copy_bw, "offload_step",
                        baseline="the same 1-layer Quest engine step, every K/V on the device (one graph)",
                        ratio_offload_over_device=round(us["offload"] / us["device"], 3), misses_per_replay=dropped,
                        parts_us=parts,
                        note="replays of one captured step; before each, the hot buffers lose the miss share of "
                             "the tokens they hold; parts_us: each part captured and replayed alone, same restore"))
        print("    parts (us): " + "; ".join(f"{m}: " + ", ".join(f"{k} {v}" for k, v in p.items())
                                     for m, p in parts.items()), flush=True)
    return rows


def capacity(device, timer, copy_bw, quick, on_cpu):
    """Device bytes per 128K request, all-on-device vs offload (1 Quest layer), and the requests that fit."""
    if on_cpu:
        return []
    ctx, per = 131072, {}
    for mode, buffer in (("device", None), ("offload", BUFFER)):
        used = []
        for n in (1, 2):
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            engine = _engine(["quest"], n, ctx, BUDGET, buffer, device, dtype=torch.bfloat16,
                             bounds_dtype=torch.bfloat16)
            used.append(torch.cuda.memory_allocated() - before)
            host = sum(b.numel() * b.element_size() for b in engine.manager.token_to_kv_pool.k_buffer +
                       engine.manager.token_to_kv_pool.v_buffer if not b.is_cuda)
            del engine
        per[mode] = dict(per_request=used[1] - used[0], fixed=2 * used[0] - used[1], host_per_request=host // 2)
    cap = CAP_GIB << 30
    fit = {m: (cap - p["fixed"]) // p["per_request"] for m, p in per.items()}
    host_fit = (HOST_GIB << 30) // max(per["offload"]["host_per_request"], 1)
    both = min(fit["offload"], host_fit)
    print(f"    device bytes per 128K request: all-on-device {per['device']['per_request'] / 2**20:.1f} MiB, offload "
          f"{per['offload']['per_request'] / 2**20:.1f} MiB; in {CAP_GIB} GiB: {fit['device']} vs {fit['offload']} "
          f"requests (host RAM {HOST_GIB} GiB holds {host_fit}): x{both / max(fit['device'], 1):.1f}", flush=True)
    return [dict(op="offload_capacity", shape=f"ctx={ctx} 1 Quest layer 32x8x128 bf16 budget={BUDGET} "
                 f"buffer={BUFFER}", k=BUDGET, distribution="-", l2="-", torch_us=float("nan"), ours_us=float("nan"),
                 speedup=None, tbps=None, pct_copy_bw=None, device_cap_gib=CAP_GIB, host_gib=HOST_GIB,
                 bytes_per_request=per, fit_device=fit["device"], fit_offload_device=fit["offload"],
                 fit_offload_host=host_fit, ratio=round(both / max(fit["device"], 1), 2),
                 note="torch.cuda.memory_allocated after building engines of 1 and 2 requests: per request = the "
                      "difference; fits = (cap - fixed) // per request; offload is also bounded by pinned host RAM")]


PARTS = {"offload_capacity": capacity, "offload_swap": swap_in_bandwidth, "offload_step": step_times,
         "offload_hits": hit_rates}  # each also a suite of its own: a run writes its JSON after each


def bench_offload(device, timer, copy_bw, quick, on_cpu):
    return [r for part in PARTS.values() for r in part(device, timer, copy_bw, quick, on_cpu)]
