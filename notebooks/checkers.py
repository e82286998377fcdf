"""The notebooks' exercise checkers: ``check_<name>(fn)`` tries ``fn`` on fresh cases against its spec.

Each checker builds its own inputs (awkward sizes, edge cases), compares ``fn`` with the package or with a
brute-force spec, raises ``AssertionError`` saying what differs, and prints ``<name>: correct``. A stub that
raises ``NotImplementedError`` fails every checker (``make exercises`` writes such stubs).
"""

from __future__ import annotations

import math

import torch

import sparse_ref
from sparse_ref import KVCacheManager, SparseConfig
from sparse_ref.algorithms.quest import quest_page_scores_reference, split_query_sign
from sparse_ref.fp8 import quantize_fp8
from sparse_ref.metrics import attention_mass_kept, page_attention_mass
from sparse_ref.rope import apply_rope
from sparse_ref.selection import select_pages, topk_reference


def _passed(name: str) -> None:
    print(f"{name}: correct")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got, want, case: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """``got`` equals ``want`` within the tolerances, else an AssertionError that names the case and shows both."""
    got = torch.as_tensor(got)
    if got.shape != want.shape:
        raise AssertionError(f"{case}: got shape {tuple(got.shape)}, want {tuple(want.shape)}")
    if got.is_floating_point() and want.is_floating_point():
        ok = torch.allclose(got.to(want.dtype), want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        ok = torch.equal(got.to(want.dtype), want)
    if not ok:
        g, w = got.flatten()[:6].tolist(), want.flatten()[:6].tolist()
        raise AssertionError(f"{case}: got {g}{' ...' if got.numel() > 6 else ''}, want {w}"
                             f"{' ...' if want.numel() > 6 else ''}")


# ------------------------------------------------------------------ 00_overview
def check_tokens_read(fn):
    """``fn(kept_pages, seq_len, page_size)``: how many tokens a selection of logical pages reads."""
    g = _gen(0)
    for _ in range(200):
        P = int(torch.randint(1, 9, (1,), generator=g))
        seq_len = int(torch.randint(1, 80, (1,), generator=g))
        n = -(-seq_len // P)
        kept = sorted(torch.randperm(n, generator=g)[: int(torch.randint(0, n + 1, (1,), generator=g))].tolist())
        want = sum(min(P, seq_len - p * P) for p in kept)
        got = fn(kept, seq_len, P)
        assert got == want, f"pages {kept} of a {seq_len}-token request (P={P}): got {got}, want {want}"
    _passed("tokens_read")


def check_history_pages(fn):
    """``fn(num_pages, num_sink, num_recent)``: the pages between the sink and the recent window."""
    for n in range(0, 12):
        for sink in range(0, 4):
            for recent in range(1, 4):
                r = min(n, recent)
                s = min(sink, n - r)
                want = list(range(s, n - r))
                got = list(fn(n, sink, recent))
                assert got == want, f"{n} pages, {sink} sink, {recent} recent: got {got}, want {want}"
    _passed("history_pages")


# ------------------------------------------------------------------ 01_req_to_token_pool
def check_row_slots(fn):
    """``fn(pages, num_tokens, page_size)``: the req_to_token entries of a request owning ``pages``."""
    for P, tokens in ((4, 6), (4, 9), (8, 1), (3, 17), (1, 5), (16, 16)):
        m = KVCacheManager.create(max_requests=3, max_context_len=64, num_pages=40, page_size=P)
        a = m.admit(3 * P)  # someone else first, then gone: its pages come back last-freed first,
        m.admit(P + 1)  # so the request below owns pages that are neither contiguous nor ascending
        m.release(a)
        req = m.admit(tokens)
        want = m.req_to_token_pool.req_to_token[req.req_pool_idx, :tokens]
        got = torch.as_tensor(fn(list(req.pages), tokens, P)).to(torch.int32)
        assert torch.equal(got, want), f"P={P}, {tokens} tokens on pages {req.pages}: got {got.tolist()}, " \
            f"want {want.tolist()}"
    _passed("row_slots")


def check_pages_needed(fn):
    """``fn(seq_len, pages_owned, extra_tokens, page_size)``: new pages growing a request takes."""
    m = KVCacheManager.create(max_requests=2, max_context_len=128, num_pages=40, page_size=4)
    for seq_len in (1, 3, 4, 5, 8, 13):
        req = m.admit(seq_len)
        for extra in (0, 1, 2, 3, 4, 9):
            want = m.pages_needed(req, extra) if extra else 0
            got = fn(seq_len, len(req.pages), extra, 4)
            assert got == want, f"{seq_len} tokens on {len(req.pages)} pages, +{extra}: got {got}, want {want}"
        m.release(req)
    _passed("pages_needed")


# ------------------------------------------------------------------ 02_retrieval_contract
def check_searchable(fn):
    """``fn(seq_lens, width)``: bool ``[bs, width]``, True where position ``t < seq_len`` of the row."""
    for seq_lens, width in (([3, 0, 7], 7), ([1], 1), ([0, 0], 4), ([5, 2, 9, 9], 12)):
        s = torch.tensor(seq_lens)
        want = torch.arange(width)[None, :] < s[:, None]
        got = fn(s, width)
        assert got.dtype == torch.bool and torch.equal(got, want), f"seq_lens {seq_lens}, width {width}: {got}"
    _passed("searchable")


def check_topk_in_prefix(fn):
    """``fn(scores, seq_lens, k)``: per row, the ids of the ``k`` best of the first ``seq_len`` scores,
    ascending, -1 padded to width ``k``; ties to the lower id (``topk_reference(..., order="index")``)."""
    g = _gen(2)
    for case, (bs, n, k) in enumerate(((3, 10, 4), (1, 1, 1), (4, 9, 12), (2, 33, 5), (3, 12, 6), (2, 8, 8))):
        scores = torch.randint(0, 4, (bs, n), generator=g).float()  # ties on purpose
        if case >= 4:  # NaN and -inf are never chosen (a row may then have fewer than k ids)
            scores[:, ::3] = float("nan") if case == 4 else float("-inf")
        seq_lens = torch.randint(0, n + 1, (bs,), generator=g)
        seq_lens[0] = n
        want = topk_reference(scores, k, seq_lens, order="index")
        got = fn(scores, seq_lens, k)
        _close(got, want, f"scores {scores.tolist()}, seq_lens {seq_lens.tolist()}, k {k}")
    _passed("topk_in_prefix")


# ------------------------------------------------------------------ 03_quest
def check_quest_bound_batch(fn):
    """``fn(queries [Q, D], page_min [N, D], page_max [N, D])``: ``[Q, N]`` Quest bounds by the sign split, each
    >= q . k for every key k inside its page's box."""
    g = _gen(3)
    for nq, npages, d in ((3, 5, 8), (1, 1, 1), (4, 7, 64)):
        q = torch.randn(nq, d, generator=g)
        lo = torch.randn(npages, d, generator=g)
        hi = lo + torch.rand(npages, d, generator=g)
        got = fn(q, lo, hi)
        ids = torch.arange(npages)[None].expand(nq, npages)
        want = quest_page_scores_reference(q.clamp(min=0)[:, None], q.clamp(max=0)[:, None], lo[:, None], hi[:, None],
                                           torch.ones(npages, dtype=torch.bool), ids)
        _close(got, want, f"{nq} queries, {npages} pages, D={d}")
        keys = lo[None] + (hi - lo)[None] * torch.rand(200, npages, d, generator=g)  # [200, N, D] inside the boxes
        assert bool((torch.einsum("qd,knd->qkn", q, keys).amax(1) <= got + 1e-5).all()), "a bound must hold"
    _passed("quest_bound_batch")


def check_group_mean_query(fn):
    """``fn(queries [bs, H_q, D], num_kv_heads)``: the mean of each GQA group's query heads ``[bs, H_kv, D]``."""
    g = _gen(4)
    for bs, hq, hkv, d in ((2, 8, 2, 4), (1, 4, 4, 3), (3, 6, 1, 5)):
        q = torch.randn(bs, hq, d, generator=g)
        pos, neg = split_query_sign(q, hkv, d, "mean")
        got = fn(q, hkv)
        _close(got, pos + neg, f"bs {bs}, {hq} query heads over {hkv} KV heads, D={d}")
    _passed("group_mean_query")


# ------------------------------------------------------------------ 04_dsa_indexer
def check_act_quant_blocks(fn):
    """``fn(x [T, n], block)``: ``(float8_e4m3fn [T, n], fp32 scales [T, n // block])`` as ``quantize_fp8``."""
    g = _gen(5)
    for t, n, block in ((3, 128, 128), (2, 64, 32), (1, 8, 8), (2, 256, 128)):
        x = torch.randn(t, n, generator=g) * 3
        x[0, : block // 2] = 0  # a block half zero
        if t > 1:
            x[1, :block] = 0  # an all-zero block: the scale floor
        want_q, want_s = quantize_fp8(x, block)
        got_q, got_s = fn(x, block)
        assert got_q.dtype == torch.float8_e4m3fn, f"values: dtype {got_q.dtype}, want float8_e4m3fn"
        assert torch.equal(got_s, want_s), "scales differ (max(|x|, 1e-4) / 448 per block)"
        assert torch.equal(got_q.float(), want_q.float()), "fp8 values differ"
    _passed("act_quant_blocks")


def check_rope_interleaved(fn):
    """``fn(x [T, D], positions [T], rope_dim, theta)``: interleaved (GPT-J) RoPE on the first ``rope_dim`` dims."""
    g = _gen(6)
    for t, d, rope_dim in ((5, 16, 8), (1, 4, 4), (3, 12, 0), (4, 64, 64)):
        x = torch.randn(t, d, generator=g)
        positions = torch.randint(0, 100_000, (t,), generator=g)
        want = apply_rope(x, positions, rope_dim, 10000.0, interleaved=True)
        _close(fn(x, positions, rope_dim, 10000.0), want, f"T={t}, D={d}, rope_dim {rope_dim}")
    _passed("rope_interleaved")


# ------------------------------------------------------------------ 05_triton_topk
def check_ordered_bits(fn):
    """``fn(x fp32 [N])``: int64 keys in ``[0, 2**32)``, ordered as the floats, the same key for -0.0 and +0.0."""
    x = torch.tensor([-float("inf"), -3.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 2.5, float("inf")])
    x = torch.cat([x, torch.randn(1000, generator=_gen(7)) * 10])
    keys = fn(x)
    assert keys.dtype == torch.int64 and int(keys.min()) >= 0 and int(keys.max()) < 2**32, "int64 in [0, 2**32)"
    assert keys[4] == keys[5], "-0.0 and +0.0 must get the same key"
    bits = (x + 0.0).view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # + 0.0 folds -0.0 into +0.0
    want = torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)
    _close(keys, want, "the keys of -inf, -3.5, -1, -1e-30, -0.0, +0.0, 1e-30, 1, 2.5, inf, then randn (both zeros: "
           "the key of +0.0, 0x80000000)")
    order = torch.argsort(x, stable=True)
    k, v = keys[order], x[order]
    assert bool((k[1:] >= k[:-1]).all()), "keys must increase with the floats"
    assert bool((k[1:][v[1:] > v[:-1]] > k[:-1][v[1:] > v[:-1]]).all()), "distinct floats, distinct keys"
    _passed("ordered_bits")


def check_kth_digit(fn):
    """``fn(keys int64 [N] in [0, 2**32), k)``: ``(d, above)``: the top byte ``d`` (``key >> 24``) of the k-th
    largest key, and how many keys have a larger top byte: one pass of the radix select."""
    g = _gen(8)
    for n, k in ((100, 1), (100, 37), (7, 7), (1000, 999), (50, 10)):
        keys = torch.randint(0, 2**32, (n,), generator=g)
        keys[: n // 3] = keys[0]  # ties
        kth = int(keys.sort(descending=True).values[k - 1])
        d = kth >> 24
        want = (d, int(((keys >> 24) > d).sum()))
        got = fn(keys, k)
        assert tuple(int(v) for v in got) == want, f"n={n}, k={k}: got {got}, want {want}"
    _passed("kth_digit")


SENTINEL_PAD = 4096  # elements of sentinel on each side of a Triton exercise's input


def _between_sentinels(t, value):
    """``(view, buffer)``: ``t`` copied into the middle of a larger buffer filled with ``value``. The interpreter
    checks no bounds, so a load past the tensor without a mask reads ``value`` (and fails the check, with a
    sentence saying so) instead of whatever memory lies there; a store past it changes the buffer's ends."""
    buffer = torch.full((t.numel() + 2 * SENTINEL_PAD,), value, dtype=t.dtype, device=t.device)
    view = buffer[SENTINEL_PAD: SENTINEL_PAD + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buffer


def _check_sentinels(buffers, where):
    """The ends of each ``_between_sentinels`` buffer are as they were: nothing was written outside the inputs."""
    for name, (buffer, value) in buffers.items():
        ends = torch.cat([buffer[:SENTINEL_PAD], buffer[-SENTINEL_PAD:]])
        assert bool((ends == value).all()), f"{where}: the kernel wrote outside {name} (a store without a mask?)"


OUTSIDE = " (the inputs sit between sentinel values: a load past a tensor without a mask reads them)"


# ------------------------------------------------------------------ 05: the puzzles (section 0b)
def _puzzle(name, case, fn, inputs, out, want, fill, compare=None):
    """``fn(*inputs, out)`` with every tensor between sentinels (``fill``: one per tensor, ``out``'s last and unlike
    the inputs', so that a store past ``out`` of what was read past an input changes it): nothing written
    outside, and ``out`` (or ``compare(got)``) as ``want``."""
    device = sparse_ref.default_device()
    placed = [_between_sentinels(t.to(device), value) for t, value in zip((*inputs, out), fill, strict=True)]
    fn(*(view for view, _ in placed))
    names = [f"input {i}" for i in range(len(inputs))] + ["out"]
    _check_sentinels({n: (buffer, value) for n, (_, buffer), value in zip(names, placed, fill, strict=True)},
                     f"{name}, {case}")
    got = placed[-1][0].cpu()
    ok = compare(got) if compare else (torch.allclose(got, want, rtol=1e-4, atol=1e-4) if got.is_floating_point()
                                       else torch.equal(got, want))
    assert ok, f"{name}, {case}: got {got.reshape(-1)[:6].tolist()}..., want {want.reshape(-1)[:6].tolist()}{OUTSIDE}"
    return got


BIG = 1e30  # a float sentinel: a row max or sum that reads one is wrong by far


def check_masked_copy(fn):
    """``fn(x, out)``: ``out[i] = x[i]`` for a 1-D ``x`` of any length (not a multiple of the block)."""
    for n in (1, 100, 1000, 4097):
        x = torch.randn(n, generator=_gen(n))
        _puzzle("masked_copy", f"N={n}", fn, [x], torch.empty(n), x, (BIG, -3.0))
    _passed("masked_copy")


def check_add_column_bias(fn):
    """``fn(x [R, C], bias [C], out [R, C])``: ``out = x + bias`` with 2-D tiles, masked on both edges."""
    for r, c in ((1, 1), (5, 37), (33, 130), (70, 17)):
        x, bias = torch.randn(r, c, generator=_gen(r)), torch.randn(c, generator=_gen(c))
        _puzzle("add_column_bias", f"[{r}, {c}]", fn, [x, bias], torch.empty(r, c), x + bias, (BIG, BIG, -3.0))
    _passed("add_column_bias")


def check_row_sum(fn):
    """``fn(x [R, N], out [R])``: each row's sum, a loop over the row's blocks."""
    for r, n in ((1, 1), (3, 100), (4, 1000), (2, 2049)):
        x = torch.randn(r, n, generator=_gen(n))
        _puzzle("row_sum", f"[{r}, {n}]", fn, [x], torch.empty(r), x.sum(1), (BIG, -3.0))
    _passed("row_sum")


def check_keep_positive(fn):
    """``fn(x [N], out [N], count [1])``: the positive values of ``x`` in their order at the front of ``out``
    (the rest of ``out`` untouched) and how many in ``count``; N at most 1024 (one block, a prefix sum)."""
    for n in (1, 7, 100, 1000):
        x = torch.randn(n, generator=_gen(n))
        x[0] = 0.0  # zero is not positive
        kept = x[x > 0]
        device = sparse_ref.default_device()
        (xs, xb), (outs, ob), (cs, cb) = (_between_sentinels(t.to(device), v) for t, v in
                                        ((x, BIG), (torch.full((n,), -7.0), -7.0),
                                         (torch.full((1,), -1, dtype=torch.int32), -1)))
        fn(xs, outs, cs)
        _check_sentinels({"x": (xb, BIG), "out": (ob, -7.0), "count": (cb, -1)}, f"keep_positive, N={n}")
        got = outs.cpu()
        assert int(cs[0]) == kept.numel(), f"keep_positive, N={n}: count {int(cs[0])}, want {kept.numel()}"
        assert torch.equal(got[:kept.numel()], kept) and bool((got[kept.numel():] == -7.0).all()), \
            f"keep_positive, N={n}: out {got[:8].tolist()}..., want {kept[:8].tolist()} then untouched{OUTSIDE}"
    _passed("keep_positive")


def check_histogram(fn):
    """``fn(x int32 [N], out int32 [BINS])``: how many of ``x`` (values in ``[0, BINS)``) fall in each bin."""
    for n, bins in ((1, 4), (100, 16), (1000, 64), (5000, 256)):
        x = torch.randint(0, bins, (n,), generator=_gen(n), dtype=torch.int32)
        want = torch.bincount(x, minlength=bins).int()
        _puzzle("histogram", f"N={n}, {bins} bins", fn, [x], torch.zeros(bins, dtype=torch.int32), want, (0, -5),
                compare=lambda got, want=want: torch.equal(got, want))  # (a read past x adds to bin 0)
    _passed("histogram")


def check_dot_tile(fn):
    """``fn(a [M, K], b [K, N], out [M, N])``: ``a @ b`` in fp32, tiles of 16 (``tl.dot``), masked edges."""
    for m, k, n in ((1, 1, 1), (16, 16, 16), (20, 33, 17), (50, 70, 40)):
        a, b = torch.randn(m, k, generator=_gen(m)), torch.randn(k, n, generator=_gen(n))
        _puzzle("dot_tile", f"[{m}, {k}] @ [{k}, {n}]", fn, [a, b], torch.empty(m, n), a @ b, (BIG, BIG, -3.0),
                compare=lambda got, want=a @ b: torch.allclose(got, want, rtol=1e-4, atol=1e-4))
    _passed("dot_tile")


def check_online_softmax(fn):
    """``fn(x [R, N], out [R, N])``: each row's softmax, the row read in blocks with a running max and sum
    (rows longer than a block; -inf entries included)."""
    for r, n in ((1, 1), (3, 100), (2, 1000), (4, 3000)):
        x = torch.randn(r, n, generator=_gen(n)) * 5
        x[0, -1] = float("-inf") if n > 1 else x[0, -1]
        _puzzle("online_softmax", f"[{r}, {n}]", fn, [x], torch.empty(r, n), torch.softmax(x, 1), (BIG, -3.0))
    _passed("online_softmax")


def check_gather_pages(fn):
    """``fn(pool [slots, D], table int32 [pages], out [seq_len, D])``: token ``t`` of a request is row
    ``table[t // P] * P + t % P`` of the pool (P = 4), for ``t < seq_len`` (the last page partly full)."""
    for pages, seq_len, d in ((1, 1, 4), (3, 10, 8), (5, 17, 16), (9, 33, 24)):
        g = _gen(seq_len)
        pool = torch.randn(4 * 12, d, generator=g)
        table = 1 + torch.randperm(11, generator=g)[:pages].int()
        t = torch.arange(seq_len)
        want = pool[table[t // 4].long() * 4 + t % 4]
        _puzzle("gather_pages", f"{pages} pages, seq_len {seq_len}, D={d}", fn, [pool, table],
                torch.empty(seq_len, d), want, (BIG, 0, -3.0))  # (past the table: page 0, the padding)
    _passed("gather_pages")


def check_row_argmax(fn):
    """``fn(x [R, N], lengths [R])``: the Triton launcher of a top-1 kernel, int32 ``[R]``: the id of each row's
    largest score among its first ``lengths[r]``, ties to the lower id, NaN and -inf never chosen, -1 when the
    row has no candidate; equal to the package's ``topk(x, 1, lengths)``."""
    from sparse_ref.kernels.topk import topk

    g = _gen(15)
    device = sparse_ref.default_device()
    cases = {"random rows, N not a power of two": (torch.randn(4, 1000, generator=g), None),
             "ties (three values)": (torch.randint(0, 3, (3, 300), generator=g).float(), None),
             "NaN and -inf everywhere but one": (torch.full((2, 77), float("nan")), None),
             "-0.0 before +0.0": (torch.tensor([[-1.0, -0.0, 0.0, -2.0]]), None),
             "short and empty rows": (torch.randn(4, 130, generator=g), torch.tensor([130, 1, 0, 65]))}
    cases["NaN and -inf everywhere but one"][0][:, 1::2] = float("-inf")
    cases["NaN and -inf everywhere but one"][0][0, 40] = -5.0  # row 1 has no candidate at all
    for name, (x, lengths) in cases.items():
        lengths = torch.full((x.shape[0],), x.shape[1]) if lengths is None else lengths
        want = topk(x.to(device), 1, lengths.to(device))[:, 0].cpu()
        assert torch.equal(want, topk_reference(x, 1, lengths)[:, 0])
        (xs, xb), (ls, lb) = _between_sentinels(x.to(device), 1e30), _between_sentinels(lengths.to(device), 1 << 30)
        got = torch.as_tensor(fn(xs, ls)).cpu()
        _check_sentinels({"x": (xb, 1e30), "lengths": (lb, 1 << 30)}, name)
        assert got.dtype == torch.int32 and got.shape == want.shape, f"{name}: got {got.dtype} {tuple(got.shape)}, " \
            f"want int32 {tuple(want.shape)}"
        assert torch.equal(got, want), f"{name}: got ids {got.tolist()}, want {want.tolist()}{OUTSIDE}"
    _passed("row_argmax")


def check_row_max(fn):
    """``fn(x [R, N])``: the Triton launcher of a row-max kernel, ``[R]``, equal to ``x.amax(1)`` (``-inf`` and
    masked tails included: N not a multiple of the block)."""
    g = _gen(10)
    device = sparse_ref.default_device()
    for r, n in ((3, 5), (1, 1), (4, 1000), (2, 130)):
        x = torch.randn(r, n, generator=g)
        x[0, 0] = float("-inf")
        xs, xb = _between_sentinels(x.to(device), 1e30)
        got = fn(xs).cpu()
        _check_sentinels({"x": (xb, 1e30)}, f"[{r}, {n}]")
        assert torch.equal(got, x.amax(1)), f"[{r}, {n}]: got {got.tolist()}, want {x.amax(1).tolist()}{OUTSIDE}"
    _passed("row_max")


# ------------------------------------------------------------------ 06_triton_scoring
def check_sign_split_scores(fn):
    """``fn(q [bs, H_kv, D], page_min, page_max [pages, H_kv, D])``: Quest scores ``[bs, pages]`` as
    ``q+ . max + q- . min`` summed over heads and dims."""
    g = _gen(9)
    for bs, pages, h, d in ((2, 5, 2, 4), (1, 1, 1, 1), (3, 7, 4, 3)):
        q = torch.randn(bs, h, d, generator=g)
        lo = torch.randn(pages, h, d, generator=g)
        hi = lo + torch.rand(pages, h, d, generator=g)
        ids = torch.arange(pages)[None].expand(bs, pages)
        want = quest_page_scores_reference(q.clamp(min=0), q.clamp(max=0), lo, hi, torch.ones(pages, dtype=torch.bool),
                                           ids)
        _close(fn(q, lo, hi), want, f"bs {bs}, {pages} pages, {h} KV heads, D={d}")
    _passed("sign_split_scores")


def check_score_from_pages(fn):
    """``fn(buf, block_row, s, q, w, page, d)``: the DSA index score of logical token ``s`` of a request whose
    logical page ``j`` is physical page ``block_row[j]`` of the paged FP8 key cache ``buf`` (uint8
    ``[num_pages, page * (d + 4)]``: per page its ``page`` FP8 keys, then their fp32 scales), for one query token
    ``q`` ``[H, d]`` with head weights ``w`` ``[H]``: ``scale[s] * sum_h w[h] * relu(q[h] . k[s])``."""
    g = _gen(11)
    cases = [(4, 16, 2, 5, 13), (64, 128, 4, 3, 130), (1, 8, 1, 6, 5), (16, 32, 3, 2, 0)]
    def draw(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    for _ in range(8):  # and random ones: page and head sizes, pages, the token
        page, d, heads, pages = draw([1, 2, 4, 16, 64]), draw([8, 16, 32, 128]), draw([1, 2, 3, 4]), draw([1, 3, 5])
        cases.append((page, d, heads, pages, int(torch.randint(0, page * pages, (1,), generator=g))))
    for page, d, heads, pages, s in cases:
        keys, scales = quantize_fp8(torch.randn(pages * page, d, generator=g) * 3, d)
        by_page = torch.cat([keys.view(torch.uint8).reshape(pages, page * d),
                             scales.reshape(pages, page).contiguous().view(torch.uint8)], dim=1)
        physical = torch.randperm(pages + 2, generator=g)[:pages]  # scattered pages, never in order
        buf = torch.zeros(pages + 2, page * (d + 4), dtype=torch.uint8)
        buf[physical] = by_page
        q, w = torch.randn(heads, d, generator=g), torch.rand(heads, generator=g)
        want = scales[s, 0] * (w * (q @ keys[s].float()).clamp(min=0)).sum()
        got = torch.as_tensor(fn(buf, physical.to(torch.int32), s, q, w, page, d)).float().reshape(())
        _close(got, want, f"page {page}, D={d}, {heads} heads, token {s} (physical pages {physical.tolist()})",
               rtol=1e-4, atol=1e-5)
    _passed("score_from_pages")


# ------------------------------------------------------------------ 07_end_to_end
def check_mass_kept(fn):
    """``fn(probs [bs, T], kept_pages (list of lists), page_size)``: the attention probability on the kept
    pages, per row ``[bs]`` (as ``sparse_ref.metrics``)."""
    g = _gen(11)
    for bs, t, P in ((2, 13, 4), (1, 1, 1), (3, 32, 8)):
        probs = torch.softmax(torch.randn(bs, t, generator=g), dim=1)
        n = -(-t // P)
        kept = [sorted(torch.randperm(n, generator=g)[: max(1, n // 2)].tolist()) for _ in range(bs)]
        width = max(len(k) for k in kept)
        selected = torch.tensor([k + [-1] * (width - len(k)) for k in kept])
        lengths = torch.tensor([len(k) for k in kept])
        want = attention_mass_kept(selected, lengths, page_attention_mass(probs[:, None, :], P))  # one head
        _close(torch.as_tensor(fn(probs, kept, P)).float(), want, f"bs {bs}, {t} tokens, P={P}, kept {kept}")
    _passed("mass_kept")


def check_graph_bucket(fn):
    """``fn(batch_size, buckets)``: the smallest captured batch size that holds ``batch_size`` requests (the
    rest is padding), or ``None`` when none does (run eagerly)."""
    buckets = [1, 2, 4, 8] + list(range(16, 65, 8))  # as in notebook 09: 1, 2, 4, 8, then steps of 8
    for bs, want in ((1, 1), (3, 4), (8, 8), (9, 16), (33, 40), (57, 64), (64, 64), (65, None), (0, 1)):
        got = fn(bs, buckets)
        assert got == want, f"batch {bs}, buckets {buckets}: got {got}, want {want}"
    for bs, unsorted, want in ((5, [8, 2, 4], 8), (3, [64, 8, 4, 2], 4), (2, [16, 4, 2, 1], 2), (1, [], None)):
        got = fn(bs, unsorted)
        assert got == want, f"batch {bs}, buckets in any order {unsorted}: got {got}, want {want} (the smallest " \
            "that holds the batch)"
    _passed("graph_bucket")


# ------------------------------------------------------------------ 09_decode_kernels
def check_merge_splits(fn):
    """``fn(outs [S, D], lses [S]) -> [D]``: the slices' outputs merged by their log-sum-exps (``-inf``: an empty
    slice); equals the softmax over the whole row, zeros when every slice is empty."""
    g = _gen(13)
    for length, cuts, scale in ((37, [0, 10, 10, 30, 37], 3.0), (1, [0, 1], 1.0), (64, [0, 5, 64], 400.0)):
        s, v = torch.randn(length, generator=g) * scale, torch.randn(length, 6, generator=g)
        outs, lses = [], []
        for a, b in zip(cuts, cuts[1:], strict=False):
            empty = a == b
            outs.append(torch.zeros(6) if empty else torch.softmax(s[a:b], 0) @ v[a:b])
            lses.append(torch.tensor(float("-inf")) if empty else torch.logsumexp(s[a:b], 0))
        got = torch.as_tensor(fn(torch.stack(outs), torch.stack(lses))).float()
        assert torch.isfinite(got).all(), f"length {length}, scale {scale}: not finite (overflow?)"
        _close(got, torch.softmax(s, 0) @ v, f"{length} tokens cut at {cuts}, scores x{scale}", rtol=1.3e-6, atol=1e-5)
    none = torch.as_tensor(fn(torch.zeros(3, 6), torch.full((3,), float("-inf")))).float()
    assert torch.equal(none, torch.zeros(6)), f"every slice empty: want zeros, got {none}"
    _passed("merge_splits")


def check_page_table_row(fn):
    """``fn(kept, seq_len, req_to_token_row, page_size) -> (pages, kv_len)``: one request's page-table row (the
    physical pages attention reads, in order) and its KV length; ``kept`` empty: the row is dense."""
    g = _gen(14)
    for i in range(200):
        P = int(torch.randint(1, 9, (1,), generator=g))
        seq_len = int(torch.randint(1, 90, (1,), generator=g)) if i % 5 else P * int(torch.randint(1, 9, (1,),
                                                                                                   generator=g))
        n = -(-seq_len // P)
        physical = torch.randperm(n + 8, generator=g)[: n + 3] + 1  # 3 more pages' worth of row past its end
        row = (physical[:, None] * P + torch.arange(P)).reshape(-1)  # (as a req_to_token row: longer, and, as in
        row = torch.where(torch.arange(row.numel()) < seq_len, row, 0).tolist()  # the pool, 0 past its tokens)
        dense = i % 4 == 0
        kept = [] if dense else sorted(set(torch.randint(0, n, (3,), generator=g).tolist()) | {n - 1})
        logical = kept or list(range(n))
        want = ([int(physical[j]) for j in logical],
                seq_len if dense else (len(kept) - 1) * P + seq_len - (n - 1) * P)
        got = fn(kept, seq_len, row, P)
        assert (list(got[0]), int(got[1])) == want, f"kept {kept}, seq_len {seq_len}, P {P}: got {got}, want {want}"
    _passed("page_table_row")


def check_page_table_kernel(fn):
    """``fn(selected, lengths, seq_lens, rows, req_to_token, page_size) -> (page_table, kv_lens)``: the Triton
    launcher of a page-table kernel, int32; equal to the package's ``page_table_from_selection`` (a sparse row
    lists its kept pages in order, a dense row (length 0) all its pages, zeros after; ``kv_len`` as
    ``to_attention_metadata``)."""
    from sparse_ref.kernels.page_table import page_table_from_selection

    g = _gen(16)
    device = sparse_ref.default_device()
    for case, (bs, pages, P) in enumerate(((5, 9, 4), (1, 1, 1), (7, 13, 16), (3, 40, 2))):
        seq_lens = torch.randint(1, pages * P + 1, (bs,), generator=g)
        seq_lens[0] = pages * P
        physical = 1 + torch.randperm(bs * pages + 3, generator=g)[: bs * pages].view(bs, pages)
        r2t = (physical[:, :, None] * P + torch.arange(P)).reshape(bs, pages * P).int()
        rows = torch.randperm(bs, generator=g).int()
        scores = torch.randn(bs, pages, generator=g)
        mask = torch.rand(bs, generator=g) > 0.3
        cfg = SparseConfig(page_budget=2, num_recent_pages=1, num_sink_pages=case % 2)
        selected, lengths = select_pages(scores, seq_lens, mask, P, cfg)
        args = [t.to(device) for t in (selected, lengths, seq_lens.int(), rows)] + [r2t.to(device)]
        want = page_table_from_selection(args[0], args[1], args[1] > 0, args[2], args[3], args[4], P)[:2]
        placed = [_between_sentinels(t, 1 << 20) for t in args]  # past an input: a page id far outside req_to_token
        got = fn(*(view for view, _ in placed), P)
        _check_sentinels({name: (buffer, 1 << 20) for name, (_, buffer) in zip(
            ("selected", "lengths", "seq_lens", "rows", "req_to_token"), placed, strict=True)}, f"case {case}")
        for name, a, b in (("page_table", got[0], want[0]), ("kv_lens", got[1], want[1])):
            a = torch.as_tensor(a).cpu()
            assert a.dtype == torch.int32 and a.shape == b.shape, f"case {case} (bs {bs}, {pages} pages, P {P}): " \
                f"{name} is {a.dtype} {tuple(a.shape)}, want int32 {tuple(b.shape)}"
            bad = (a != b.cpu()).nonzero()
            assert bad.numel() == 0, f"case {case} (bs {bs}, {pages} pages, P {P}): {name}{bad[0].tolist()} is " \
                f"{a[tuple(bad[0])].item()}, want {b.cpu()[tuple(bad[0])].item()} (lengths {lengths.tolist()}){OUTSIDE}"
    _passed("page_table_kernel")


# ------------------------------------------------------------------ 08_tensor_parallel
def check_rank_heads(fn):
    """``fn(rank, world, num_q_heads, num_kv_heads)``: ``(query_heads, kv_heads)`` slices of that rank."""
    from sparse_ref.tensor_parallel import RankWorkload
    from sparse_ref.workloads import PlantedEngineWorkload

    for hq, hkv, world in ((8, 2, 2), (32, 8, 4), (6, 3, 3), (4, 4, 1)):
        for r in range(world):
            want = RankWorkload(PlantedEngineWorkload(num_q_heads=hq, num_kv_heads=hkv), r, world)
            got = fn(r, world, hq, hkv)
            assert got == (want.q, want.kv), f"rank {r} of {world}, {hq}/{hkv} heads: got {got}, want {want.q, want.kv}"
    _passed("rank_heads")


def check_global_selection(fn):
    """``fn(shares, seq_lens, page_size, config)``: every rank's selection in ``quest_mode="global"`` from the
    ranks' Quest scores (a list of ``[bs, pages]``), all rows sparse: what one process selects on the sum."""
    g = _gen(12)
    config = SparseConfig(page_budget=3, num_recent_pages=1, num_sink_pages=1)
    for world, bs, pages in ((2, 3, 12), (4, 2, 9), (1, 1, 6)):
        shares = [torch.randn(bs, pages, generator=g) for _ in range(world)]
        seq_lens = torch.randint(pages * 3 + 1, pages * 4 + 1, (bs,), generator=g)  # long enough to go sparse
        mask = torch.ones(bs, dtype=torch.bool)
        want = select_pages(sum(shares), seq_lens, mask, 4, config)
        assert bool((want[1] > 0).all()), "every row sparse"
        got = fn(shares, seq_lens, 4, config)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{world} ranks, seq_lens " \
            f"{seq_lens.tolist()}: got {got[0].tolist()}, want the selection on the summed scores {want[0].tolist()}"
    _passed("global_selection")


def check_order_hash(fn):
    """``fn(ids int tensor) -> int``: equal for equal tensors; changes when an id changes or two ids swap."""
    g = _gen(7)
    for _ in range(50):
        ids = torch.randint(-1, 5000, (3, 16), generator=g, dtype=torch.int32)
        assert fn(ids) == fn(ids.clone()), "equal tensors must hash equal"
        swapped = ids.clone()
        swapped[0, 0], swapped[0, 1] = ids[0, 1], ids[0, 0]
        changed = ids.clone()
        changed[2, 5] += 1
        assert ids[0, 0] == ids[0, 1] or fn(swapped) != fn(ids), "a swap of ids [0, 0] and [0, 1] must change the hash"
        assert fn(changed) != fn(ids), "a changed id ([2, 5] + 1) must change the hash"
        i, j = torch.randint(0, ids.numel(), (2,), generator=g).tolist()
        far = ids.clone().view(-1)
        far[i], far[j] = ids.view(-1)[j], ids.view(-1)[i]
        assert ids.view(-1)[i] == ids.view(-1)[j] or fn(far.view(3, 16)) != fn(ids), f"a swap of flat ids {i}, {j} " \
            "must change the hash"
    ids = torch.randint(0, 5000, (3, 16), generator=g, dtype=torch.int32)
    for pos in range(8):  # two ids moved so that a linear hash with small weights (a sum, 1, 2, 3, ...) cancels out
        for a in (1, 2, 3):
            for b in (-1, -2, -3):
                moved = ids.clone().view(-1)
                moved[pos] += a
                moved[pos + 1] += b
                assert fn(moved.view(3, 16)) != fn(ids), f"ids [{pos}] + {a} and [{pos + 1}] {b} must change the " \
                    "hash (a linear hash with small weights cannot tell these apart)"
    _passed("order_hash")


# ------------------------------------------------------------------ 10_offload
def _lru_victims_spec(tokens, last_used, hits, m):
    free = [s for s in range(len(tokens)) if s not in hits]
    free.sort(key=lambda s: (tokens[s] >= 0, last_used[s] if tokens[s] >= 0 else 0, s))
    return sorted(free[:m])


def check_lru_victims(fn):
    """``fn(tokens, last_used, hits, m) -> list``: the ``m`` slots a row's misses take, in slot order: never a slot
    this step reads (``hits``, whose stamps are not updated yet: they may be the oldest), empty slots (token -1)
    first, then the least recently used, ties to the lower slot."""
    cases = [([-1, -1, -1], [0, 0, 0], [], 2), ([5, 7, 9, 11], [3, 1, 2, 1], [], 2),
             ([5, 7, -1, 11], [4, 1, 0, 4], [], 1), ([5, 7, 9], [2, 2, 2], [], 3), ([5, 7, 9], [3, 1, 3], [0, 2], 1),
             ([5, 7, 9, 11], [1, 4, 2, 3], [0], 2),  # the oldest slot is read this step: a plain LRU would take it
             ([5, -1, 9], [1, 0, 2], [0, 2], 1), ([4, 8], [1, 1], [0, 1], 0)]
    g = _gen(10)
    for _ in range(40):
        size = int(torch.randint(1, 9, (1,), generator=g))
        used = torch.randint(0, 6, (size,), generator=g).tolist()
        tokens = [int(t) if torch.rand(1, generator=g) > 0.2 else -1 for t in torch.randperm(50, generator=g)[:size]]
        used = [0 if t < 0 else u for t, u in zip(tokens, used, strict=True)]
        hits = [s for s in range(size) if tokens[s] >= 0 and torch.rand(1, generator=g) < 0.4]
        cases.append((tokens, used, hits, int(torch.randint(0, 1 + size - len(hits), (1,), generator=g))))
    for tokens, used, hits, m in cases:
        got, want = list(fn(list(tokens), list(used), list(hits), m)), _lru_victims_spec(tokens, used, hits, m)
        assert got == want, f"tokens {tokens}, last_used {used}, hits {hits}, m={m}: got {got}, want {want}"
    _passed("lru_victims")


def _break_even_spec(t_device, t_offload, device_max, offload_max):
    best = max(b / t_device(b) for b in range(1, device_max + 1))
    return next((b for b in range(1, offload_max + 1) if b / t_offload(b) > best), None)


def check_break_even_batch(fn):
    """``fn(t_device, t_offload, device_max, offload_max)``: the smallest batch (at most ``offload_max``) whose
    offload throughput ``b / t_offload(b)`` beats the best all-on-device throughput over batches 1..device_max;
    ``None`` if none does."""
    cases = [(lambda b: 100 + 5 * b, lambda b: 100 + 6 * b, 10, 200), (lambda b: 100 + 5 * b, lambda b: 100 + 9 * b,
                                                                       30, 400),
             (lambda b: 50 + b, lambda b: 50 + 1.5 * b, 8, 64), (lambda b: 10.0 * b, lambda b: 20.0 * b, 4, 100),
             (lambda b: 200 + 2 * b, lambda b: 900 + 2 * b, 16, 16),
             # offload first beats the device exactly at its own limit (a search that stops one short misses it)
             (lambda b: 10.0 * b, lambda b: 10.0 * b if b < 12 else 9.0 * b, 4, 12),
             # equal throughput at 5, better from 6: "beats" is strictly greater
             (lambda b: 10.0 * b, lambda b: 11.0 * b if b < 5 else 10.0 * b if b == 5 else 9.0 * b, 8, 20),
             # the device's best is at batch 4, not at its largest batch 8
             (lambda b: 10.0 * b if b <= 4 else 20.0 * b, lambda b: 15.0 * b if b < 9 else 9.0 * b, 8, 20),
             # offload beats the device at batch 2, below the device's own limit
             (lambda b: 10.0 * b, lambda b: 11.0 * b if b < 2 else 9.0 * b, 8, 20)]
    g = _gen(18)
    for _ in range(30):  # fresh linear step times: a fixed part (weights) plus a part per request
        a, c, a2, c2 = (float(x) for x in torch.randint(1, 60, (4,), generator=g))
        nd, no = (int(x) for x in torch.randint(1, 40, (2,), generator=g))
        cases.append((lambda b, a=a, c=c: a + c * b, lambda b, a2=a2, c2=c2: a2 + c2 * b, nd, nd + no))
    for t_dev, t_off, n_dev, n_off in cases:
        got, want = fn(t_dev, t_off, n_dev, n_off), _break_even_spec(t_dev, t_off, n_dev, n_off)
        assert got == want, f"device fits {n_dev}, offload {n_off}: got {got}, want {want} (t_device(1) = " \
            f"{t_dev(1)}, t_offload(1) = {t_off(1)})"
    _passed("break_even_batch")
