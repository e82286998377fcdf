"""Quest: page bounds, the upper-bound property, GQA modes, the three errors, construct/update, stale bounds."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ref import KVCacheManager, ShapeError, SparseConfig, build_decode_batch, build_extend_batch
from sparse_ref.algorithms import QuestAlgorithm
from sparse_ref.algorithms.quest import split_query_sign
from sparse_ref.errors import BatchError


def quest_on(manager, config=None):
    algo = QuestAlgorithm(config or SparseConfig(page_budget=1))
    algo.initialize_representation_pool(0, manager.token_to_kv_pool.num_layers, manager.token_to_kv_pool,
                                        manager.req_to_token_pool, page_allocator=manager.allocator)
    return algo


def write_keys(manager, req, gen, start=0):
    """Random K (and V) for tokens [start, seq_len) of req; returns the keys."""
    slots = manager.req_to_token_pool.req_to_token[req.req_pool_idx, start:req.seq_len].long()
    pool = manager.token_to_kv_pool
    k = torch.randn(slots.shape[0], pool.num_kv_heads, pool.head_dim, generator=gen)
    pool.set_kv(0, slots, k, torch.randn_like(k))
    return k


def naive_scores(q, keys_by_page, num_kv_heads, gqa_mode):
    """Quest scores the slow way: per page, per KV head, per query head, straight from the formula."""
    bs_heads, d = q.shape
    group = bs_heads // num_kv_heads
    out = []
    for keys in keys_by_page:  # keys [P, H_kv, D]
        mn, mx = keys.min(0).values, keys.max(0).values
        s = 0.0
        for kvh in range(num_kv_heads):
            qs = q[kvh * group:(kvh + 1) * group]
            qs = [qs.mean(0)] if gqa_mode == "mean" else list(qs)
            for qh in qs:
                s += torch.maximum(qh * mx[kvh], qh * mn[kvh]).sum()
        out.append(float(s))
    return torch.tensor(out)


@given(st.integers(1, 3), st.sampled_from([1, 2, 4]), st.sampled_from([1, 3, 16]), st.integers(1, 70),
       st.sampled_from(["mean", "per_kv_head"]), st.integers(0, 2**31 - 1))
def test_scores_match_naive_and_bound_every_key(num_kv_heads, group, page_size, seq_len, gqa_mode, seed):
    gen = torch.Generator().manual_seed(seed)
    d = 5
    m = KVCacheManager.create(max_requests=1, max_context_len=80, num_pages=90, page_size=page_size,
                              num_kv_heads=num_kv_heads, head_dim=d)
    m.allocator.alloc(3)  # so logical and physical pages differ
    req = m.admit(seq_len)
    keys = write_keys(m, req, gen)
    algo = quest_on(m, SparseConfig(page_budget=1, gqa_mode=gqa_mode))
    algo.construct_representations(0, build_extend_batch(m, [req]), m.token_to_kv_pool.get_key_buffer(0))
    q = torch.randn(1, num_kv_heads * group, d, generator=gen) * 3
    fb = build_decode_batch(m, [req])
    scores = algo.score_pages(q, 0, fb.req_pool_indices, fb)[0]
    complete = seq_len // page_size
    pages = [keys[j * page_size:(j + 1) * page_size] for j in range(complete)]
    torch.testing.assert_close(scores[:complete], naive_scores(q[0], pages, num_kv_heads, gqa_mode),
                               rtol=1e-5, atol=1e-4)
    if complete < -(-seq_len // page_size):
        assert scores[complete] == float("-inf")  # the incomplete last page has no bounds yet
    # The upper-bound property: no key of the page has a larger (GQA-folded) dot product than its score.
    q4 = q[0].reshape(num_kv_heads, group, d)
    folded = q4.mean(1)[:, None] if gqa_mode == "mean" else q4  # [H_kv, g, D]
    for j, keys_j in enumerate(pages):
        dots = torch.einsum("hgd,thd->t", folded, keys_j)  # summed over KV heads (and query heads)
        assert bool((dots <= scores[j] + 1e-4 * (1 + scores[j].abs())).all())


def test_per_kv_head_is_at_least_group_times_mean():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 8, generator=gen)
    pos_m, neg_m = split_query_sign(q, 2, 8, "mean")
    pos_h, neg_h = split_query_sign(q, 2, 8, "per_kv_head")
    mx = torch.randn(2, 8, generator=gen).abs()
    mn = -torch.randn(2, 8, generator=gen).abs()
    mean_score = (pos_m * mx + neg_m * mn).sum((1, 2))
    head_score = (pos_h * mx + neg_h * mn).sum((1, 2))
    assert bool((head_score >= 2 * mean_score - 1e-5).all())


def test_query_shape_errors_verbatim():
    with pytest.raises(ShapeError) as e:
        split_query_sign(torch.zeros(2, 30), 2, 8, "mean")
    assert str(e.value).startswith("Quest query hidden size 30 not divisible by head_dim 8. Fix:")
    with pytest.raises(ShapeError) as e:
        split_query_sign(torch.zeros(2, 4, 8, 1), 2, 8, "mean")
    assert str(e.value).startswith("Unsupported query shape for Quest: torch.Size([2, 4, 8, 1]). Fix:")  # SGLang's
    with pytest.raises(ShapeError) as e:
        split_query_sign(torch.zeros(2, 4, 7), 2, 8, "mean")
    assert str(e.value).startswith("Unsupported query shape for Quest: torch.Size([2, 4, 7]). Fix:")
    with pytest.raises(ShapeError) as e:
        split_query_sign(torch.zeros(2, 3, 8), 2, 8, "mean")
    assert str(e.value).startswith("Query heads 3 not divisible by KV heads 2. Fix:")
    with pytest.raises(ShapeError) as e:
        split_query_sign(torch.zeros(2, 24), 2, 8, "mean")  # flat: 3 heads of 8
    assert str(e.value).startswith("Query heads 3 not divisible by KV heads 2.")
    a = split_query_sign(torch.arange(32.0).reshape(2, 16), 2, 8, "mean")
    b = split_query_sign(torch.arange(32.0).reshape(2, 2, 8), 2, 8, "mean")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_decode_update_builds_the_page_it_completes_and_nothing_else():
    gen = torch.Generator().manual_seed(1)
    P = 4
    m = KVCacheManager.create(max_requests=2, max_context_len=32, num_pages=20, page_size=P, head_dim=3)
    a, b = m.admit(5), m.admit(2)
    write_keys(m, a, gen)
    write_keys(m, b, gen)
    algo = quest_on(m)
    kbuf = m.token_to_kv_pool.get_key_buffer(0)
    algo.construct_representations(0, build_extend_batch(m, [a, b]), kbuf)
    valid = algo.page_valid[0]
    assert valid.nonzero().flatten().tolist() == [a.pages[0]]
    for _ in range(3):  # a: 6, 7, 8 tokens (completes its page 1 at 8); b: 3, 4, 5 (completes page 0 at 4)
        m.grow(a, 1)
        m.grow(b, 1)
        write_keys(m, a, gen, a.seq_len - 1)
        write_keys(m, b, gen, b.seq_len - 1)
        algo.update_representations(0, build_decode_batch(m, [a, b]), kbuf)
    assert sorted(valid.nonzero().flatten().tolist()) == sorted([a.pages[0], a.pages[1], b.pages[0]])
    for page in (a.pages[1], b.pages[0]):
        keys = kbuf[page * P:(page + 1) * P]
        assert torch.equal(algo.page_min[0][page], keys.min(0).values)
        assert torch.equal(algo.page_max[0][page], keys.max(0).values)
    with pytest.raises(BatchError, match="expected a DECODE batch"):
        algo.update_representations(0, build_extend_batch(m, [a]), kbuf)
    with pytest.raises(BatchError, match="expected an EXTEND batch"):
        algo.construct_representations(0, build_decode_batch(m, [a]), kbuf)
    with pytest.raises(ShapeError, match="k_buffer"):
        algo.construct_representations(0, build_extend_batch(m, [a]), kbuf[:-1])


def test_chunked_prefill_rebuilds_pages_completed_across_chunks():
    gen = torch.Generator().manual_seed(2)
    P = 4
    m = KVCacheManager.create(max_requests=1, max_context_len=32, num_pages=10, page_size=P, head_dim=3)
    r = m.admit(6)
    write_keys(m, r, gen)
    algo = quest_on(m)
    kbuf = m.token_to_kv_pool.get_key_buffer(0)
    algo.construct_representations(0, build_extend_batch(m, [r]), kbuf)
    m.grow(r, 5)  # second chunk, tokens 6..10: page 1 (tokens 4..7) completes, page 2 (8..10) stays partial
    write_keys(m, r, gen, 6)
    algo.construct_representations(0, build_extend_batch(m, [r], prefix_lens=[6]), kbuf)
    assert algo.page_valid[0][r.pages[:2]].all() and not algo.page_valid[0][r.pages[2]]
    page = r.pages[1]
    assert torch.equal(algo.page_max[0][page], kbuf[page * P:(page + 1) * P].max(0).values)


def test_freed_and_reused_pages_never_score_with_stale_bounds():
    gen = torch.Generator().manual_seed(3)
    P = 4
    m = KVCacheManager.create(max_requests=2, max_context_len=64, num_pages=9, page_size=P, head_dim=4)
    kbuf = m.token_to_kv_pool.get_key_buffer(0)
    old = m.admit(32)  # takes all 8 usable pages
    k_old = write_keys(m, old, gen) * 100  # huge keys: stale bounds would dominate any score
    m.token_to_kv_pool.set_kv(0, m.req_to_token_pool.req_to_token[old.req_pool_idx, :32].long(), k_old, k_old)
    algo = quest_on(m)
    algo.construct_representations(0, build_extend_batch(m, [old]), kbuf)
    old_pages = list(old.pages)
    assert algo.page_valid[0][old_pages].all()
    m.release(old)  # the allocator's free listener invalidates the pages in Quest
    assert not algo.page_valid[0].any()
    assert not algo.page_min[0].any() and not algo.page_max[0].any()
    new = m.admit(30)  # reuses the same physical pages
    assert sorted(new.pages) == sorted(old_pages)
    write_keys(m, new, gen)
    q = torch.randn(1, 1, 4, generator=gen)
    fb = build_decode_batch(m, [new])
    assert (algo.score_pages(q, 0, fb.req_pool_indices, fb) == float("-inf")).all()  # nothing valid yet
    algo.construct_representations(0, build_extend_batch(m, [new]), kbuf)
    scores = algo.score_pages(q, 0, fb.req_pool_indices, fb)[0]
    for j in range(7):  # 7 complete pages of the new request, scored from its own keys only
        keys = kbuf[new.pages[j] * P:(new.pages[j] + 1) * P]
        expect = naive_scores(q[0], [keys], 1, "mean")[0]
        torch.testing.assert_close(scores[j], expect, rtol=1e-5, atol=1e-5)
        assert scores[j].abs() < 1000  # stale bounds (keys x100) would score in the hundreds or more
    assert scores[7] == float("-inf")


def test_invalid_req_to_token_entries_are_reported():
    P = 4
    m = KVCacheManager.create(max_requests=1, max_context_len=16, num_pages=6, page_size=P, head_dim=2)
    r = m.admit(9)
    algo = quest_on(m)
    fb = build_decode_batch(m, [r])
    m.req_to_token_pool.req_to_token[r.req_pool_idx, 4] = 1000  # logical page 1 -> physical page 250
    with pytest.raises(ShapeError, match="maps logical page 1 to physical page 250"):
        algo.score_pages(torch.zeros(1, 1, 2), 0, fb.req_pool_indices, fb)


# ------------------------------------------------------------------ 16-bit bounds (directed rounding)
HALF_DTYPES = [torch.bfloat16, torch.float16]


def awkward_floats(gen, n):
    """fp32 values that round to nearest in the wrong direction half the time, plus range edges."""
    base = (torch.randn(n, generator=gen) * 4).bfloat16().float()  # exact in bf16 (and mostly in fp16)
    nudge = torch.randn(n, generator=gen).sign() * base.abs() * 2.0 ** -12  # below half a bf16 ulp, above fp16's
    edges = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 1e-30, 65504.0, 65519.0, 65521.0, 7e4, -7e4, 3e38, -3e38,
                          float("inf"), float("-inf")])
    return torch.cat([torch.randn(n, generator=gen) * 10, base + nudge, edges])


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_round_bounds_outward_is_the_nearest_value_on_the_outer_side(dtype):
    from sparse_ref.algorithms.quest import round_bounds_outward

    x = awkward_floats(torch.Generator().manual_seed(0), 2000)
    lo, hi = round_bounds_outward(x, x, dtype)
    assert lo.dtype == dtype and hi.dtype == dtype
    assert bool((lo.float() <= x).all()) and bool((hi.float() >= x).all())
    # tight: the next 16-bit value past lo (hi) is already beyond x
    up = torch.nextafter(lo, torch.full_like(lo, float("inf"))).float()
    down = torch.nextafter(hi, torch.full_like(hi, float("-inf"))).float()
    assert bool(((up > x) | (x == float("inf"))).all()) and bool(((down < x) | (x == float("-inf"))).all())
    nearest = x.to(dtype).float()
    assert bool((nearest > x).any()) and bool((nearest < x).any()), "the test data must round both ways"
    assert bool(torch.isnan(round_bounds_outward(torch.tensor([float("nan")]), torch.tensor([float("nan")]),
                                                 dtype)[0]).all())
    if dtype == torch.float16:  # overflow: 7e4 has no fp16 value; the outer side is infinite, the inner finite
        lo, hi = round_bounds_outward(torch.tensor([7e4, -7e4]), torch.tensor([7e4, -7e4]), dtype)
        assert lo.tolist() == [65504.0, float("-inf")] and hi.tolist() == [float("inf"), -65504.0]


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(HALF_DTYPES), st.sampled_from([1, 3, 16]), st.sampled_from(["mean", "per_kv_head"]),
       st.sampled_from([(1, 1), (2, 2), (3, 1)]), st.integers(0, 2**31 - 1))
def test_16bit_bounds_still_bound_every_key(dtype, page_size, gqa_mode, heads, seed):
    """Fresh keys that round the wrong way: the score from 16-bit bounds is >= q . k for each key of its page.

    The same keys with bounds rounded to NEAREST break the bound at page size 1 (the mutation this guards).
    """
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, group = heads
    d, seq_len = 24, 50
    m = KVCacheManager.create(max_requests=1, max_context_len=80, num_pages=90, page_size=page_size,
                              num_kv_heads=num_kv_heads, head_dim=d)
    m.allocator.alloc(3)
    req = m.admit(seq_len)
    slots = m.req_to_token_pool.req_to_token[req.req_pool_idx, :seq_len].long()
    n = seq_len * num_kv_heads * d
    keys = awkward_floats(gen, n)[torch.randperm(n + 14, generator=gen)[:n]].reshape(seq_len, num_kv_heads, d)
    keys = keys.clamp(-6e4, 6e4)  # fp16 range: an infinite bound would make the score inf or NaN, not a test
    m.token_to_kv_pool.set_kv(0, slots, keys, keys)
    fb = build_decode_batch(m, [req])
    q = torch.randn(1, num_kv_heads * group, d, generator=gen) * 3
    complete = seq_len // page_size
    pages = [keys[j * page_size:(j + 1) * page_size] for j in range(complete)]
    q4 = q[0].reshape(num_kv_heads, group, d)
    folded = q4.mean(1)[:, None] if gqa_mode == "mean" else q4
    for rounding in ("outward", "nearest"):
        algo = QuestAlgorithm(SparseConfig(page_budget=1, gqa_mode=gqa_mode), bounds_dtype=dtype)
        algo.initialize_representation_pool(0, 1, m.token_to_kv_pool, m.req_to_token_pool)
        algo.construct_representations(0, build_extend_batch(m, [req]), m.token_to_kv_pool.get_key_buffer(0))
        assert algo.page_min[0].dtype == dtype
        if rounding == "nearest":
            for j, keys_j in enumerate(pages):
                algo.page_min[0][req.pages[j]] = keys_j.amin(0).to(dtype)
                algo.page_max[0][req.pages[j]] = keys_j.amax(0).to(dtype)
        scores = algo.score_pages(q, 0, fb.req_pool_indices, fb)[0].double()
        ok = []
        for j, keys_j in enumerate(pages):
            dots = torch.einsum("hgd,thd->t", folded.double(), keys_j.double())
            ok.append(bool((dots <= scores[j] + 1e-6 * (1 + scores[j].abs())).all()))
        if rounding == "outward":
            assert all(ok)
        elif page_size == 1:
            assert not all(ok), "rounding to nearest should break the bound somewhere at page size 1"


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_16bit_bounds_select_the_same_pages_on_separated_data(dtype):
    from sparse_ref.workloads import make_planted_workload

    cfg = SparseConfig(page_budget=4, num_recent_pages=1, num_sink_pages=1)  # sink + recent + the 4 needle pages
    picks = {}
    for bounds in (torch.float32, dtype):
        wl = make_planted_workload([300, 257, 420], page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=32,
                                   needle_strength=4.0, seed=11)
        algo = QuestAlgorithm(cfg, bounds_dtype=bounds)
        wl.attach(algo)
        fb = wl.forward_batch
        mask = torch.ones(3, dtype=torch.bool)
        picks[bounds] = algo.retrieve_topk(wl.queries, 0, fb.req_pool_indices, mask, forward_batch=fb)
        for r, needles in enumerate(wl.needle_pages):
            assert set(needles) <= set(picks[bounds][0][r].tolist())
    assert torch.equal(picks[torch.float32][0], picks[dtype][0])
    assert torch.equal(picks[torch.float32][1], picks[dtype][1])


def test_bounds_dtype_is_validated():
    from sparse_ref.errors import ConfigError

    with pytest.raises(ConfigError, match="bounds_dtype"):
        QuestAlgorithm(SparseConfig(), bounds_dtype=torch.float64)
    with pytest.raises(ConfigError, match="bounds_dtype"):
        QuestAlgorithm(SparseConfig(), bounds_dtype="bf16")
