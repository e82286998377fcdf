"""The Triton top-k (kernels/topk.py) against ``topk_reference`` on awkward and adversarial inputs.

The paths are tested separately, forced at interpreter sizes through ``TUNING``:
``register`` (one program per row, row in registers, selected directly: window rounds and a pairwise rank),
``register_rounds`` (the same without the pairwise rank: window rounds down to one key value),
``register_delegates`` and ``register_fallback`` (the delegates plan in registers; with 2 slots every row
overflows into its tie path or whole-row radix), ``long``
(delegates -> candidates copied to runs of the row's slots -> the program of span 0 selects among them),
``bitmask`` (the same with the candidates marked in a bitmask that the select programs copy into the
slots, for the row's last one to select),
``fallback`` and ``bitmask_fallback`` (the slot tensor shrunk so that every row overflows and the
device-side fallback runs: the tie path or the exact radix select over the whole row). The device helpers'
specs and the ``gpu`` cases at realistic sizes are in ``test_topk_parts.py``.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_ref  # (interpreter set-up before the kernel import)
from sparse_ref import checks
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import topk as topk_module
from sparse_ref.kernels.topk import topk
from sparse_ref.selection import topk_reference

DEVICE = sparse_ref.default_device()  # CUDA on a GPU machine, else CPU through the interpreter
SPECIALS = [float("nan"), float("-inf"), float("inf"), -0.0, 0.0]
PATHS = {
    "register": {},
    "long": {"register_row": 0, "chunk": 64, "delegate_cols": 64, "min_delegates": 128},
    "fallback": {"register_row": 0, "chunk": 64, "delegate_cols": 64, "min_delegates": 128, "slots": 2},
    "register_rounds": {"short_pair": 0},
    "register_key_rounds": {"value_bins": 0},
    "register_delegates": {"direct_ratio": 0},
    "register_fallback": {"direct_ratio": 0, "slots": 2},
    "bitmask": {"register_row": 0, "chunk": 64, "delegate_cols": 64, "min_delegates": 128, "bitmask_programs": 0},
    "bitmask_fallback": {"register_row": 0, "chunk": 64, "delegate_cols": 64, "min_delegates": 128, "slots": 2,
                         "bitmask_programs": 0},
}


@pytest.fixture(params=[name if not knobs else pytest.param(name, marks=pytest.mark.knobs)
                        for name, knobs in PATHS.items()])
def path(request, monkeypatch):
    """Run the test once per path (knobs restored afterwards)."""
    for name, value in PATHS[request.param].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    return request.param


def make_scores(R, N, *, seed, ties=False, specials=False, dtype=torch.float32, device=DEVICE):
    """Random scores; with ``ties`` few distinct values, with ``specials`` NaN / +-inf / -0.0 sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (R, N), generator=g).float() / 2 if ties else torch.randn(R, N, generator=g)
    if specials and R * N:
        pick = torch.randint(0, len(SPECIALS), (R, N), generator=g)
        x = torch.where(torch.rand(R, N, generator=g) < 0.25, torch.tensor(SPECIALS)[pick], x)
    return x.to(dtype).to(device)


def check(scores, k, lengths=None, order="score", **kw):
    got = topk(scores, k, lengths, order=order, **kw)
    ref = topk_reference(scores.cpu(), k if isinstance(k, int) else k.cpu(),
                         None if lengths is None else lengths.cpu(), order="index" if order == "none" else order,
                         width=kw.get("width"))
    got = got.cpu()
    assert got.dtype == torch.int32 and got.shape == ref.shape
    for r in range(got.shape[0]):  # ids as sets first (a clearer failure), then the exact order
        assert set(got[r][got[r] >= 0].tolist()) == set(ref[r][ref[r] >= 0].tolist()), f"row {r}"
    assert torch.equal(got, ref)
    return got


