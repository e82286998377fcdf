"""Lesson kernel of notebook 10: the offload swap-in, one program per request row.

Each program looks its row's tokens up in ``slot_of`` (token -> hot slot): a hit is stamped with this
step's ``clock``. The free slots (not used this step) are ranked by counting, for each slot, the free slots
that come before it (empty first, then least recently used, then a lower slot id); the ``m`` slots of rank
``< m`` are the victims of the row's ``m`` misses, taken in slot order. Each miss forgets the victim's old
token, records its own, and copies its K/V row in from the host pool; the row's page-size-1 table comes
last. The package's ``sparse_ref.kernels.swap_in`` picks the same victims without the ``n²`` counting:
it keeps each row's slots in eviction order (``HotBuffer.lru``) and takes the first ones this step does
not use; it also writes the new token and copies in a second, wider launch. ``tests/test_lessons.py``
holds this kernel equal to the torch reference ``HotBuffer.swap_in``.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def teaching_swap_in_kernel(positions, counts, seq_lens, rows, req_to_token, host_k, host_v, hot_k, hot_v, token,
                            last_used, slot_of, scratch, table, clock_ptr, W, R2T_W, MAX_CTX, B: tl.constexpr,
                            HD: tl.constexpr, W_PAD: tl.constexpr, B_PAD: tl.constexpr, HD_PAD: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    n, newest, clock = tl.load(counts + b), tl.load(seq_lens + b) - 1, tl.load(clock_ptr)
    base = 1 + row * (B + 1)  # the row's first hot slot; its slot B holds the newest token
    j = tl.arange(0, W_PAD)
    t = tl.load(positions + b * W + j, mask=j < n, other=0)
    lookup = (j < n) & (t != newest)
    s = tl.load(slot_of + row * MAX_CTX + t, mask=lookup, other=-1)  # hits: the token has a slot
    hit, miss = lookup & (s >= 0), lookup & (s < 0)
    tl.store(last_used + row * B + s, tl.zeros([W_PAD], tl.int32) + clock, mask=hit)
    tl.debug_barrier()
    i = tl.arange(0, B_PAD)
    held = tl.load(token + row * B + i, mask=i < B, other=-1)
    used = tl.load(last_used + row * B + i, mask=i < B, other=0)
    free = (i < B) & (used != clock)
    age = tl.where(held < 0, -1, used)  # empty slots first, then the least recently used
    older = (age[None, :] < age[:, None]) | ((age[None, :] == age[:, None]) & (i[None, :] < i[:, None]))
    before = free[None, :] & older  # [slot, other]: the free slots ranked ahead of each slot
    victim_slot = free & (tl.sum(before.to(tl.int32), axis=1) < tl.sum(miss.to(tl.int32), axis=0))
    tl.store(scratch + b * B_PAD + tl.cumsum(victim_slot.to(tl.int32), axis=0) - 1, i, mask=victim_slot)
    tl.debug_barrier()
    victim = tl.load(scratch + b * B_PAD + tl.cumsum(miss.to(tl.int32), axis=0) - 1, mask=miss, other=0)
    old = tl.load(token + row * B + victim, mask=miss, other=-1)  # the victim's old token is forgotten
    tl.store(slot_of + row * MAX_CTX + old, tl.full([W_PAD], -1, tl.int32), mask=miss & (old >= 0))
    tl.debug_barrier()
    tl.store(slot_of + row * MAX_CTX + t, victim, mask=miss)
    tl.store(token + row * B + victim, t, mask=miss)
    tl.store(last_used + row * B + victim, tl.zeros([W_PAD], tl.int32) + clock, mask=miss)
    src = tl.load(req_to_token + row * R2T_W + t, mask=miss, other=0).to(tl.int64)  # the token's host row
    d = tl.arange(0, HD_PAD)
    copy = miss[:, None] & (d < HD)[None, :]
    dst = (base + victim).to(tl.int64)[:, None] * HD + d[None, :]
    tl.store(hot_k + dst, tl.load(host_k + src[:, None] * HD + d[None, :], mask=copy), mask=copy)
    tl.store(hot_v + dst, tl.load(host_v + src[:, None] * HD + d[None, :], mask=copy), mask=copy)
    slot = tl.where(t == newest, B, tl.where(hit, s, victim))
    tl.store(table + b * W + j, tl.where(j < n, base + slot, 0).to(tl.int32), mask=j < W)


def teaching_swap_in(hot, layer, rows, positions, counts, seq_lens, host, req_to_token):
    """``HotBuffer.swap_in`` (the torch reference) as one launch: the table int32 ``[bs, W]``, the state updated."""
    bs, width = positions.shape
    table = torch.zeros(bs, width, dtype=torch.int32, device=positions.device)
    hot.clock[layer] += 1
    b_pad, hd = triton.next_power_of_2(hot.size), hot.k[layer].shape[1] * hot.k[layer].shape[2]
    scratch = torch.empty(bs, b_pad, dtype=torch.int32, device=positions.device)
    teaching_swap_in_kernel[(bs,)](positions, counts, seq_lens, rows, req_to_token, host.k[layer], host.v[layer],
                                   hot.k[layer], hot.v[layer], hot.token[layer], hot.last_used[layer],
                                   hot.slot_of[layer], scratch, table, hot.clock[layer:layer + 1], width,
                                   req_to_token.shape[1], hot.slot_of.shape[2], B=hot.size, HD=hd,
                                   W_PAD=triton.next_power_of_2(width), B_PAD=b_pad, HD_PAD=triton.next_power_of_2(hd))
    return table
