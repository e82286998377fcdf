"""CUDA graph capture of the batched Quest retrieval (+ the adaptor into preallocated buffers). GPU only.

The graph is captured once on static input tensors; new queries, lengths and masks are copied
into them and the graph is replayed; the outputs must equal an eager call on the same inputs.
"""

import dataclasses

import pytest
import torch

from sparse_ref import SparseConfig
from sparse_ref.adaptor import page_table_width, to_attention_metadata
from sparse_ref.selection import selection_width
from sparse_ref.workloads import make_quest_decode_setup

pytestmark = pytest.mark.gpu


def eager(algo, q, rows, mask, fb, r2t, page_size):
    sel, lens = algo.retrieve_topk(q, 0, rows, mask, forward_batch=fb)
    return (sel, lens, *to_attention_metadata(sel, lens, mask, fb, r2t, page_size))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_quest_retrieve_topk_replays_like_eager(backend):
    if backend == "triton":
        pytest.importorskip("sparse_ref.kernels.page_select")
    bs, ctx, P = 8, 2000, 16
    cfg = SparseConfig(page_budget=12, num_recent_pages=2, num_sink_pages=1)
    setup = make_quest_decode_setup(bs, ctx, P, num_q_heads=8, num_kv_heads=2, head_dim=64, config=cfg,
                                    device="cuda", backend=backend)
    algo, r2t = setup.algorithm, setup.workload.req_to_token
    static_q = setup.queries.clone()
    static_rows = setup.req_pool_indices.clone()
    static_mask = setup.sparse_mask.clone()
    static_fb = dataclasses.replace(setup.forward_batch, seq_lens=setup.forward_batch.seq_lens.clone(),
                                    positions=setup.forward_batch.positions.clone(), req_pool_indices=static_rows)
    width = page_table_width(selection_width(algo.max_pages, cfg), r2t.shape[1], P)
    bufs = (torch.zeros(bs, width, dtype=torch.int32, device="cuda"),
            torch.zeros(bs, dtype=torch.int32, device="cuda"), torch.zeros(bs + 1, dtype=torch.int32, device="cuda"))

    def step():
        sel, lens = algo.retrieve_topk(static_q, 0, static_rows, static_mask, forward_batch=static_fb)
        meta = to_attention_metadata(sel, lens, static_mask, static_fb, r2t, P, out=bufs)
        return (sel, lens, *meta)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()

    gen = torch.Generator(device="cuda").manual_seed(0)
    for trial in range(4):
        q = torch.randn(static_q.shape, generator=gen, device="cuda")
        seq = torch.randint(1, ctx + 1, (bs,), generator=gen, device="cuda")
        seq[0], seq[1] = 1, ctx  # a one-token row (dense) and a full row
        mask = torch.rand(bs, generator=gen, device="cuda") < 0.8
        static_q.copy_(q)
        static_fb.seq_lens.copy_(seq)
        static_fb.positions.copy_(seq - 1)  # DECODE: the token being decoded is each request's last
        static_mask.copy_(mask)
        g.replay()
        torch.cuda.synchronize()
        slots = r2t[setup.req_pool_indices, seq - 1].long()  # where each request keeps its new token
        fb = dataclasses.replace(setup.forward_batch, seq_lens=seq.clone(), positions=seq - 1, out_cache_loc=slots)
        ref = eager(algo, q, setup.req_pool_indices, mask, fb, r2t, P)
        assert int(ref[1].max()) > 0, "some row must go sparse"
        for name, got, want in zip(("selected", "lengths", "page_table", "kv_lens", "cu_kv_lens"), outs, ref,
                                   strict=True):
            assert torch.equal(got, want), (trial, name)
        assert outs[2].data_ptr() == bufs[0].data_ptr()


def test_quest_loop_equals_batched_on_gpu():
    setup = make_quest_decode_setup(6, 1500, 16, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                    config=SparseConfig(keep_ratio=0.1), device="cuda", backend="torch")
    a, b = setup.retrieve(), setup.retrieve(loop=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