def adversarial_rows(N, G, seed=0):
    """Rows that defeat a delegate threshold (or its tie handling), plus all-invalid rows."""
    g = torch.Generator().manual_seed(seed)
    period = torch.randn(G, generator=g)
    rows = [torch.arange(N).float(),  # ascending: every top element sits in the last columns
            -torch.arange(N).float(),  # descending
            period.repeat(N // G + 1)[:N],  # periodic with the delegate period: every column ties
            torch.where(torch.arange(N) % 3 == 0, 0.5, torch.randn(N, generator=g).clamp(max=0.4)),  # plateau
            torch.full((N,), 2.0),  # all equal
            torch.where(torch.arange(N) % 2 == 0, float("nan"), float("-inf")),  # nothing selectable
            torch.full((N,), float("-inf"))]
    return torch.stack(rows).to(DEVICE)


def test_awkward_rows_both_orders(path):
    """Ties, specials, lengths 0/1/full and k beyond the row, in one batch (N not a power of two)."""
    x = make_scores(6, 300, seed=1, specials=True)
    x[1] = 1.5  # an all-equal row: ties to the lower id
    x[2, :10] = torch.tensor([-0.0, 0.0, -0.0, 0.0, float("nan"), float("-inf"), float("inf"), 0.0, -0.0, 1.0])
    lengths = torch.tensor([300, 230, 10, 1, 0, 25], device=DEVICE)
    for order in ("score", "index"):
        check(x, 9, lengths, order=order)
    with pytest.raises(SparseRefError, match="order"):  # one spelling per behaviour: "none" was "index"
        topk(x, 9, lengths, order="none")
    check(x, 40, lengths, order="index")  # k larger than some rows: fewer ids, -1 padded


def test_adversarial_rows(path):
    """Ascending, descending, periodic with the delegate period, plateaus, all equal, nothing valid."""
    x = adversarial_rows(517, 128)
    for order in ("index", "score"):
        check(x, 6, order=order)
    check(x, 6, torch.tensor([517, 3, 300, 517, 100, 517, 0], device=DEVICE), order="index")


def test_zero_signs_tie_at_the_threshold(path):
    """The k-th value is 0 and several -0.0 / +0.0 tie there: the lowest ids win, whatever their sign."""
    x = torch.full((2, 200), -1.0)
    x[:, 7], x[:, 50], x[:, 120] = 3.0, 2.0, 1.0
    zeros = torch.tensor([5, 9, 33, 60, 61, 150, 199])
    x[0, zeros] = torch.tensor([-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0])
    x[1, zeros] = torch.tensor([0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0])
    got = check(x.to(DEVICE), 5, order="index")
    assert got[:, :].tolist() == [[5, 7, 9, 50, 120]] * 2


@pytest.mark.knobs
def test_long_path_flags(monkeypatch):
    """The long-row path keeps random rows off the fallback, flags rows that overflow the slots."""
    for name, value in PATHS["long"].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    x = make_scores(3, 1000, seed=2)
    out = torch.empty(3, 5, dtype=torch.int32, device=DEVICE)
    flags = topk_module.launch_topk(x, 5, None, None, out).flags
    assert flags.tolist() == [0, 0, 0]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 5, order="index"))
    x = adversarial_rows(1000, 128)[:5]
    flags = topk_module.launch_topk(x, 5, None, None, out.new_empty(5, 5)).flags
    # ascending, descending and periodic rows fit the 128 slots here; the plateau and the all-equal row
    # do not, and take the tie path (flag 2: fewer than k keys above T)
    assert flags.tolist() == [0, 0, 0, 2, 2]
    monkeypatch.setitem(topk_module.TUNING, "slots", 2)
    out = out.new_empty(5, 5)
    # with 2 slots all overflow. The periodic row has many keys above its k-th delegate: the whole-row radix
    # (flag 1); the plateaus take the tie path. With the row-wide threshold (its window rounds run until the
    # bin holds no delegate beyond the 5th: slack 5 // 8 = 0) T is the exact 5th delegate of the ascending
    # and the descending row, fewer than 5 keys are above it: the tie path. With 2 delegates programs per row
    # T is the threshold of the program holding the smaller delegates (``local_threshold``), far below: flag 1
    flags = [2, 2, 1, 2, 2]
    assert topk_module.launch_topk(x, 5, None, None, out).flags.tolist() == [1, 1, 1, 2, 2]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 5, order="index"))
    monkeypatch.setitem(topk_module.TUNING, "local_threshold", 0)
    assert topk_module.launch_topk(x, 5, None, None, out).flags.tolist() == flags
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 5, order="index"))


@pytest.mark.knobs
@pytest.mark.parametrize("bitmask", [10**9, 0])  # bitmask_programs: the runs mode, the bitmask mode
@pytest.mark.parametrize("above", [0, 1, 17, 36])
def test_tie_path_takes_exactly_the_lowest_ties_it_needs(monkeypatch, above, bitmask):
    """``above`` keys over a plateau of ties spread across every chunk: the tie path must take exactly
    k - above ties, the lowest ids first, counting the ties of earlier chunks (its prefix count)."""
    for name, value in {**PATHS["long"], "bitmask_programs": bitmask}.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    monkeypatch.setitem(topk_module.TUNING, "slots", 16)
    g = torch.Generator().manual_seed(above)
    rows = []
    for period in (2, 3, 11):
        row = torch.rand(1000, generator=g) - 2.0  # below the plateau
        row[torch.arange(1000) % period == 1] = 0.5  # the plateau: ties in every chunk
        row[torch.randperm(1000, generator=g)[:above]] = 1.0 + torch.rand(above, generator=g)  # (over some ties)
        rows.append(row)
    x = torch.stack(rows).to(DEVICE)
    out = torch.empty(3, 37, dtype=torch.int32, device=DEVICE)
    flags = topk_module.launch_topk(x, 37, None, None, out).flags
    want = topk_reference(x.cpu(), 37, order="index")
    assert torch.equal(out.cpu(), want)
    assert flags.tolist() == [2, 2, 2]
    ties = (x.cpu().gather(1, want.long()) == 0.5).sum(1)
    assert ties.tolist() == [37 - above] * 3


@pytest.mark.knobs
@pytest.mark.parametrize("above", [0, 45, 99])
def test_whole_row_radix_counts_ties_across_its_tiles(monkeypatch, above):
    """k too wide for delegates: the whole-row radix, tile by tile. Its k-th key is a plateau with ties in
    every tile; it must keep exactly k - above of them, the lowest ids, counting earlier tiles' ties."""
    monkeypatch.setitem(topk_module.TUNING, "register_row", 0)
    monkeypatch.setitem(topk_module.TUNING, "max_delegates", 128)  # k = 100 > 128 / 2: no delegates
    monkeypatch.setitem(topk_module.TUNING, "min_delegates", 128)
    monkeypatch.setitem(topk_module.TUNING, "block", 64)
    g = torch.Generator().manual_seed(above)
    x = torch.rand(2, 700, generator=g) - 2.0
    x[:, torch.arange(700) % 3 == 0] = 0.5  # 234 ties, in every tile of 64
    for r in range(2):
        x[r, torch.randperm(700, generator=g)[:above]] = 1.0 + torch.rand(above, generator=g)
    want = topk_reference(x, 100, order="index")
    got = topk(x.to(DEVICE), 100, order="index").cpu()
    assert torch.equal(got, want)
    assert ((x.gather(1, want.long()) == 0.5).sum(1) == 100 - above).all()


