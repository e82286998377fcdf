"""The top-k's device helpers against their specs, and the top-k at realistic sizes on a GPU.

The helpers every kernel shares (``sparse_ref.kernels.topk.common`` and ``rows``), each driven through a small
test kernel: the select programs' copy of bitmask words into slots, window rounds, the direct plan's value
round, hit ranks and the ordered write of the keys above and at the threshold. Then the ``gpu`` cases: long
rows, adversarial rows, integer plateaus, CUDA-graph capture and the knob variants at realistic sizes. (A
file of its own beside ``test_topk.py``, so that parallel test runs spread the top-k's compiles over two
processes.)
"""

import pytest
import torch
import triton
import triton.language as tl
from test_topk import DEVICE, adversarial_rows, bitmask_columns, check, float_keys, make_scores, narrow_model

from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels.topk import topk
from sparse_ref.kernels.topk.common import (
    bin_shift,
    bits_to_slots,
    hit_ranks,
    keys_of,
    narrow_window,
    write_above_and_ties,
)
from sparse_ref.kernels.topk.rows import value_round
from sparse_ref.selection import topk_reference


@triton.jit
def _bits_to_slots_kernel(words, n_words, dst, col0, WB: tl.constexpr):
    tl.store(dst + 1000, bits_to_slots(words, n_words, dst, col0, WB))


@pytest.mark.parametrize("case", ["sparse", "dense", "edges", "empty", "one"])
@pytest.mark.parametrize("WB", [4, 16, 64])
def test_bits_to_slots(case, WB):
    """The select programs' copy of a span's candidates from the bitmask into the slots: every set bit's
    column (from ``col0``), ascending, nothing past them; several blocks of words (a last partial one);
    words with bit 31 (a negative int32), all 32 bits, none."""
    g = torch.Generator().manual_seed(len(case) + WB)
    n_words, col0 = 13, 4096
    bits = torch.zeros(n_words * 32, dtype=torch.bool)
    if case == "sparse":
        bits[torch.randperm(n_words * 32, generator=g)[:40]] = True
    elif case == "dense":
        bits[32:200] = True  # whole words
    elif case == "edges":
        bits[31::32] = True  # bit 31 and bit 0 of every word
        bits[0::32] = True
    elif case == "one":
        bits[n_words * 32 - 1] = True  # the last column only
    words = (bits.view(n_words, 32).long() << torch.arange(32)).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(bitmask_columns(words), torch.nonzero(bits).flatten())
    dst = torch.full((1001,), -7, dtype=torch.int32, device=DEVICE)
    _bits_to_slots_kernel[(1,)](words.to(DEVICE), n_words, dst, col0, WB=WB)
    want = torch.nonzero(bits).flatten() + col0
    assert int(dst[1000]) == len(want)  # the count it returns
    assert torch.equal(dst.cpu()[:len(want)].long(), want), case
    assert (dst.cpu()[len(want):1000] == -7).all()  # nothing stored past them


@triton.jit
def _narrow_kernel(keys, n, k, limit, out, EXCESS: tl.constexpr, N_PAD: tl.constexpr):
    i = tl.arange(0, N_PAD)
    key = tl.load(keys + i, mask=i < n, other=-2147483648)
    member = i < n
    lo = tl.min(tl.where(member, key, 2147483647), axis=0)
    hi = tl.max(tl.where(member, key, -2147483648), axis=0)
    t, member, m, k_rem = narrow_window(key, member, n, k, lo, hi, limit, EXCESS, 4)
    tl.store(out, t)
    tl.store(out + 1, m)
    tl.store(out + 2, k_rem)
    tl.store(out + 3, bin_shift(lo, hi))


