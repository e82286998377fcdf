"""The top-k's plan (``sparse_ref.kernels.topk.planning``): how a call runs is decided from the shapes alone, at the
default knobs. These pin the boundaries; ``test_topk.py`` checks that every plan selects exactly."""

from __future__ import annotations

import pytest
import torch

from sparse_ref.kernels.topk import TUNING, launch_topk, plan, prepare
from sparse_ref.kernels.topk.planning import MIN_PROGRAMS, short_row_warps


@pytest.mark.parametrize("N, register", [(1, True), (8191, True), (8192, True), (8193, False), (131072, False)])
def test_rows_up_to_register_row_are_held_in_registers(N, register):
    assert TUNING["register_row"] == 8192
    p = plan(4, N, min(N, 2048))
    assert p.register is register
    assert not p.force_fallback
    assert p.n_pad >= max(N, 32) and p.n_pad & (p.n_pad - 1) == 0  # a power of two, at least one bitmask word


@pytest.mark.parametrize("N, k, direct", [(8192, 2048, True), (8192, 512, True), (8192, 128, False),
                                          (2048, 123, True), (8192, 123, False), (100, 100, True)])
def test_a_register_row_is_selected_directly_when_the_delegates_keep_an_eighth(N, k, direct):
    p = plan(2, N, k)
    assert p.direct is direct
    assert p.direct == (p.n_pad <= TUNING["direct_ratio"] * p.G)
    assert p.G <= p.n_pad  # a register row has at most a delegate per score


def test_only_a_register_row_is_selected_directly():
    """A long row whose delegates would keep more than an eighth still takes the three launches."""
    assert plan(2, 8192, 2048).direct and not plan(2, 16384, 2048).direct  # both n_pad <= 8 G
    assert not plan(1, 131072, 4096).direct


def test_k_too_wide_for_delegates_sends_long_rows_to_the_whole_row_select():
    assert plan(2, 65536, 4096).force_fallback is False  # G = 8192 = max_delegates
    assert plan(2, 65536, 4097).force_fallback is True
    assert plan(2, 8192, 8192).force_fallback is False  # a register row never falls back


@pytest.mark.parametrize("R, N", [(1, 131072), (8, 131072), (32, 16384), (64, 16384), (128, 131072)])
def test_few_rows_get_smaller_chunks_until_they_fill_the_gpu(R, N):
    p = plan(R, N, 2048)
    programs = R * -(-N // p.chunk)
    assert p.chunk in (1024, 2048) and p.chunk % 32 == 0
    assert programs >= MIN_PROGRAMS or p.chunk == 1024  # halved down to 1024 columns at most
    assert p.chunk == 2048 or R * -(-N // (2 * p.chunk)) < MIN_PROGRAMS
    assert p.slots == min(p.G, 1 << 14) and 16 <= p.pair <= p.slots


def test_short_row_warps_are_one_per_512_scores_from_8_to_32():
    assert [short_row_warps(n) for n in (32, 4096, 8192, 16384, 1 << 20)] == [8, 8, 16, 32, 32]


def test_the_launches_follow_the_plan():
    """``launch_topk`` runs one program per row for a register row, three launches for a long one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for N, names in ((300, ("short_row",)), (9000, ("delegates", "candidates", "select"))):
        x = torch.randn(2, N, device=device)
        out = torch.empty(2, 16, dtype=torch.int32, device=device)
        run = launch_topk(x, 16, None, None, out)
        assert run.names == names and run.plan == plan(2, N, 16)
    for N, k in ((4000, 16), (300, 16)):  # a register row: the delegates plan, then the direct one
        run = launch_topk(torch.randn(2, N, device=device), k, None, None,
                          torch.empty(2, k, dtype=torch.int32, device=device))
        want = short_row_warps(run.plan.n_pad) if run.plan.direct else TUNING["num_warps"]
        assert run.launches[0].warps == want and run.plan.direct is (N == 300)


def test_the_direct_plans_kept_bin_grows_with_the_row():
    """The direct plan's kept bin (its PAIR constexpr): ``short_pair`` keys per 4096 scores, so a row of 8192 skips the
    window round over the whole row that its value round's bin of a few hundred keys would cost
    (``docs/performance.md``)."""
    for N, pair in ((300, 256), (4096, 256), (6000, 512), (8192, 512)):
        run = prepare(torch.randn(2, N), N // 4, None, None, torch.empty(2, N // 4, dtype=torch.int32))
        assert run.plan.direct and run.launches[0].constexprs["PAIR"] == pair, N