@pytest.mark.knobs
def test_plateau_below_16_bits_takes_the_tie_path(monkeypatch):
    """A plateau at 0.3 (its key has low bits below a 16-bit cut): every delegate is 0.3, so a cut T would sit
    below the plateau and every plateau key would be > T (the slow whole-row radix). The delegates' last
    program's window rounds stop on the one value the kept delegates hold: T is the exact k-th delegate, the
    plateau keys EQUAL T and the row takes the tie path."""
    for name, value in PATHS["long"].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    g = torch.Generator().manual_seed(4)
    j = torch.arange(1000)
    x = torch.stack([torch.where(j % 3 == 0, 0.3, torch.randn(1000, generator=g).clamp(max=0.2)),
                     torch.where(j % 7 == 1, -1.1, torch.randn(1000, generator=g).clamp(max=-1.2))]).to(DEVICE)
    out = torch.empty(2, 5, dtype=torch.int32, device=DEVICE)
    assert topk_module.launch_topk(x, 5, None, None, out).flags.tolist() == [2, 2]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 5, order="index"))


@pytest.mark.knobs
def test_long_rows_packed_in_a_narrow_range(monkeypatch):
    """Scores within 0.1% of each other share their top 16 bits: a T cut to 16 bits would let every key through
    (a fallback). The delegates' last program bins the delegates of the k-th one's top-8-bit bin over their own
    range, round after round, until at most k/8 delegates beyond the k-th reach the edge: the candidates fit
    the slots (flag 0)."""
    for name, value in PATHS["long"].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    g = torch.Generator().manual_seed(11)
    x = (1.0 + 1e-3 * torch.rand(3, 1000, generator=g)).to(DEVICE)
    out = torch.empty(3, 100, dtype=torch.int32, device=DEVICE)
    stats = topk_module.launch_topk(x, 100, None, None, out)
    flags = stats.flags
    assert flags.tolist() == [0, 0, 0]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 100, order="index"))
    for order in ("index", "score"):
        assert torch.equal(topk(x, 100, order=order).cpu(), topk_reference(x.cpu(), 100, order=order))


@pytest.mark.knobs
def test_local_threshold(monkeypatch):
    """With at most ``local_threshold`` delegates programs per row, each program finds its own threshold
    T_c and T is the highest T_c that k delegates reach: never above the row-wide threshold, so the
    answers stay exact. On a cluster of equal values that one program sits on, T is the cluster's value
    (its ties at T: the tie path), as the row-wide threshold; on a sorted row, not the lowest T_c."""
    for name, value in {**PATHS["long"], "delegate_cols": 32}.items():  # G = 128 delegates, 4 programs (k = 5)
        monkeypatch.setitem(topk_module.TUNING, name, value)
    x = make_scores(8, 1000, seed=21, device="cpu")  # rows 4-7: random (built on the CPU, then moved)
    x[0] = x[0] / 10
    x[0, torch.tensor([1, 2, 3, 4, 33, 34])] = torch.tensor([10.0, 9, 8, 7, 6, 5.5])  # program 0's delegates
    # 1-4, program 1's 5-6: T_c at most 9.0 and 5.5 (the edges of their bins); T at most 5.5, below the 5th (6.0)
    program_0_1 = (torch.arange(0, 1000, 128)[:, None] + torch.arange(0, 64)[None, :]).flatten()
    x[1, program_0_1[:200]] = 5.0  # a cluster above the rest, more keys than the 128 slots, in the delegate
    x[2] = torch.arange(1000).float()  # columns of programs 0 and 1 only. Row 2: sorted
    x[3, program_0_1[:200]] = 5.0
    x[3, 129] = 6.0  # (one key above the cluster)
    x = x.to(DEVICE)
    thresholds, flags = {}, {}
    for local in (4, 0):
        monkeypatch.setitem(topk_module.TUNING, "local_threshold", local)
        out = torch.empty(8, 5, dtype=torch.int32, device=DEVICE)
        stats = topk_module.launch_topk(x, 5, None, None, out)
        assert torch.equal(out.cpu(), topk_reference(x.cpu(), 5, order="index"))
        thresholds[local], flags[local] = stats.threshold.tolist(), stats.flags.tolist()
        assert not topk_module._SYNC[str(x.device)].any()  # the last programs reset the counters and TMAX

    def key(v):
        return int(float_keys(torch.tensor([v]))[0])

    for r in (0, 2):  # each program's T_c is the edge of its bin, not the key itself
        assert thresholds[4][r] == local_threshold_model(x[r].cpu(), 5, 128, 4)
    assert thresholds[4][0] <= key(5.5) and thresholds[0][0] == key(6.0)
    assert thresholds[4][1] == thresholds[0][1] == thresholds[4][3] == thresholds[0][3] == key(5.0)  # the clusters
    # the sorted row: T_c near 926.0, 958.0, 990.0, 998.0 (programs 0-3); 2 delegates reach 998.0, 10 reach 990.0:
    # T near 990.0 (not the lowest, 926.0); the row-wide T is the 5th delegate, 995.0
    assert key(980.0) < thresholds[4][2] <= key(990.0) and thresholds[0][2] == key(995.0)
    assert all(a <= b for a, b in zip(thresholds[4][4:], thresholds[0][4:], strict=True))  # random rows
    # the clusters take the tie path either way (below them, more keys than slots would be above T)
    assert flags[4] == flags[0] == [0, 2, 0, 2, 0, 0, 0, 0]
    check(x, 5, order="score")


def float_keys(x: torch.Tensor) -> torch.Tensor:
    """The kernels' int32 keys in torch: signed order == float order, -0.0 == +0.0, NaN and -inf -> NONE."""
    bits = torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32)
    return torch.where(torch.isnan(x) | (x == float("-inf")), -(2**31), bits ^ ((bits >> 31) & 0x7FFFFFFF))


