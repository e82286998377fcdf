"""``order="score"`` for the top-k: each row's winners (ids ascending, -1 padded) reordered by descending score, ties by
ascending id, as one descending int64 order of ``key << 32 | (2**32 - 1 - id)``: one ``tl.sort`` a row, or for wide rows
sorted runs merged by binary searches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.kernels.topk.common import after_previous_launch, keys_of


@triton.jit
def _packed_winners(scores, stride_r, out, r, j, W):
    """The winners out[r, j] as int64 ``key << 32 | (2**32 - 1 - id)``; INT64_MIN for padding."""
    ids = tl.load(out + r.to(tl.int64) * W + j, mask=j < W, other=-1)
    valid = ids >= 0
    x = tl.load(scores + r.to(tl.int64) * stride_r + tl.where(valid, ids, 0), mask=valid, other=0.0)
    skey = keys_of(x, valid).to(tl.int64)
    return tl.where(valid, (skey << 32) | (0xFFFFFFFF - ids.to(tl.int64)), -9223372036854775807 - 1)


@triton.jit
def sort_runs_kernel(scores, stride_r, out, runs, W, RUN: tl.constexpr, W_PAD: tl.constexpr, PDL: tl.constexpr):
    """One program = RUN consecutive winners of a row, sorted descending into ``runs``; RUN = W_PAD (the whole row in
    one tile): the sorted ids back into ``out``, -1 padded."""
    after_previous_launch(PDL)
    r = tl.program_id(0)
    j = tl.program_id(1) * RUN + tl.arange(0, RUN)
    packed = tl.sort(_packed_winners(scores, stride_r, out, r, j, W), descending=True)
    if RUN == W_PAD:
        ids = tl.where(packed != -9223372036854775807 - 1, (0xFFFFFFFF - (packed & 0xFFFFFFFF)).to(tl.int32), -1)
        tl.store(out + r.to(tl.int64) * W + j, ids, mask=j < W)
    else:
        tl.store(runs + r.to(tl.int64) * W_PAD + j, packed)


@triton.jit
def merge_runs_kernel(runs, out, W, RUN: tl.constexpr, W_PAD: tl.constexpr, PDL: tl.constexpr):
    """One program = one sorted run of a row: an entry's place is the number of larger entries, counted in every run by
    a binary search over the row's runs held in registers (``tl.gather``); -1 on the run's share of the padding."""
    after_previous_launch(PDL)
    NR: tl.constexpr = W_PAD // RUN
    r = tl.program_id(0)
    row = runs + r.to(tl.int64) * W_PAD
    every = tl.load(row + tl.arange(0, W_PAD))  # the row's NR runs, each sorted descending
    i = tl.program_id(1) * RUN + tl.arange(0, RUN)
    v = tl.load(row + i)
    # one lane per (run q, entry e): how many entries of run q are larger than entry e
    q = tl.arange(0, NR)[:, None] * RUN
    mine = tl.reshape(tl.broadcast_to(v[None, :], [NR, RUN]), [W_PAD])
    start = tl.reshape(tl.broadcast_to(q, [NR, RUN]), [W_PAD])
    larger = tl.zeros([W_PAD], tl.int32)
    for b in tl.static_range(16):
        if (RUN >> b) > 0:  # steps RUN, RUN / 2, ..., 1
            probe = larger + (RUN >> b)
            x = tl.gather(every, tl.minimum(start + probe - 1, W_PAD - 1), 0)
            larger = tl.where((probe <= RUN) & (x > mine), probe, larger)
    n_valid = tl.sum((every != -9223372036854775807 - 1).to(tl.int32), axis=0)
    valid = v != -9223372036854775807 - 1
    out_row = out + r.to(tl.int64) * W
    place = tl.sum(tl.reshape(larger, [NR, RUN]), axis=0)
    tl.store(out_row + place, (0xFFFFFFFF - (v & 0xFFFFFFFF)).to(tl.int32), mask=valid)
    tl.store(out_row + i, tl.full([RUN], -1, tl.int32), mask=(i >= n_valid) & (i < W))


def sort_winners(scores, out, run: int, run_warps: int, warps: int, pdl: dict):
    """Reorder each row of ``out`` by descending score, ties by ascending id: runs of ``run`` sorted in parallel then
    merged (two launches) when rows are wider, else one sort a row. The first launch waits for the selection without PDL
    (placed early, its programs crowd onto the SMs the selection frees)."""
    R, W = out.shape
    w_pad = max(16, triton.next_power_of_2(W))
    if 0 < run < w_pad:
        runs = torch.empty((R, w_pad), dtype=torch.int64, device=out.device)
        nw = run_warps if scores.is_cuda else 1
        sort_runs_kernel[(R, w_pad // run)](scores, scores.stride(0), out, runs, W, RUN=run, W_PAD=w_pad,
                                            num_warps=nw, PDL=False)
        merge_runs_kernel[(R, w_pad // run)](runs, out, W, RUN=run, W_PAD=w_pad, num_warps=nw, **pdl)
        return out
    num_warps = (warps if w_pad >= 2048 else 8 if w_pad >= 512 else 4) if scores.is_cuda else 1
    sort_runs_kernel[(R, 1)](scores, scores.stride(0), out, out, W, RUN=w_pad, W_PAD=w_pad, num_warps=num_warps,
                             PDL=False)
    return out
