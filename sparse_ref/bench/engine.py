"""Suite ``engine``: the engine's whole decode step (4 Quest layers) replayed from ONE CUDA graph.

``GraphedDecodeStep`` per layer against the sum of one layer's parts timed alone, and the dense whole
step (same kernel, same graph capture); bs=64, 32 q / 8 KV heads, D=128, page 16, bf16 K/V, bf16
Quest bounds, 32K context, budget 2048.
"""

from __future__ import annotations

from functools import partial

import torch

from sparse_ref.bench.timing import eager_cold, row
from sparse_ref.config import SparseConfig


# --------------------------------------------------------------------------- engine (whole decode step, one graph)
def _engine_with_prompts(layers, bs, ctx, h_q, h_kv, d, page_size, budget, device):
    """A ``DecodeEngine`` (bf16 K/V, 16-bit Quest bounds) of ``max_context_len=ctx`` holding ``bs`` prompts of
    ``ctx - page_size`` random-key tokens (room for a page of decode tokens; ``ctx / page_size`` pages per row,
    as in the decode suite's rows).

    Prefilled on the device (random K/V, then ``attention_end`` builds the Quest bounds): the
    workload's CPU prefill of ``bs * ctx`` tokens per layer would take minutes. Decode tokens still
    come from the workload.
    """
    from sparse_ref.batch import build_extend_batch
    from sparse_ref.engine import DecodeEngine
    from sparse_ref.workloads import PlantedEngineWorkload

    recent, sink = 4, 1
    config = SparseConfig(page_budget=max(budget // page_size - recent - sink, 1), num_recent_pages=recent,
                          num_sink_pages=sink)
    wl = PlantedEngineWorkload(num_layers=len(layers), num_q_heads=h_q, num_kv_heads=h_kv, head_dim=d, seed=0)
    engine = DecodeEngine(wl, layers, config, page_size=page_size, max_requests=bs, max_context_len=ctx,
                          backend="triton", compare_dense=False,
                          dtype=torch.bfloat16, bounds_dtype=torch.bfloat16, device=device)
    pool, gen = engine.manager.token_to_kv_pool, torch.Generator(device=device).manual_seed(0)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.normal_(generator=gen)
    for i in range(bs):
        req = engine.manager.admit(ctx - page_size)
        engine.plans[req.rid] = wl.request(i, ctx - page_size)
        engine.coordinator.on_request_begin(req, ctx - page_size)
        engine.live.append(req)
        engine.written[req.rid] = ctx - page_size  # the random K/V above
    batch = build_extend_batch(engine.manager, engine.live)
    for layer in range(len(layers)):
        engine.coordinator.attention_end(layer, batch)  # Quest: the bounds of every full page
    return engine



def bench_engine(device, timer, copy_bw, quick, on_cpu):
    """The engine's whole decode step (4 Quest layers) replayed from ONE CUDA graph (``GraphedDecodeStep``),
    per layer against the sum of one layer's parts timed alone, and the dense whole step (same kernel, same graph
    capture); bs=64, 32 q / 8 KV heads, D=128, page 16, bf16 K/V, bf16 Quest bounds, 32K context, budget 2048."""
    from sparse_ref.engine_graph import GraphedDecodeStep
    from sparse_ref.kernels.decode_attention import paged_decode_attention

    layers_n = 4
    bs, h_q, h_kv, d, ctx, P, budget = (2, 4, 2, 16, 60, 4, 16) if on_cpu else (64, 32, 8, 128, 32768, 16, 2048)
    reps = timer.reps
    rows, steps = [], {}
    for name, layers in (("dense", [None] * layers_n), ("quest", ["quest"] * layers_n)):
        engine = _engine_with_prompts(layers, bs, ctx, h_q, h_kv, d, P, budget, device)
        step = GraphedDecodeStep(engine)
        step.step()  # capture (and run) the first decode step; replays repeat it on the same static inputs
        steps[name] = {"graph": eager_cold(timer, step.replay, reps),
                       "eager": eager_cold(timer, step.run_device_half, max(3, reps // 10)),
                       "mode": "graph replay" if step.graph is not None else "eager (no CUDA graph on CPU)"}
        if name == "dense":
            del engine, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    # one Quest layer's parts, each timed alone (captured on its own) on the step's static inputs
    fb, coord, pool = step.batch, engine.coordinator, engine.manager.token_to_kv_pool
    q, k_new, v_new, _, _ = step.inputs[0]
    algo, r2t = coord.algorithms[0], engine.manager.req_to_token_pool.req_to_token
    mask = fb.seq_lens >= coord.configs[0].min_sparse_seq_len
    retrieve = partial(algo.retrieve_attention_metadata, q, 0, fb.req_pool_indices, mask, fb, r2t)  # the engine's
    table, kv_lens = retrieve()[2:4]  # call: scores, then selection + page table (one launch on CUDA)
    kb, vb = pool.get_key_buffer(0), pool.get_value_buffer(0)
    parts = {"K/V append": partial(pool.set_kv, 0, fb.out_cache_loc, k_new, v_new),
             "retrieval + page table": retrieve,
             "attention": partial(paged_decode_attention, q, kb, vb, table, kv_lens, P),
             "representation update": partial(algo.update_representations, 0, fb, kb),
             "dense metadata (once per step)": partial(coord.forward_begin, fb)}
    parts_us = {name: round(timer.cold([fn]), 2) for name, fn in parts.items()}
    per_layer_sum = sum(v for name, v in parts_us.items() if "once per step" not in name)
    sparse, dense = steps["quest"]["graph"], steps["dense"]["graph"]
    per_layer = (sparse - parts_us["dense metadata (once per step)"]) / layers_n
    kv_bytes = 2 * 2 * h_kv * d  # bf16 K + V of one token
    bounds_bytes = 2 * 2 * h_kv * d  # bf16 min + max of one page
    sparse_bytes = layers_n * bs * (-(-ctx // P) * bounds_bytes + min(budget, ctx) * kv_bytes)
    shape = f"bs={bs} Hq={h_q} Hkv={h_kv} D={d} ctx={ctx} P={P} budget={budget} {layers_n} layers"  # ctx: the max
    rows.append(row(shape, None, "random", "cold", dense, sparse, sparse_bytes, copy_bw, "engine_step",
                    baseline="dense whole step: the same engine step, every layer dense (same kernel, one graph)",
                    torch_timing=steps["dense"]["mode"], ours_timing=steps["quest"]["mode"],
                    sparse_eager_us=round(steps["quest"]["eager"], 1),
                    dense_eager_us=round(steps["dense"]["eager"], 1),
                    per_layer_us=round(per_layer, 2), sum_of_parts_per_layer_us=round(per_layer_sum, 2),
                    parts_us=parts_us, dense_bytes=layers_n * bs * ctx * kv_bytes, seq_len=int(fb.seq_lens[0]),
                    parts_note="one Quest layer's parts, each captured and replayed alone, L2 cold; per_layer_us = "
                                "(whole step - dense metadata) / layers",
                    bytes_note="sparse: bf16 min+max bounds of every page + K/V of the kept tokens, all layers"))
    print(f"    per layer {per_layer:.1f} us against the sum of its parts {per_layer_sum:.1f} us; eager step "
          f"{steps['quest']['eager']:.0f} us (dense {steps['dense']['eager']:.0f} us); parts "
          + ", ".join(f"{k_} {v_:.1f}" for k_, v_ in parts_us.items()), flush=True)
    return rows