def narrow_model(keys: list[int], k: int, slack: int) -> int:
    """``narrow_window`` in plain Python, on int32 ``keys`` over their own range [min, max]: 256 bins of width
    2**shift from the window's low end (shift: the span's bit length minus 8); keep the bin holding
    the k-th largest; the next window is the kept keys' own range. At most 4 rounds, while the bin holds
    more than ``slack`` keys beyond the ones the k-th takes and more than one value. Returns the lower edge
    of the last bin (or the kept keys' min, when they are one value)."""
    lo, hi = min(keys), max(keys)
    member = keys
    for r in range(4):
        if len(member) - k <= slack:
            break
        if r > 0:
            lo, hi = min(member), max(member)
        if lo == hi:
            break
        shift = max((hi - lo).bit_length() - 8, 0)  # the smallest whose 256 bins cover [lo, hi]
        bins = [min((v - lo) >> shift, 255) for v in member]
        d = max(b for b in range(256) if sum(x >= b for x in bins) >= k)  # the bin of the k-th largest
        k -= sum(x > d for x in bins)
        member = [v for v, x in zip(member, bins, strict=True) if x == d]
        lo += d << shift
    return lo


def local_threshold_model(row: torch.Tensor, k: int, G: int, S: int) -> int:
    """The T of ``_local_threshold`` in torch, on int32 keys: each of S programs takes the lower edge of the
    bin holding the ceil(k/S)-th largest of its G/S delegate columns (``narrow_model``, slack ceil(k/S) / 8;
    NONE with fewer delegates than ceil(k/S)), then the highest one k delegates reach."""
    none = -(2**31)
    key = torch.cat([float_keys(row), torch.full((-len(row) % G,), none, dtype=torch.int32)])
    delegates = key.view(-1, G).amax(0).long()
    k_c = -(-k // S)
    thresholds = []
    for own in delegates.view(S, G // S):
        valid = own[own != none].tolist()
        thresholds.append(none if len(valid) < k_c else narrow_model(valid, k_c, k_c // 8))
    return max(t for t in thresholds if int((delegates >= t).sum()) >= k)


@pytest.mark.knobs
def test_local_threshold_matches_its_model(monkeypatch):
    """The kernel's T under local thresholds, key for key, against ``local_threshold_model``: random rows
    of awkward lengths (one too short for a program's share), rows of few distinct values, a sorted row,
    -inf and NaN mixed in."""
    for name, value in {**PATHS["long"], "delegate_cols": 32}.items():  # G = 128, 4 delegates programs
        monkeypatch.setitem(topk_module.TUNING, name, value)
    x = torch.cat([make_scores(4, 997, seed=31, device="cpu"), make_scores(3, 997, seed=32, ties=True, device="cpu"),
                   make_scores(2, 997, seed=33, specials=True, device="cpu")])
    x[6] = torch.arange(997).float()
    lengths = torch.tensor([997, 500, 997, 100, 997, 640, 997, 997, 300])  # (100: program 3 has 4 delegates)
    for k in (20, 33, 64):
        out = torch.empty(9, k, dtype=torch.int32, device=DEVICE)
        stats = topk_module.launch_topk(x.to(DEVICE), k, None, lengths.to(DEVICE), out)
        assert torch.equal(out.cpu(), topk_reference(x, k, lengths, order="index"))
        want = [local_threshold_model(r[:n], k, 128, 4) for r, n in zip(x, lengths.tolist(), strict=True)]
        assert stats.threshold.tolist() == want, k


@pytest.mark.knobs
@pytest.mark.parametrize("tile, programs, bitmask", [(64, 256, 10**9), (256, 4, 10**9), (4096, 1, 10**9),
                                                     (64, 256, 0), (4096, 1, 0)])
def test_tie_path_across_chunks(monkeypatch, tile, programs, bitmask):
    """Clustered rows (few distinct values) overflow the slots; the tie path splits the ties between
    chunks by their counts: the lowest ids win, also with lengths and per-row k. The select programs of
    a flagged row each write a span: one tile of one chunk (64), several tiles of several chunks, or the
    whole row in one tile; tiles with nothing to write are skipped. Both candidate modes: runs (bitmask =
    10**9) and bitmask words (bitmask = 0)."""
    for name, value in {**PATHS["long"], "tie_tile": tile, "select_programs": programs,
                        "bitmask_programs": bitmask}.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    monkeypatch.setitem(topk_module.TUNING, "slots", 32)
    x = make_scores(4, 700, seed=4, ties=True)  # 7 distinct values: ~100 copies of each
    x[3, 650:] = 9.0  # the top ties all sit in the last chunk
    k = torch.tensor([150, 5, 99, 60], device=DEVICE)
    lengths = torch.tensor([700, 640, 333, 700], device=DEVICE)
    out = torch.empty(4, 150, dtype=torch.int32, device=DEVICE)
    flags = topk_module.launch_topk(x, 0, k.int(), lengths, out).flags
    assert flags.tolist() == [2, 2, 2, 2]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), k.cpu(), lengths.cpu(), order="index", width=150))
    assert not topk_module._SYNC[str(x.device)].any()  # the rows' last programs zeroed their slot counters
    x = torch.full((2, 700), 2.0, device=DEVICE)  # plateaus with one key above them, in the last or first tile:
    x[0, 690] = x[1, 5] = 3.0  # a tile whose only work is that key, and tiles with nothing to write
    out = torch.empty(2, 100, dtype=torch.int32, device=DEVICE)
    assert topk_module.launch_topk(x, 100, None, None, out).flags.tolist() == [2, 2]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 100, order="index"))
    x[1, 5] = 2.0  # a plateau alone: k = 65 needs one tie of the second chunk (64 columns each), its first
    out = torch.empty(2, 65, dtype=torch.int32, device=DEVICE)
    assert topk_module.launch_topk(x, 65, None, None, out).flags.tolist() == [2, 2]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 65, order="index"))
    # chunks of 1024 are counted 8 per step: 9 chunks = a full step and a partial one
    monkeypatch.setitem(topk_module.TUNING, "chunk", 1024)
    x = make_scores(2, 9000, seed=5, ties=True)
    out = torch.empty(2, 300, dtype=torch.int32, device=DEVICE)
    assert topk_module.launch_topk(x, 300, None, None, out).flags.tolist() == [2, 2]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 300, order="index"))



