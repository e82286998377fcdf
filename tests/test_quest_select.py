"""The one-launch retrieval (``kernels.quest_select``: Quest scores with the selection and page table as the
launch's tail) == the two launches it replaces, bit for bit; the decode step takes it at small batches.

Runs on CPU through Triton's interpreter (small sizes), and compiled on a GPU.
"""

import pytest
import torch

import sparse_ref
from sparse_ref import SparseConfig
from sparse_ref.algorithms.base import retrieve_attention_metadata
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import arrival_counters, quest_select, tuning
from sparse_ref.kernels import topk as topk_kernels
from sparse_ref.kernels.page_select import select_pages_to_table
from sparse_ref.kernels.quest import quest_page_scores_from_queries
from sparse_ref.kernels.quest_select import quest_select_to_table
from sparse_ref.workloads import make_quest_decode_setup

DEVICE = sparse_ref.default_device()
NAMES = ("scores", "selected", "lengths", "page_table", "kv_lens", "cu_kv_lens")


def setup(bs, ctx, P, h_q, h_kv, config, seed=0):
    s = make_quest_decode_setup(bs=bs, ctx=ctx, page_size=P, num_q_heads=h_q, num_kv_heads=h_kv, head_dim=16,
                                config=config, device=DEVICE, seed=seed, selection_backend="triton",
                                scoring_backend="triton")
    return s


def launch_args(s, layer=0):
    a = s.algorithm
    return (s.queries, a.page_min[layer], a.page_max[layer], a.page_valid[layer], a.req_to_token_pool.req_to_token,
            s.req_pool_indices, a.page_size, a.max_pages, a.config.gqa_mode)


def two_launches(s, seq_lens):
    args = launch_args(s)
    a = s.algorithm
    scores = quest_page_scores_from_queries(*args)
    return (scores, *select_pages_to_table(scores, seq_lens, s.sparse_mask, a.page_size, a.config,
                                           s.req_pool_indices, a.req_to_token_pool.req_to_token))


CASES = [  # bs, ctx, page size, query heads, KV heads, config, seq_len overrides
    (1, 203, 4, 4, 2, SparseConfig(page_budget=5, num_recent_pages=2, num_sink_pages=1), {}),
    (3, 150, 3, 2, 2, SparseConfig(page_budget=7, num_recent_pages=1, num_sink_pages=2), {1: 0, 2: 1}),
    (5, 97, 2, 6, 2, SparseConfig(keep_ratio=0.3, num_recent_pages=3), {0: 96, 3: 40}),
    (2, 64, 16, 4, 4, SparseConfig(page_budget=9, num_recent_pages=1), {}),  # k larger than the history
]


@pytest.mark.parametrize("bs,ctx,P,h_q,h_kv,config,lens", CASES)
@pytest.mark.parametrize("direct_ratio", [8, 0])  # the direct plan; the delegates plan (topk.rows)
def test_one_launch_equals_two(bs, ctx, P, h_q, h_kv, config, lens, direct_ratio):
    s = setup(bs, ctx, P, h_q, h_kv, config, seed=bs + ctx)
    seq_lens = s.forward_batch.seq_lens.clone()
    for r, n in lens.items():
        seq_lens[r] = n
    if bs > 1:
        s.sparse_mask[bs // 2] = False
    with tuning(topk_kernels.TUNING, direct_ratio=direct_ratio):
        want = two_launches(s, seq_lens)
        for _ in range(2):  # twice: the arrival counters are back at zero after each launch
            got = quest_select_to_table(*launch_args(s), seq_lens, s.sparse_mask, s.algorithm.config)
            for name, g, w in zip(NAMES, got, want, strict=True):
                assert torch.equal(g, w), name
    assert int(arrival_counters("quest_select", torch.device(DEVICE), bs).abs().sum()) == 0
    dense = ~s.sparse_mask  # rows left dense: no pages selected, every token attended
    assert int(got[5][-1]) == int(got[4].sum()) and bool((got[2][dense] == 0).all())
    assert torch.equal(got[4][dense].long(), seq_lens[dense].long())


def test_decode_step_takes_one_launch_at_small_batches(monkeypatch):
    """retrieve_attention_metadata runs the one launch up to TUNING["max_rows"] rows (the same results as the
    two launches above it), and not where score_pages is wrapped (tensor parallel sums scores in between)."""
    config = SparseConfig(page_budget=4, num_recent_pages=2, num_sink_pages=1)
    s = setup(3, 130, 4, 4, 2, config, seed=3)
    calls = []
    real = quest_select.quest_select_to_table
    monkeypatch.setattr(quest_select, "quest_select_to_table", lambda *a, **k: calls.append(1) or real(*a, **k))
    r2t = s.workload.req_to_token
    args = (s.algorithm, s.queries, 0, s.req_pool_indices, s.sparse_mask, s.forward_batch, r2t)
    with tuning(quest_select.TUNING, max_rows=2):
        two = retrieve_attention_metadata(*args)
    assert calls == []
    with tuning(quest_select.TUNING, max_rows=3):
        one = retrieve_attention_metadata(*args)
        assert calls == [1]
        s.algorithm.score_pages = s.algorithm.score_pages  # wrapped: an instance attribute
        retrieve_attention_metadata(*args)
        assert calls == [1]
    for name, g, w in zip(NAMES[1:], one, two, strict=True):
        assert torch.equal(g, w), name
    assert int(one[1][0]) == 1 + 4 + 2


@pytest.mark.parametrize("change, match", [
    (dict(seq_lens=lambda t: t[:1]), r"seq_lens: expected shape \[2\]"),
    (dict(seq_lens=lambda t: t + 10**6), r"seq_lens: expected values in"),
    (dict(sparse_mask=lambda t: t.int()), "sparse_mask: expected dtype torch.bool"),
    (dict(rows=lambda t: t + 100), r"req_pool_indices: expected values in"),
    (dict(queries=lambda t: t[:, :3]), "queries: expected"),
    (dict(gqa_mode="max"), "gqa_mode"),
    (dict(config=object()), "config: expected a sparse_ref.SparseConfig"),
])
def test_input_errors_before_the_launch(change, match):
    s = setup(2, 80, 4, 4, 2, SparseConfig(page_budget=3))
    q, pmin, pmax, valid, r2t, rows, P, max_pages, mode = launch_args(s)
    seq_lens, mask, config = s.forward_batch.seq_lens, s.sparse_mask, s.algorithm.config
    out = tuple(torch.full(shape, 7, dtype=torch.int32, device=DEVICE) for shape in ((2, max_pages), (2,), (3,)))
    kw = dict(queries=q, rows=rows, seq_lens=seq_lens, sparse_mask=mask, gqa_mode=mode, config=config)
    for name, fn in change.items():
        kw[name] = fn(kw[name]) if callable(fn) else fn
    with pytest.raises(SparseRefError, match=match):
        quest_select_to_table(kw["queries"], pmin, pmax, valid, r2t, kw["rows"], P, max_pages, kw["gqa_mode"],
                              kw["seq_lens"], kw["sparse_mask"], kw["config"], out=out)
    assert all(bool((t == 7).all()) for t in out)  # nothing was written
