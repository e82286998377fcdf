"""One sparse and one dense decode step on static buffers, for the ``decode`` suite (and CUDA-graph capture)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sparse_ref.config import SparseConfig


def decode_step_setup(bs, h_q, h_kv, d, ctx, page_size, budget_tokens, bounds_dtype, device,
                      kv_dtype=torch.bfloat16, seed=0):
    """Quest on a planted workload, with the static buffers of one sparse and one dense decode step.

    Returns a namespace with ``sparse_step()`` (Quest scores + page selection + adaptor + sparse
    attention, all into static buffers: capturable as ONE CUDA graph) and ``dense_step()`` (the
    same attention kernel over the full, precomputed page table), and the byte counts.
    """
    from sparse_ref.adaptor import page_table_width, to_attention_metadata
    from sparse_ref.algorithms.quest import QuestAlgorithm
    from sparse_ref.kernels.decode_attention import paged_decode_attention
    from sparse_ref.selection import selection_width
    from sparse_ref.workloads import make_planted_workload

    pages = -(-ctx // page_size)
    recent, sink = 4, 1
    config = SparseConfig(page_budget=budget_tokens // page_size - recent - sink, num_recent_pages=recent,
                          num_sink_pages=sink)
    wl = make_planted_workload([ctx] * bs, page_size=page_size, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=d,
                               interleave_pages=max(1, pages // 32), dtype=kv_dtype, device=device, seed=seed)
    algo = QuestAlgorithm(config, device, bounds_dtype=bounds_dtype)
    wl.attach(algo)
    fb, r2t = wl.forward_batch, wl.req_to_token
    q, k, v = wl.queries, wl.k_buffer, wl.v_buffer
    rows = fb.req_pool_indices
    mask = torch.ones(bs, dtype=torch.bool, device=device)
    width = page_table_width(selection_width(algo.max_pages, config), r2t.shape[1], page_size)
    meta = (torch.zeros(bs, width, dtype=torch.int32, device=device), torch.zeros(bs, dtype=torch.int32, device=device),
            torch.zeros(bs + 1, dtype=torch.int32, device=device))
    out_sparse = torch.empty(q.shape, dtype=torch.float32, device=device)
    out_dense = torch.empty(q.shape, dtype=torch.float32, device=device)
    dense_table, dense_lens, _ = to_attention_metadata(torch.full((bs, 1), -1, dtype=torch.int32, device=device),
                                                       torch.zeros(bs, dtype=torch.int32, device=device),
                                                       torch.zeros(bs, dtype=torch.bool, device=device), fb, r2t,
                                                       page_size)
    ns = SimpleNamespace(algo=algo, workload=wl, q=q, k=k, v=v, meta=meta, out_sparse=out_sparse, out_dense=out_dense,
                         dense_table=dense_table, dense_lens=dense_lens, page_size=page_size)

    def retrieve():
        return algo.retrieve_topk(q, 0, rows, mask, forward_batch=fb)

    def scores():  # the first half of retrieve: query sign split + physical pages + the Quest scoring kernel
        return algo.score_pages(q, 0, rows, fb)

    def adaptor(sel, lens, backend=algo.backend):  # the algorithm's: the one-launch Triton page table on CUDA
        return to_attention_metadata(sel, lens, mask, fb, r2t, page_size, out=meta, backend=backend)

    def sparse_attention():
        return paged_decode_attention(q, k, v, meta[0], meta[1], page_size, out=out_sparse)

    def retrieve_table():  # retrieve + adaptor; on CUDA the selection kernel writes the page table (one launch)
        return algo.retrieve_attention_metadata(q, 0, rows, mask, fb, r2t, out=meta)

    def sparse_step():
        retrieve_table()
        return sparse_attention()

    def dense_step():
        return paged_decode_attention(q, k, v, dense_table, dense_lens, page_size, out=out_dense)

    ns.retrieve, ns.adaptor, ns.sparse_attention = retrieve, adaptor, sparse_attention
    ns.retrieve_table = retrieve_table
    ns.scores = scores
    ns.sparse_step, ns.dense_step = sparse_step, dense_step
    kv_bytes = 2 * k.element_size() * h_kv * d  # K + V of one token
    ns.dense_bytes = bs * ctx * kv_bytes
    bounds_bytes = 2 * torch.tensor([], dtype=bounds_dtype).element_size() * h_kv * d  # min + max of one page
    ns.sparse_bytes = bs * pages * bounds_bytes + bs * min(budget_tokens, ctx) * kv_bytes
    return ns