@pytest.mark.knobs
@pytest.mark.parametrize("bitmask", [0, 10**9])  # bitmask_programs: the bitmask mode, the runs mode
@pytest.mark.parametrize("tile, programs", [(64, 256), (256, 8)])  # 4 rows: 2 spans of 1024 (4 tiles) per row
def test_keys_above_threshold_selected_again(monkeypatch, tile, programs, bitmask):
    """Rows of a few distinct values can overflow the slots with k or more keys above T (the top value
    holds more keys than delegates). When those keys fit the slots (flag 3), the row's select programs
    copy them there and its last program selects among them with the threshold T + 1; when they do not,
    the whole-row radix select (flag 1)."""
    for name, value in {**PATHS["long"], "slots": 128, "tie_tile": tile, "select_programs": programs,
                        "bitmask_programs": bitmask}.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    g = torch.Generator().manual_seed(21)
    x = torch.randn(4, 2000, generator=g).clamp(max=1.0)  # G = 256 delegates: 8 strided rows of 256 columns
    x[:, 256:1000] = 8.0  # the second value: 744 keys, in every delegate column
    top = torch.arange(70, 130)  # the top value in 60 delegate columns only (60 delegates), 2 keys each,
    x[:, top] = x[:, top + 5 * 256] = 9.0  # and 7 more at the start of the second span (2 programs): 127 keys
    x[:, 1024:1031] = 9.0  # above T: every one a winner (k = 127), fewer than the 128 slots
    for i in range(8):  # row 1: the top value in all 8 strided rows of those columns: 480 keys, more than the slots
        x[1, top + i * 256] = 9.0
    x[2, 1999] = 9.5  # row 2: one key above them all, at the end (128 keys above T: the slots exactly)
    x = x.to(DEVICE)
    lengths = torch.tensor([2000, 2000, 2000, 1900], device=DEVICE)
    out = torch.empty(4, 127, dtype=torch.int32, device=DEVICE)
    flags = topk_module.launch_topk(x, 127, None, lengths, out).flags
    assert flags.tolist() == [3, 1, 3, 3]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 127, lengths.cpu(), order="index"))
    assert not topk_module._SYNC[str(x.device)].any()  # every counter zeroed for the next call
    check(x, 127, lengths)
    check(x, torch.tensor([127, 3, 100, 0], device=DEVICE), lengths, width=127, order="index")


@pytest.mark.knobs
@pytest.mark.parametrize("pair_rank", [0, 32])
@pytest.mark.parametrize("knobs", [PATHS["register"], PATHS["long"], PATHS["bitmask"]])
def test_pairwise_rank(monkeypatch, knobs, pair_rank):
    """TUNING["pair_rank"]: the exact k-th key by a pairwise rank after two radix rounds (few keys share
    its top 16 bits), or by the last two rounds when too many do (ties); 0: four radix rounds."""
    for name, value in {**knobs, "pair_rank": pair_rank}.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    x = make_scores(3, 700, seed=6)
    x[1] = make_scores(1, 700, seed=7, ties=True)[0]  # ~100 equal keys: the radix rounds
    x[2, ::5] = x[2, 3]  # a tie run inside the pairwise window
    for k in (7, 60):
        check(x, k, order="index")
    check(x, 60, torch.tensor([700, 300, 650], device=DEVICE), order="score")


def long_path_rows(N, k, seed=0):
    """Rows for the long path's candidate histogram and the rank of its crossing bin."""
    g = torch.Generator().manual_seed(seed)
    randn = torch.randn(7, N, generator=g)
    rows = [randn[0],
            torch.arange(N).float(),  # ascending: the candidates fill the last chunks (whole-chunk histogram)
            randn[1] * 1e30,  # a huge key span: wide bins
            randn[2], -torch.exp(randn[3]),  # (row 3 gets ties at the k-th key below); all negative
            torch.where(torch.arange(N) % 500 == 7, randn[4], float("nan")),  # fewer valid keys than k
            torch.where(torch.arange(N) % 97 == 0, float("inf"), randn[5])]  # +inf at the top
    v = rows[3].sort(descending=True).values[k - 3]
    rows[3][torch.randperm(N, generator=g)[:40]] = v  # 40 ties straddle the k-th key
    return torch.stack(rows).to(DEVICE)


@pytest.mark.knobs
@pytest.mark.parametrize("pair_rank, reverse", [(16, True), (128, True), (128, False)])
def test_long_path_histogram_select(monkeypatch, pair_rank, reverse):
    """Long rows that fit the slots: every chunk program adds its candidates' histogram over [T, row max]
    to the row's, the select program ranks the crossing bin's keys (pairwise when at most pair_rank share
    it, radix rounds otherwise). The per-row counters and histograms are left zeroed for the next call.
    The candidates launch takes the rows in either order (``reverse_rows``)."""
    for name, value in {**PATHS["long"], "pair_rank": pair_rank, "reverse_rows": reverse}.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    x = long_path_rows(1500, 20)
    out = torch.empty(7, 20, dtype=torch.int32, device=DEVICE)
    assert topk_module.launch_topk(x, 20, None, None, out).flags.tolist() == [0] * 7  # nothing took the fallback
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 20, order="index"))
    check(x, 20, order="score")
    check(x, torch.tensor([20, 1, 0, 19, 7, 3, 20], device=DEVICE), torch.tensor([1500, 1499, 700, 1500, 65, 900, 1],
          device=DEVICE), width=20, order="index")
    assert not topk_module._SYNC[str(x.device)].any()


