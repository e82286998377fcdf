"""Suites ``quest`` and ``retrieve``: Quest page scores, and the batched ``retrieve_topk`` against its loop.

* **quest**: the Triton scoring the engine runs (``sparse_ref.kernels.quest.quest_page_scores_from_queries``:
  sign split, page mapping and scores in one launch) against the torch path (``split_query_sign``,
  ``physical_pages``, ``quest_page_scores_reference``: gather + bmm), at bs=1, 32 query / 32 KV heads, D=128,
  page 16, 128K context and at bs=64, 32 query / 8 KV heads, 32K; bytes = the bounds of every scored page
  read once + the scores written. fp32 bounds (``QuestAlgorithm``'s default) and bf16 bounds.
  Then the Quest bounds update after a decode step (``bench_bounds_update``): the Triton kernel
  against the torch update, bs=64, 8 KV heads, D=128, page 16, every request completing a page.
* **retrieve**: the batched ``retrieve_topk`` of Quest (Triton scoring and selection on CUDA)
  against the per-request ``retrieve_topk_loop``, bs=64, 32K context, page 16.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from sparse_ref.bench.timing import row, wall_clock_us


def torch_quest_scores(q, page_min, page_max, page_valid, pages):
    """The torch path of the Quest scores: the sign split of the GQA mean, then gather + bmm over the pages."""
    from sparse_ref.algorithms.quest import quest_page_scores_reference, split_query_sign

    q_pos, q_neg = split_query_sign(q, page_min.shape[1], page_min.shape[2], "mean")
    return quest_page_scores_reference(q_pos, q_neg, page_min, page_max, page_valid, pages)


def bench_quest(device, timer, copy_bw, quick, on_cpu):
    from sparse_ref.kernels.quest import quest_page_scores_from_queries

    if on_cpu:
        shapes = [(1, 2, 2, 8, 64, 16, torch.float32), (2, 4, 2, 8, 32, 16, torch.bfloat16)]
    else:
        shapes = [(1, 32, 32, 128, 131072, 16, torch.float32), (64, 32, 8, 128, 32768, 16, torch.float32),
                  (1, 32, 32, 128, 131072, 16, torch.bfloat16)]
    rows = []
    for bs, h_q, h_kv, d, ctx, page_size, bound_dtype in shapes:
        max_pages = -(-ctx // page_size)
        num_pages = bs * max_pages + 1  # page 0 is padding; every request's pages are distinct, shuffled
        g = torch.Generator(device="cpu").manual_seed(0)
        pages = (torch.randperm(num_pages - 1, generator=g)[:bs * max_pages] + 1).reshape(bs, max_pages).to(device)
        r2t = (pages.repeat_interleave(page_size, dim=1) * page_size
               + torch.arange(page_size, device=device).repeat(max_pages)).to(torch.int32)  # req_to_token rows
        rows_ = torch.arange(bs, device=device)
        a = torch.randn(num_pages, h_kv, d, device=device)
        b = torch.randn(num_pages, h_kv, d, device=device)
        page_min, page_max = torch.minimum(a, b).to(bound_dtype), torch.maximum(a, b).to(bound_dtype)
        del a, b
        page_valid = torch.ones(num_pages, dtype=torch.bool, device=device)
        page_valid[0] = False
        q = torch.randn(bs, h_q, d, device=device)
        args = (q, page_min, page_max, page_valid, r2t, rows_, page_size, max_pages)
        torch_path = partial(torch_quest_scores, q, page_min, page_max, page_valid, pages)
        want, got = torch_path(), quest_page_scores_from_queries(*args)
        max_rel_err = float(((got - want).abs() / want.abs().clamp(min=1e-3)).max())
        out = torch.empty(bs, max_pages, device=device)
        nbytes = 2 * bs * max_pages * h_kv * d * page_min.element_size() + bs * max_pages * 4
        t_torch = timer.cold([torch_path])
        m_torch = timer.mode
        t_ours = timer.cold([partial(quest_page_scores_from_queries, *args, out=out)])
        floor_us = nbytes / (copy_bw * 1e12) * 1e6 if math.isfinite(copy_bw) else None
        rows.append(row(f"bs={bs} Hq={h_q} Hkv={h_kv} D={d} ctx={ctx} P={page_size} {str(bound_dtype)[6:]}", None,
                        "randn", "cold", t_torch, t_ours, nbytes, copy_bw, "quest_scores",
                        baseline="split_query_sign + quest_page_scores_reference (torch gather + bmm)",
                        torch_timing=m_torch, ours_timing=timer.mode, max_rel_err=max_rel_err,
                        floor_us_at_copy_bw=None if floor_us is None else round(floor_us, 2),
                        bytes_note="bounds (min+max) of every scored page read once + fp32 scores written"))
        del args, torch_path, page_min, page_max, want, got
    return rows + bench_bounds_update(device, timer, copy_bw, on_cpu)


def bench_bounds_update(device, timer, copy_bw, on_cpu):
    """The Quest bounds update after a decode step: the Triton kernel against the torch update (the same hook,
    ``QuestAlgorithm.update_representations``, on each backend). Every request completes a page (ctx is a multiple
    of the page size): the update's worst case, every program reads its page."""
    from sparse_ref.backend import choose_backend
    from sparse_ref.workloads import make_quest_decode_setup

    bs, ctx, page_size = (3, 64, 16) if on_cpu else (64, 32768, 16)
    setup = make_quest_decode_setup(bs, ctx, page_size, device=device)
    algo, fb = setup.algorithm, setup.forward_batch
    kb = setup.workload.manager.token_to_kv_pool.get_key_buffer(setup.layer_id)
    update = partial(algo.update_representations, setup.layer_id, fb, kb)
    pools = (algo.page_min[0], algo.page_max[0], algo.page_valid[0])

    sides = {name: choose_backend(name, device) for name in ("torch", "triton")}

    def with_backend(backend):
        saved, algo.backend = algo.backend, sides[backend]
        try:
            update()
        finally:
            algo.backend = saved

    results = []
    for backend in ("torch", "triton"):
        for t in pools:
            t.zero_()
        with_backend(backend)
        results.append([t.clone() for t in pools])
    identical = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    del results
    t_torch = timer.cold([partial(with_backend, "torch")])
    m_torch = timer.mode
    t_ours = timer.cold([partial(with_backend, "triton")])
    h_kv, d = kb.shape[1], kb.shape[2]
    nbytes = bs * (page_size * h_kv * d * kb.element_size() + 2 * h_kv * d * pools[0].element_size())
    return [row(f"bs={bs} Hkv={h_kv} D={d} P={page_size} ctx={ctx} {str(kb.dtype)[6:]} keys, "
                f"{str(pools[0].dtype)[6:]} bounds", None, "every request completes a page", "cold", t_torch, t_ours,
                nbytes, copy_bw, "quest_bounds_update", baseline="QuestAlgorithm.update_representations, torch",
                torch_timing=m_torch, ours_timing=timer.mode, bit_identical=identical,
                bytes_note="the completed pages' keys read once + their min/max written")]


