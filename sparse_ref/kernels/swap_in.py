"""The offload swap-in in two Triton launches (bookkeeping per request row, then the copies): no host sync.

``sparse_ref.offload.HotBuffer.swap_in`` in a kernel. The buffer's state lives on the device: per row, the
token each slot holds (``token``, -1 empty), the step it was last used (``last_used``) and the reverse map
token -> slot (``slot_of``, -1: not held), a step counter (``clock``) and the hit / miss counts. Each
program (one request row):

0. writes the row's new token's K/V into its reserved slot ``B`` and into the host pool (the write path);
1. looks its tokens up in ``slot_of`` (the newest token is always in the reserved slot ``B``): hits are
   stamped with this step's ``clock``;
2. keys every slot by (used this step last, empty first, then least recently used, then slot id), packed in
   one int64, finds the ``m``-th smallest key by bisection (``m`` misses; no sort: a sort of 4096 keys in one
   program took over a minute to compile) and lists the ``m`` victims in slot order; the ``j``-th miss (in
   position order) takes the ``j``-th victim;
3. for each miss: forgets the slot's old token, records the new one and stamps the slot; writes which host
   row each missed entry copies from;
4. writes the row's page-size-1 table (0 past its tokens).

A second launch (``_copy_in_kernel``, a grid of (row, ``COPY_ROWS`` entries)) copies the missed K/V rows in
from the host pool: on a GPU the host pool is pinned memory, read through unified addressing (no copy
engine, no sync), and the many programs keep enough PCIe reads in flight.

It must equal the torch reference bit for bit: the same tables, the same slots replaced, the same K/V.
Each row's state is its own (one program per row), so programs never race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import check_int, check_kernel_device, check_tensor


@triton.jit
def _swap_in_kernel(positions, counts, seq_lens, rows, req_to_token, host_k, host_v, hot_k, hot_v, new_k, new_v,
                    new_loc, token, last_used, slot_of, scratch, table, copies, clock_ptr, stats,
                    W, R2T_W, MAX_CTX, B: tl.constexpr, HD: tl.constexpr,
                    W_PAD: tl.constexpr, B_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    n, newest, clock = tl.load(counts + b), tl.load(seq_lens + b) - 1, tl.load(clock_ptr)
    base = 1 + row * (B + 1)  # the row's first slot; slot 0 of the buffer is padding
    loc = tl.load(new_loc + b).to(tl.int64)
    for d0 in range(0, HD, BLOCK_D):  # 0. the new token: its reserved slot, and the host pool
        d = d0 + tl.arange(0, BLOCK_D)
        k_new = tl.load(new_k + b.to(tl.int64) * HD + d, mask=d < HD)
        v_new = tl.load(new_v + b.to(tl.int64) * HD + d, mask=d < HD)
        tl.store(hot_k + (base + B) * HD + d, k_new, mask=d < HD)
        tl.store(hot_v + (base + B) * HD + d, v_new, mask=d < HD)
        tl.store(host_k + loc * HD + d, k_new, mask=d < HD)
        tl.store(host_v + loc * HD + d, v_new, mask=d < HD)
    j = tl.arange(0, W_PAD)
    valid = j < n
    t = tl.load(positions + b.to(tl.int64) * W + j, mask=valid, other=0)
    lookup = valid & (t != newest)
    s = tl.load(slot_of + row * MAX_CTX + t, mask=lookup, other=-1)  # 1. hits
    hit = lookup & (s >= 0)
    tl.store(last_used + row * B + s, tl.full([W_PAD], 0, tl.int32) + clock, mask=hit)
    tl.debug_barrier()
    # 2. every slot keyed: used this step last, then empty, then least recently used, then by slot id
    i = tl.arange(0, B_PAD)
    held = tl.load(token + row * B + i, mask=i < B, other=-1)
    used = tl.load(last_used + row * B + i, mask=i < B, other=0)
    group = tl.where(i >= B, 3, tl.where(used == clock, 2, tl.where(held < 0, 0, 1))).to(tl.int64)
    key = (group * 4294967296 + tl.where(held < 0, 0, used).to(tl.int64)) * B_PAD + i  # unique: ties by slot id
    miss = lookup & ~hit
    m = tl.sum(miss.to(tl.int64), axis=0)  # the m smallest keys are the victims: their threshold by bisection
    lo, hi = tl.full([], -1, tl.int64), tl.full([], 1 << 50, tl.int64)  # #(key <= lo) < m <= #(key <= hi)
    for _ in range(51):
        mid = (lo + hi) // 2
        enough = tl.sum((key <= mid).to(tl.int64), axis=0) >= m
        hi, lo = tl.where(enough, mid, hi), tl.where(enough, lo, mid)
    chosen = (key <= hi) & (m > 0)
    tl.store(scratch + b.to(tl.int64) * B_PAD + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, i.to(tl.int32),
             mask=chosen)  # the victims in slot order
    tl.debug_barrier()
    tl.atomic_add(stats, tl.sum((valid & ~miss).to(tl.int64), axis=0))
    tl.atomic_add(stats + 1, tl.sum(miss.to(tl.int64), axis=0))
    victim = tl.load(scratch + b.to(tl.int64) * B_PAD + tl.cumsum(miss.to(tl.int32), axis=0) - 1, mask=miss,
                     other=0)
    old = tl.load(token + row * B + victim, mask=miss, other=-1)  # 3. the victims' old tokens are forgotten
    tl.store(slot_of + row * MAX_CTX + old, tl.full([W_PAD], -1, tl.int32), mask=miss & (old >= 0))
    tl.debug_barrier()
    tl.store(slot_of + row * MAX_CTX + t, victim, mask=miss)
    tl.store(token + row * B + victim, t, mask=miss)
    tl.store(last_used + row * B + victim, tl.full([W_PAD], 0, tl.int32) + clock, mask=miss)
    src = tl.load(req_to_token + row * R2T_W + t, mask=miss, other=0)  # the copies for _copy_in_kernel
    tl.store(copies + b.to(tl.int64) * W + j, tl.where(miss, src, -1), mask=j < W)
    slot = tl.where(t == newest, B, tl.where(hit, s, victim))  # 4. the table
    tl.store(table + b.to(tl.int64) * W + j, tl.where(valid, base + slot, 0).to(tl.int32), mask=j < W)


@triton.jit
def _copy_in_kernel(copies, table, host_k, host_v, hot_k, hot_v, W, HD: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """3b. the missed rows' K/V, ``ROWS`` table entries per program: a grid wide enough to keep many reads of
    pinned host memory in flight (one program per request row would leave most of the GPU, and PCIe, idle)."""
    b, j = tl.program_id(0).to(tl.int64), tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    src = tl.load(copies + b * W + j, mask=j < W, other=-1).to(tl.int64)
    go = src >= 0
    dst = tl.load(table + b * W + j, mask=go, other=0).to(tl.int64)
    for d0 in range(0, HD, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        cols = go[:, None] & (d < HD)[None, :]
        tl.store(hot_k + dst[:, None] * HD + d[None, :], tl.load(host_k + src[:, None] * HD + d[None, :], mask=cols),
                 mask=cols)
        tl.store(hot_v + dst[:, None] * HD + d[None, :], tl.load(host_v + src[:, None] * HD + d[None, :], mask=cols),
                 mask=cols)


def swap_in(positions: torch.Tensor, counts: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
            req_to_token: torch.Tensor, host_k: torch.Tensor, host_v: torch.Tensor, hot_k: torch.Tensor,
            hot_v: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, new_loc: torch.Tensor, token: torch.Tensor,
            last_used: torch.Tensor, slot_of: torch.Tensor, clock: torch.Tensor, stats: torch.Tensor,
            size: int) -> torch.Tensor:
    """int32 ``[bs, W]``: the hot slots of each row's ``positions`` (int32 ``[bs, W]``, ascending, the first
    ``counts[b]`` valid); the new tokens ``new_k`` / ``new_v`` ``[bs, H_kv, D]`` written to their reserved slots
    and to ``host_*[new_loc]``; misses copied in from ``host_k`` / ``host_v``; ``token``, ``last_used`` (int32
    ``[rows, size]``), ``slot_of`` (int32 ``[rows, max_ctx]``), ``clock`` (int32 ``[1]``, advanced by one) and
    ``stats`` (int64 ``[2]``: hits, misses) updated in place. One launch, no host sync: graph-capturable."""
    check_swap_in(positions, counts, hot_k, new_k, token, slot_of, clock, stats, size)
    clock += 1
    bs, width = positions.shape
    hd = hot_k.shape[1] * hot_k.shape[2]
    table = torch.empty(bs, width, dtype=torch.int32, device=positions.device)
    if bs == 0:
        return table
    b_pad, w_pad = triton.next_power_of_2(size), triton.next_power_of_2(max(width, 1))
    scratch = torch.empty(bs, b_pad, dtype=torch.int32, device=positions.device)
    copies = torch.empty(bs, width, dtype=torch.int32, device=positions.device)
    _swap_in_kernel[(bs,)](positions, counts, seq_lens, rows, req_to_token, host_k, host_v, hot_k, hot_v, new_k,
                           new_v, new_loc, token, last_used, slot_of, scratch, table, copies, clock, stats, width,
                           req_to_token.shape[1], slot_of.shape[1],
                           B=size, HD=hd, W_PAD=w_pad, B_PAD=b_pad,
                           BLOCK_D=min(triton.next_power_of_2(hd), 1024))
    rows_per, block_d = COPY_ROWS, min(triton.next_power_of_2(hd), 512)
    _copy_in_kernel[(bs, triton.cdiv(width, rows_per))](copies, table, host_k, host_v, hot_k, hot_v, width, HD=hd,
                                                        ROWS=rows_per, BLOCK_D=block_d, num_warps=4)
    return table


COPY_ROWS = 8  # table entries (token rows) per copy program


# ------------------------------ argument checks (each entry point above calls one first)
def check_swap_in(positions, counts, hot_k, new_k, token, slot_of, clock, stats, size) -> None:
    size = check_int("size", size, low=1, high=1 << 16)
    check_tensor("positions", positions, dtype=torch.int32, dims=2, contiguous=True)
    check_tensor("counts", counts, dtype=torch.int32, shape=(positions.shape[0],))
    check_tensor("token", token, dtype=torch.int32, dims=2, contiguous=True)
    check_tensor("slot_of", slot_of, dtype=torch.int32, shape=(token.shape[0], None), contiguous=True)
    check_tensor("hot_k", hot_k, dims=3, contiguous=True)
    check_tensor("new_k", new_k, shape=(positions.shape[0], *hot_k.shape[1:]), contiguous=True)
    check_tensor("clock", clock, dtype=torch.int32, shape=(1,))
    check_tensor("stats", stats, dtype=torch.int64, shape=(2,))
    check_kernel_device("positions", positions, "move it with .cuda().")