@pytest.mark.knobs
def test_long_path_runs_wider_than_a_tile(monkeypatch):
    """A chunk with more winners than one tile (the top of an ascending row): the select program places
    a whole run of winners, pads in tiles (of 32 columns: the -1 padding of 50 ids takes two); ties at the k-th
    key cross tile and chunk boundaries."""
    for name, value in {**PATHS["long"], "chunk": 32, "tie_tile": 32}.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    x = make_scores(3, 1000, seed=8)
    x[0] = torch.arange(1000, device=DEVICE).float()  # the 50 winners: the last chunk's 40 and 10 before
    x[1, 900:] = 5.0  # 100 ties above every other key, across two chunks: the 50 lowest ids win
    out = torch.empty(3, 50, dtype=torch.int32, device=DEVICE)
    assert topk_module.launch_topk(x, 50, None, None, out).flags.tolist() == [0, 0, 0]
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 50, order="index"))
    check(x, 50, torch.tensor([1000, 950, 37], device=DEVICE), order="score")


@pytest.mark.knobs
@pytest.mark.parametrize("shuffle", [None, 1, 2])
def test_runs_of_slots_in_any_order(monkeypatch, shuffle):
    """On a GPU the chunks of a row take their runs of slots in whatever order their atomic adds land; the
    interpreter runs programs in order. Reorder the runs between the candidates and the select launch
    (slots and run starts; reversed, or a random order per row): the select launch must still place every
    winner exactly."""
    for name, value in PATHS["long"].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    g = torch.Generator().manual_seed(shuffle or 0)
    x = long_path_rows(1500, 20, seed=shuffle or 0)
    out = torch.empty(7, 20, dtype=torch.int32, device=DEVICE)
    stats = topk_module.prepare(x, 20, None, None, out)
    assert stats.names == ("delegates", "candidates", "select")
    delegates, candidates, select = stats.launches
    delegates()
    candidates()
    slots, starts, counts = stats.runs, stats.run_starts, stats.counts
    before = starts.clone()
    for r in range(x.shape[0]):
        runs = [slots[r, int(b):int(b) + int(n)].clone() for b, n in zip(starts[r], counts[r], strict=True)]
        if sum(int(n) for n in counts[r]) > slots.shape[1]:
            continue  # (an overflowing row keeps its runs: it takes the fallback)
        pos = 0
        order = reversed(range(len(runs))) if shuffle is None else torch.randperm(len(runs), generator=g).tolist()
        for c in order:  # reversed: the last chunk's run first
            slots[r, pos:pos + runs[c].numel()] = runs[c]
            starts[r, c] = pos
            pos += runs[c].numel()
    assert (starts != before).any(dim=1).sum() >= 5  # most rows now hold their runs in another order
    select()
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 20, order="index"))
    assert not topk_module._SYNC[str(x.device)].any()


def bitmask_columns(words: torch.Tensor) -> torch.Tensor:
    """The columns whose bits are set in int32 words (bit j % 32 of word j // 32), ascending."""
    bits = (words.long()[:, None] >> torch.arange(32)) & 1
    return torch.nonzero(bits.flatten()).flatten()


@pytest.mark.knobs
@pytest.mark.parametrize("mode", ["bitmask", "long"])  # the bitmask mode; the runs mode marks them too
def test_candidates_bitmask(monkeypatch, mode):
    """The candidates launch marks exactly the keys >= T of every row (NaN, -inf and columns past the
    length never), in both modes (an overflowing row's fallback reads the words), and its per-chunk counts of
    keys > T and == T match the row."""
    for name, value in PATHS[mode].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    x = long_path_rows(1500, 20, seed=3).cpu()
    x[4, 1000:1300] = x[4, 17]  # a plateau straddling chunks
    lengths = torch.tensor([1500, 1499, 700, 1, 1500, 64, 0])
    out = torch.empty(7, 20, dtype=torch.int32, device=DEVICE)
    stats = topk_module.prepare(x.to(DEVICE), 20, None, lengths.to(DEVICE), out)
    assert stats.bitmask == (mode == "bitmask")
    delegates, candidates, select = stats.launches
    delegates()
    candidates()
    chunk = stats.plan.chunk
    for r in range(7):
        key = float_keys(x[r, :int(lengths[r])])
        T = int(stats.threshold[r])
        want = torch.nonzero((key >= T) & (key != -(2**31))).flatten()
        assert torch.equal(bitmask_columns(stats.bits[r].cpu()), want), r
        per_chunk = torch.cat([key, torch.full((chunk * stats.above.shape[1] - len(key),), -(2**31),
                                               dtype=torch.int32)]).view(-1, chunk)
        assert torch.equal(stats.above[r].cpu(), (per_chunk > T).sum(1).int()), r
        assert torch.equal(stats.ties[r].cpu(), ((per_chunk == T) & (per_chunk != -(2**31))).sum(1).int()), r
    select()
    assert torch.equal(out.cpu(), topk_reference(x, 20, lengths, order="index"))
    assert not topk_module._SYNC[str(out.device)].any()


@pytest.mark.knobs
@pytest.mark.parametrize("N", [700, 1500])
def test_select_spans_are_powers_of_two(monkeypatch, N):
    """The select programs' spans are powers of two: ``bits_to_slots`` takes a span's bitmask words in
    blocks of ``tl.arange`` (a power of two on a GPU; the interpreter does not check). Whole tiles of an
    awkward row length once gave 3 tiles of 64 columns; a 64 x 32832 row (the DSA indexer's width) failed
    to compile on the H200. Random rows and tie-path rows, exact."""
    for name, value in {**PATHS["bitmask"], "tie_tile": 64, "select_programs": 32}.items():  # 4 spans a row, as
        monkeypatch.setitem(topk_module.TUNING, name, value)  # 64 rows get from the default 256 programs
    x = make_scores(8, N, seed=N, device="cpu")
    x[1::2] = make_scores(4, N, seed=N + 1, ties=True, device="cpu")  # clusters: the tie path
    x = x.to(DEVICE)
    out = torch.empty(8, 50, dtype=torch.int32, device=DEVICE)
    stats = topk_module.launch_topk(x, 50, None, None, out)
    span = stats.span
    assert stats.bitmask and span & (span - 1) == 0 and span % stats.plan.chunk == 0 and span * 4 >= N
    assert torch.equal(out.cpu(), topk_reference(x.cpu(), 50, order="index"))