def bench_retrieve(device, timer, copy_bw, quick, on_cpu):
    from sparse_ref.workloads import make_quest_decode_setup

    bs, ctx, page_size = (2, 256, 16) if on_cpu else (64, 32768, 16)
    setup = make_quest_decode_setup(bs, ctx, page_size, device=device)
    backends = dict(scoring=setup.algorithm.backend.name, selection=setup.algorithm.backend.name)
    batched = setup.retrieve()
    looped = setup.retrieve(loop=True)
    same = bool(torch.equal(batched[0], looped[0]) and torch.equal(batched[1], looped[1]))
    t_batched = timer.cold([setup.retrieve])
    m_batched = timer.mode
    t_loop = wall_clock_us(partial(setup.retrieve, loop=True), 3 if quick or on_cpu else 5, device)
    graph_ok = None
    if device.type == "cuda":
        try:
            t_graph = timer.warm(setup.retrieve, calls=5)
            graph_ok = True
        except Exception as e:  # report, don't hide: the row says why
            t_graph, graph_ok = float("nan"), f"capture failed: {type(e).__name__}: {e}"[:300]
    else:
        t_graph = float("nan")
    pages = -(-ctx // page_size)
    rows = [row(f"bs={bs} ctx={ctx} page={page_size}", None, "planted", "cold", t_loop, t_batched,
                bs * pages * 4, copy_bw, "retrieve", baseline="retrieve_topk_loop (wall clock, synced)",
                identical_to_loop=same, graph_replay_us=None if math.isnan(t_graph) else round(t_graph, 2),
                graph_capturable=graph_ok, torch_timing="wall clock", ours_timing=m_batched,
                ours_backends=f"scoring={backends['scoring']}, selection={backends['selection']}",
                loop_backends="the loop scores through the same score_pages (same scoring backend)")]
    return rows