@pytest.mark.parametrize("case", ["randn", "packed", "ties", "one value", "both signs", "extremes", "int extremes"])
def test_window_rounds(case):
    """``narrow_window`` against ``narrow_model`` key for key (its threshold mode: stop when at most k/8 extra keys
    share the bin), and run to the exact k-th key (limit -1); ``bin_shift``'s 256 bins cover [min, max]."""
    g = torch.Generator().manual_seed(len(case))
    n = 300
    x = {"randn": torch.randn(n, generator=g), "packed": 5700 * (1 + 0.02 * torch.rand(n, generator=g)),
         "ties": torch.randint(0, 5, (n,), generator=g).float(), "one value": torch.full((n,), 0.3),
         "both signs": torch.randn(n, generator=g) * 1e3,
         "extremes": torch.cat([torch.tensor([3.0e38, -3.0e38, 0.0, -0.0]), torch.randn(n - 4, generator=g)]),
         "int extremes": torch.zeros(n)}[case]
    keys = float_keys(x)
    if case == "int extremes":  # keys spanning all of int32, and a crowd of three neighbouring keys
        keys = torch.randint(-(2**31) + 1, 2**31 - 1, (n,), generator=g, dtype=torch.int32)
        keys[:2] = torch.tensor([-(2**31) + 1, 2**31 - 1])
        keys[2:200] = 12345 + torch.randint(0, 3, (198,), generator=g, dtype=torch.int32)
    lo, hi = int(keys.min()), int(keys.max())
    for k in (1, 17, 100, n):
        out = torch.zeros(4, dtype=torch.int32, device=DEVICE)
        _narrow_kernel[(1,)](keys.to(DEVICE), n, k, k // 8, out, EXCESS=True, N_PAD=512)
        t, m, k_rem, shift = out.tolist()
        assert (hi - lo) >> shift <= 255 and (shift == 0 or (hi - lo) >> (shift - 1) > 255)  # covers; the smallest
        assert t == narrow_model(keys.tolist(), k, k // 8), (case, k)
        assert int((keys >= t).sum()) >= k and 1 <= k_rem <= m  # a valid threshold; the k-th is in the bin
        _narrow_kernel[(1,)](keys.to(DEVICE), n, k, -1, out, EXCESS=True, N_PAD=512)
        kth = int(keys.sort(descending=True).values[k - 1])
        assert out[0] == kth and int((keys == kth).sum()) == out[1]  # run to the end: the k-th key and its ties
        _narrow_kernel[(1,)](keys.to(DEVICE), n, k, 8, out, EXCESS=False, N_PAD=512)
        t, m, k_rem = out[:3].tolist()  # (the select programs' mode: until at most 8 keys share the bin)
        assert m <= 8 or (t == kth and m == int((keys == kth).sum())), (case, k)
        assert int((keys >= t).sum()) >= k >= int((keys >= t).sum()) - m + k_rem  # the k-th is in the bin


@triton.jit
def _value_round_kernel(x, n, k, out, members, N_PAD: tl.constexpr, BINS: tl.constexpr):
    i = tl.arange(0, N_PAD)
    v = tl.load(x + i, mask=i < n, other=0.0)
    ok = keys_of(v, i < n) != -2147483648
    member, m, k_rem = value_round(v, ok, tl.sum(ok.to(tl.int32), axis=0), k, BINS)
    tl.store(out, m)
    tl.store(out + 1, k_rem)
    tl.store(members + i, member.to(tl.int32))


@pytest.mark.parametrize("case", ["randn", "packed", "signs and extremes", "subnormals", "with nan",
                                  "plus inf", "one value", "tiny span", "nothing valid"])
@pytest.mark.parametrize("bins", [256, 32])
def test_value_round(case, bins):
    """``value_round`` (the direct plan's first round, on the float values): where it bins, its bin is a run
    of the sorted valid scores that holds the k-th largest (k_rem of it taken), and a random row keeps
    about 256 / bins % of its scores; where it must not bin (+inf, all equal, a span below 2**-100, no valid score)
    it keeps every valid score and k."""
    g = torch.Generator().manual_seed(len(case))
    n = 1000
    x = {"randn": torch.randn(n, generator=g), "packed": 5700 * (1 + 0.02 * torch.rand(n, generator=g)),
         "signs and extremes": torch.cat([torch.tensor([3.4e38, -3.4e38, 0.0, -0.0]), torch.randn(n - 4, generator=g)]),
         "subnormals": torch.randn(n, generator=g) * 1e-39,
         "with nan": torch.where(torch.rand(n, generator=g) < 0.3, float("nan"), torch.randn(n, generator=g)),
         "plus inf": torch.cat([torch.randn(n - 1, generator=g), torch.tensor([float("inf")])]),
         "one value": torch.full((n,), -2.5), "tiny span": 1.0e-37 + 1e-44 * torch.randint(0, 5, (n,), generator=g),
         "nothing valid": torch.full((n,), float("-inf"))}[case]
    valid = ~(torch.isnan(x) | (x == float("-inf")))
    skipped = case in ("plus inf", "one value", "tiny span", "nothing valid")
    for k in (1, 17, 250, 999):
        k = max(1, min(k, int(valid.sum())))  # (as select_direct calls it)
        out = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        members = torch.zeros(1024, dtype=torch.int32, device=DEVICE)
        _value_round_kernel[(1,)](x.to(DEVICE), n, k, out, members, N_PAD=1024, BINS=bins)
        m, k_rem = out.tolist()
        member = members.cpu()[:n].bool()
        assert int(member.sum()) == m and not (member & ~valid).any()
        if skipped:
            assert torch.equal(member, valid) and k_rem == k, (case, k)
            continue
        v = x[valid].sort(descending=True).values
        inside = x[member]
        above = int((x[valid] > inside.max()).sum())  # the valid scores above the bin
        assert bool(((x[valid] >= inside.min()) & (x[valid] <= inside.max()) == member[valid]).all())  # one run
        assert inside.min() <= v[k - 1] <= inside.max() and above + k_rem == k and 1 <= k_rem <= m, (case, k)
        if case == "randn":
            assert m <= 40 * 256 // bins, m  # 256 bins: ~1% of 1000 near the top, at most ~40 in the middle


@triton.jit
def _hit_ranks_kernel(hits, out, WORDS: tl.constexpr):
    i = tl.arange(0, WORDS * 32)
    tl.store(out + i, hit_ranks(tl.load(hits + i) != 0, WORDS))


@pytest.mark.parametrize("density", [0.0, 0.04, 0.5, 1.0])
def test_hit_ranks(density):
    """``hit_ranks`` (the runs mode's places of a chunk's candidates, from bitmask words) equals the
    prefix sum it replaces, at every element: empty, sparse, half-full and full masks (bit 31 of each
    word set: the sign bit of an int32 word)."""
    g = torch.Generator().manual_seed(int(density * 100))
    for words in (1, 8):
        hits = (torch.rand(words * 32, generator=g) < density).to(torch.int32)
        out = torch.empty(words * 32, dtype=torch.int32, device=DEVICE)
        _hit_ranks_kernel[(1,)](hits.to(DEVICE), out, WORDS=words)
        assert torch.equal(out.cpu(), torch.cumsum(hits, 0) - hits), (density, words)


@triton.jit
def _write_above_and_ties_kernel(keys, out, taken, t, need, ties_before, pos0, W, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(taken, write_above_and_ties(tl.load(keys + i), i + 1000, t, need, ties_before, out, pos0, W))


@pytest.mark.parametrize("case", ["plateau", "few values", "no ties", "all ties"])
def test_write_above_and_ties_spec(case):
    """``write_above_and_ties`` (every tie-path tile and the register rows store through it) against its spec in
    plain Python: the ids of the keys > t and of the ties whose rank in the row (``ties_before`` earlier ones
    counted) is at most ``need``, in order from ``pos0``, nothing past ``W``; the rest of the output untouched.
    Room left for none, some, exactly all and more than all ties."""
    g = torch.Generator().manual_seed(len(case))
    n, t = 256, 5
    keys = {"plateau": torch.where(torch.rand(n, generator=g) < 0.7, t, t + 1 + torch.randint(0, 3, (n,), generator=g)),
            "few values": torch.randint(t - 2, t + 3, (n,), generator=g), "no ties": torch.randint(6, 9, (n,),
            generator=g), "all ties": torch.full((n,), t)}[case].to(torch.int32)
    n_ties = int((keys == t).sum())
    for ties_before, need, pos0, W in [(0, 0, 0, 512), (0, 7, 3, 512), (4, 4, 0, 512), (3, n_ties + 3, 1, 512),
                                       (2, n_ties + 50, 0, 512), (0, n_ties, 0, 40)]:
        out = torch.full((512,), -7, dtype=torch.int32, device=DEVICE)
        taken = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        _write_above_and_ties_kernel[(1,)](keys.to(DEVICE), out, taken, t, need, ties_before, pos0, W, BLOCK=n)
        want, seen = [], ties_before
        for i, key in enumerate(keys.tolist()):
            seen += key == t
            if key > t or (key == t and seen <= need):
                want.append(i + 1000)
        expect = torch.full((512,), -7, dtype=torch.int32)
        stored = want[:max(0, W - pos0)]
        expect[pos0:pos0 + len(stored)] = torch.tensor(stored, dtype=torch.int32)
        assert torch.equal(out.cpu(), expect), (case, ties_before, need, pos0, W)
        assert int(taken) == len(want), (case, ties_before, need)


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, CUDA graphs
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("R, N, k", [(4, 131072, 2048), (1, 131072, 2048), (5, 10_000, 4096), (3, 20_000, 100),
                                     (2, 1 << 20, 4096), (64, 65536, 2048), (7, 6000, 2047),
                                     (64, 32832, 2048), (128, 40_000, 2048), (64, 4096, 2048), (16, 8192, 64)])
# (few compile variants; 64 x 32832: the DSA indexer's rows; 128 rows: two delegates programs of 2048 columns per row)
def test_gpu_large_rows(R, N, k):
    x = make_scores(R, N, seed=8, device="cuda")
    x[0, ::7] = 0.25  # a big block of ties
    lengths = torch.randint(N // 2, N + 1, (R,), device="cuda")
    check(x, k, lengths)
    check(x, k, lengths, order="index")


@pytest.mark.gpu
@pytest.mark.parametrize("N, k", [(65536, 2048), (131072, 2048), (8192, 128), (20_000, 1000)])
def test_gpu_adversarial_rows(N, k):
    G = max(256, 1 << (2 * k - 1).bit_length())
    x = adversarial_rows(N, min(G, N)).cuda()
    check(x, k, order="index")
    check(x, k, order="score")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [2048, 8192])
def test_gpu_integer_plateaus_take_the_tie_path(monkeypatch, tile):
    """Rows of whole numbers 0..63 (each value a run of ~2K ties) at 8 x 128K: most rows overflow their slots
    and take the tie path or a second selection. With tie tiles of 8192 keys each select program's span is a
    single tile: there a one-sum variant of ``write_above_and_ties`` stored wrong ids on the H200 (triton 3.6)
    while the interpreter was right; the kept version must be exact in both tilings, on four seeds."""
    from sparse_ref.workloads import make_distribution

    monkeypatch.setitem(topk_module.TUNING, "tie_tile", tile)
    paths = torch.zeros(4, dtype=torch.int64)
    for seed in range(4):
        x = make_distribution("integers", 8, 131072, "cuda", seed=seed)
        got = torch.empty(8, 2048, dtype=torch.int32, device="cuda")
        stats = topk_module.launch_topk(x, 2048, None, None, got)
        assert torch.equal(got, topk_reference(x, 2048, order="index")), seed
        paths += torch.bincount(stats.flags.long().cpu(), minlength=4)
    assert paths[2] > 0 and paths[3] > 0, paths  # (the tie path and the second selection both ran)


@pytest.mark.gpu
def test_gpu_matches_torch_topk_sets():
    x = torch.randn(16, 65536, device="cuda")
    got = topk(x, 2048)
    ref = torch.topk(x, 2048, dim=1).indices.int()
    assert torch.equal(got, ref)  # distinct random values: torch.topk's sorted order is the same


@pytest.mark.gpu
@pytest.mark.parametrize("N", [5000, 40_000])
def test_gpu_cuda_graph_capture_and_replay(N):
    x = make_scores(8, N, seed=9, ties=True, device="cuda")
    lengths = torch.randint(0, N + 1, (8,), device="cuda")
    out = torch.empty(8, 512, dtype=torch.int32, device="cuda")
    topk(x, 512, lengths, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk(x, 512, lengths, out=out)
    for seed in (10, 11, 12):
        x.copy_(make_scores(8, N, seed=seed, ties=seed == 12, device="cuda"))
        if seed == 11:
            x[2] = torch.arange(N, device="cuda").float()  # a fallback row inside the graph
        lengths.copy_(torch.randint(0, N + 1, (8,)))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), topk_reference(x.cpu(), 512, lengths.cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [dict(sort_run=512), dict(sort_run=256, sort_run_warps=2), dict(sort_run=0),
                                   dict(chunk=8192, candidate_warps=16, tie_tile=16384, select_programs=64)])
def test_gpu_knob_variants(monkeypatch, knobs):
    """Knob variants compiled at realistic sizes (adversarial rows take the tie path and the radix select):
    the two-step sort of order="score" or one sort per row, and larger chunks and tie spans with heavier programs."""
    for name, value in knobs.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    for N, k in ((65536, 2048), (131072, 2048), (20_000, 1000)):
        G = max(256, 1 << (2 * k - 1).bit_length())
        x = torch.cat([adversarial_rows(N, min(G, N)).cuda(), make_scores(3, N, seed=13, device="cuda"),
                       make_scores(2, N, seed=14, ties=True, device="cuda")])
        lengths = torch.full((x.shape[0],), N, device="cuda")
        lengths[-1], lengths[-3] = N // 3, k // 2
        check(x, k, lengths, order="index")
        check(x, k, lengths, order="score")