@pytest.mark.knobs
@pytest.mark.parametrize("run", [16, 64])
def test_score_order_by_sorted_runs(monkeypatch, run):
    """order="score" on rows wider than TUNING["sort_run"]: runs sorted by parallel programs, then merged
    (binary searches); ties by id across runs, fewer winners than k (padding), every path."""
    monkeypatch.setitem(topk_module.TUNING, "sort_run", run)
    x = make_scores(4, 400, seed=11, ties=True, specials=True)
    x[1] = make_scores(1, 400, seed=12)[0]
    lengths = torch.tensor([400, 399, 30, 0], device=DEVICE)
    check(x, 70, lengths)
    check(x, torch.tensor([70, 3, 64, 9], device=DEVICE), lengths, width=70)
    for name, value in PATHS["long"].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    check(x, 33, lengths)


@pytest.mark.knobs
def test_forced_fallback_for_wide_k(monkeypatch):
    """k too large for the delegates (2k > max_delegates) sends every row to the exact fallback."""
    for name, value in PATHS["long"].items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    monkeypatch.setitem(topk_module.TUNING, "max_delegates", 64)
    check(make_scores(2, 150, seed=3, ties=True, specials=True), 40, order="index")


@pytest.mark.knobs
@pytest.mark.parametrize("N, k", [(300, 7), (3001, 100), (8192, 700)])
@pytest.mark.parametrize("plan", ["direct", "rounds", "delegates"])
def test_packed_short_rows(monkeypatch, N, k, plan):
    """Short rows packed within ~1% (like Quest page scores) share their top 16 bits: radix rounds on fixed
    bits would keep the whole row in one bin, the window rounds work on the row's own range. The delegates
    plan must continue over the delegates to the exact k-th delegate instead of falling to the whole-row
    select (flag 1). bf16-rounded packed rows (a handful of distinct values, hundreds of ties each) may take
    its tie path (flag 2), never flag 1."""
    assert N <= topk_module.TUNING["register_row"]
    knobs = {"direct": {"direct_ratio": 1 << 20}, "rounds": {"direct_ratio": 1 << 20, "short_pair": 0},
             "delegates": {"direct_ratio": 0}}[plan]
    for name, value in knobs.items():
        monkeypatch.setitem(topk_module.TUNING, name, value)
    g = torch.Generator().manual_seed(N)
    rows = 1 + 0.01 * torch.rand(3, N, generator=g)
    rows[1] = 5700 * (1 + 0.02 * torch.randn(N, generator=g))  # Quest-like: a bound summed over heads and dims
    lengths = torch.tensor([N, N - N // 3, N - 1], device=DEVICE)
    bf16 = (1 + 0.1 * torch.rand(2, N, generator=g)).to(torch.bfloat16)
    for x, lens, allowed in ((rows, None, {0}), (rows, lengths, {0}), (bf16, None, {0, 2})):
        x = x.to(DEVICE)
        out = torch.empty(x.shape[0], k, dtype=torch.int32, device=DEVICE)
        stats = topk_module.launch_topk(x, k, None, lens, out)
        flags = stats.flags
        assert list(stats.grids) == ["short_row"] and stats.plan.direct == (plan != "delegates")
        assert set(flags.tolist()) <= ({0} if plan != "delegates" else allowed), flags.tolist()
        assert torch.equal(out.cpu(), topk_reference(x.cpu(), k, None if lens is None else lens.cpu(), order="index"))
        check(x, k, lens)


@pytest.mark.parametrize("N", [700, 2049] if DEVICE.type == "cpu" else [4095, 8000])
@pytest.mark.parametrize("fraction, ratio", [*[(f, 8) for f in (64, 8, 3, 2)],
                                             *[pytest.param(f, r, marks=pytest.mark.knobs) for r in (0, 1 << 20)
                                               for f in (64, 2)]])
def test_short_rows_every_k_fraction(monkeypatch, N, fraction, ratio):
    """Short rows at k = N/64 .. N/2: random, integer plateaus (0..63: every value a run of ties), one
    all-equal row, NaN / -inf / -0.0 sprinkled in, lengths 0, 1, k - 1 and full; both orders. With the plan
    the shapes pick (``direct_ratio`` 8) at every fraction; the delegates plan always (0) and the direct plan
    always at the smallest and the largest k."""
    from sparse_ref.workloads import make_distribution

    monkeypatch.setitem(topk_module.TUNING, "direct_ratio", ratio)
    k = N // fraction
    x = torch.cat([make_scores(2, N, seed=fraction, specials=True),
                   make_distribution("integers", 2, N, DEVICE, seed=fraction), torch.full((1, N), 0.5, device=DEVICE)])
    lengths = torch.tensor([N, 0, N, max(k - 1, 0), 1], device=DEVICE)
    check(x, k, order="index")
    check(x, k, lengths, order="index")
    check(x, k, lengths, order="score")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    check(make_scores(2, 29, seed=3, ties=True, specials=True, dtype=dtype), 6)


def test_edge_sizes():
    """N = 0 and 1, k = 0, zero rows."""
    assert topk(torch.empty(3, 0, device=DEVICE), 4).tolist() == [[-1] * 4] * 3
    check(make_scores(2, 1, seed=4), 3)
    assert topk(make_scores(2, 5, seed=5), 0).shape == (2, 0)
    assert topk(torch.empty(0, 5, device=DEVICE), 2).shape == (0, 2)


def test_per_row_k_tensor(path):
    """Per-row k, including an int64 k at and above 2**31 (clamped on the host, never wrapped)."""
    x = make_scores(5, 230, seed=6, ties=True)
    k = torch.tensor([0, 3, 2**31, 7, 2**40], device=DEVICE)
    check(x, k, width=8, order="index")
    check(x, k.int().clamp(0, 9), order="score")  # width read from k.max() eagerly


@pytest.mark.knobs
@settings(max_examples=12, deadline=None)
@given(R=st.integers(1, 3), N=st.integers(0, 200), k=st.integers(0, 40), ties=st.booleans(), specials=st.booleans(),
       path=st.sampled_from(list(PATHS)), order=st.sampled_from(["score", "index"]),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
       data=st.data())
def test_property_matches_reference(R, N, k, ties, specials, path, order, dtype, seed, data):
    saved = dict(topk_module.TUNING)
    topk_module.TUNING.update(PATHS[path])
    try:
        x = make_scores(R, N, seed=seed, ties=ties, specials=specials, dtype=dtype)
        lengths = torch.tensor(data.draw(st.lists(st.integers(0, N), min_size=R, max_size=R)), device=DEVICE)
        check(x, k, lengths, order=order)
    finally:
        topk_module.TUNING.update(saved)


def test_kernel_clamps_bad_lengths(monkeypatch):
    """While a CUDA graph captures, lengths are not checked on the host: the kernel clamps them to [0, N]."""
    monkeypatch.setattr(checks, "capturing", lambda: True)
    monkeypatch.setattr(topk_module, "capturing", lambda: True)
    x = make_scores(3, 11, seed=7)
    got = topk(x, 4, torch.tensor([-5, 99, 6], device=DEVICE))
    assert torch.equal(got.cpu(), topk_reference(x.cpu(), 4, torch.tensor([0, 11, 6])))


# ---------------------------------------------------------------------------------------------
# Input errors: raised before any launch, naming the argument, what was expected and the fix.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda x: topk(x.double(), 2), "float32 or torch.float16 or torch.bfloat16"),
    (lambda x: topk(x[0], 2), "2-D"),
    (lambda x: topk(x.t(), 2), "unit stride"),
    (lambda x: topk(x.tolist(), 2), "torch.Tensor"),
    (lambda x: topk(x, -1), r"topk: k: expected an int in \[0"),
    (lambda x: topk(x, 2.5), "topk: k: expected an int"),
    (lambda x: topk(x, 5000), "at most 4096"),
    (lambda x: topk(x, 2, order="random"), "order: expected one of"),
    (lambda x: topk(x, torch.tensor([1.0, 2.0, 3.0], device=x.device)), "topk: k: expected dtype"),
    (lambda x: topk(x, torch.tensor([1, 2], device=x.device)), r"topk: k: expected shape \[3\]"),
    (lambda x: topk(x, torch.tensor([1, -2, 3], device=x.device)), "topk: k: expected values in"),
    (lambda x: topk(x, 2, torch.tensor([1.0, 2.0, 3.0], device=x.device)), "lengths: expected dtype"),
    (lambda x: topk(x, 2, torch.tensor([1, 2], device=x.device)), r"lengths: expected shape \[3\]"),
    (lambda x: topk(x, 2, torch.tensor([1, 2, 9], device=x.device)), r"lengths: expected values in \[0, 8\]"),
    (lambda x: topk(x, 2, torch.tensor([-1, 2, 3], device=x.device)), r"lengths: expected values in \[0, 8\]"),
    (lambda x: topk(x, 2, out=torch.empty(3, 2, dtype=torch.int64, device=x.device)), "out: expected dtype"),
    (lambda x: topk(x, 2, width=-1), "width: expected an int in"),
    (lambda x: topk(x.to("meta"), 2), "a tensor with data"),
    (lambda x: topk(x, 2, torch.tensor([1, 2, 3], device="meta")), "lengths: expected a tensor with data"),
])
def test_input_errors(call, match):
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(SparseRefError, match=match) as info:
        call(x)
    assert "Fix" in str(info.value)


@pytest.mark.parametrize("order", ["index", "score"])
def test_rows_whose_k_takes_every_valid_key(order):
    """Short requests: a row whose k reaches its valid keys takes them all (ascending, then -1) beside rows of the same
    launch that select: k equal to a row's valid count exactly, one above it, NaN and -inf never valid, an empty row,
    a row of one key. With k at least the width (every row's keys all win) the direct plan skips its rounds (ALL)."""
    x = make_scores(6, 700, seed=41, specials=True)
    lengths = torch.tensor([700, 64, 90, 0, 1, 650], device=DEVICE)
    valid = (x == x) & (x != float("-inf")) & (torch.arange(700, device=DEVICE)[None, :] < lengths[:, None])
    exact = int(valid[2].sum())  # row 2's valid keys: k == that takes every one
    for k in (exact, exact + 1, 64, 700, 800):
        run = topk_module.prepare(x, k, None, lengths, torch.empty(6, k, dtype=torch.int32, device=DEVICE))
        assert run.plan.direct and run.launches[0].constexprs["ALL"] is (k >= 700)
        got = check(x, k, lengths, order=order)
        assert (got[3] == -1).all() and (got[4, 1:] == -1).all()
        for r in (2, 5) if k >= 700 else (2,) if k >= exact else ():  # every valid key of the row
            assert torch.equal(got[r][got[r] >= 0].sort().values.cpu(), valid[r].nonzero().flatten().int().cpu())
