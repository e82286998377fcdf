"""Lesson kernel of notebook 10: the offload swap-in, one program per request row.

Five steps, each a small function: ``look_up`` the row's tokens in ``slot_of`` (token -> hot slot; a hit is
stamped with this step's ``clock``), ``rank_victims`` (the free slots ranked by counting: empty first, then
least recently used, then a lower slot id; the ``m`` first are the victims of the row's ``m`` misses),
``record_misses`` (each miss forgets its victim's old token and records its own), ``copy_in`` (the misses'
K/V rows from the host pool), then the row's page-size-1 table. The steps pass data through global memory
(the stamps, the scratch row of victims), read by other threads of the program than those that wrote it:
``tl.debug_barrier()`` between them makes every thread's writes visible before any thread reads.
The package's ``sparse_ref.kernels.swap_in`` picks the same victims without the ``n²`` counting:
it keeps each row's slots in eviction order (``HotBuffer.lru``) and takes the first ones this step does
not use; it also writes the new token and copies in a second, wider launch. ``tests/test_lessons.py``
holds this kernel equal to the torch reference ``HotBuffer.swap_in``.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def look_up(slot_of_row, last_used_row, t, lookup, clock):
    """Step 1: each token's slot (-1: not held). A hit is stamped with this step's clock (so it is not free)."""
    s = tl.load(slot_of_row + t, mask=lookup, other=-1)
    hit, miss = lookup & (s >= 0), lookup & (s < 0)
    tl.store(last_used_row + s, tl.zeros_like(s) + clock, mask=hit)
    return s, hit, miss


@triton.jit
def rank_victims(token_row, last_used_row, scratch_row, clock, misses, B, B_PAD: tl.constexpr):
    """Step 2: the free slots (not used this step) ranked by counting, for each, the free slots ahead of it
    (empty first, then least recently used, then a lower slot id); the ``misses`` first are the victims, stored
    in slot order in ``scratch_row``."""
    i = tl.arange(0, B_PAD)
    held = tl.load(token_row + i, mask=i < B, other=-1)
    used = tl.load(last_used_row + i, mask=i < B, other=0)
    free = (i < B) & (used != clock)
    age = tl.where(held < 0, -1, used)  # empty slots first, then the least recently used
    older = (age[None, :] < age[:, None]) | ((age[None, :] == age[:, None]) & (i[None, :] < i[:, None]))
    ahead = tl.sum((free[None, :] & older).to(tl.int32), axis=1)  # the free slots ranked ahead of each slot
    victim_slot = free & (ahead < misses)
    tl.store(scratch_row + tl.cumsum(victim_slot.to(tl.int32), axis=0) - 1, i, mask=victim_slot)


@triton.jit
def record_misses(token_row, last_used_row, slot_of_row, scratch_row, t, miss, clock):
    """Step 3: the i-th miss takes the i-th victim: the victim's old token is forgotten, the miss's recorded."""
    victim = tl.load(scratch_row + tl.cumsum(miss.to(tl.int32), axis=0) - 1, mask=miss, other=0)
    old = tl.load(token_row + victim, mask=miss, other=-1)
    tl.store(slot_of_row + old, tl.full(old.shape, -1, tl.int32), mask=miss & (old >= 0))
    tl.debug_barrier()  # every old token is forgotten before any new one is recorded
    tl.store(slot_of_row + t, victim, mask=miss)
    tl.store(token_row + victim, t, mask=miss)
    tl.store(last_used_row + victim, tl.zeros_like(victim) + clock, mask=miss)
    return victim


@triton.jit
def copy_in(host_k, host_v, hot_k, hot_v, src, dst, miss, HD: tl.constexpr, HD_PAD: tl.constexpr):
    """Step 4: each miss's K/V row from its host row ``src`` to its hot slot ``dst`` (``HD`` values each)."""
    d = tl.arange(0, HD_PAD)
    copy = miss[:, None] & (d < HD)[None, :]
    to = dst[:, None] * HD + d[None, :]
    tl.store(hot_k + to, tl.load(host_k + src[:, None] * HD + d[None, :], mask=copy), mask=copy)
    tl.store(hot_v + to, tl.load(host_v + src[:, None] * HD + d[None, :], mask=copy), mask=copy)


@triton.jit
def teaching_swap_in_kernel(positions, counts, seq_lens, rows, req_to_token, host_k, host_v, hot_k, hot_v, token,
                            last_used, slot_of, scratch, table, clock_ptr, W, R2T_W, MAX_CTX, B: tl.constexpr,
                            HD: tl.constexpr, W_PAD: tl.constexpr, B_PAD: tl.constexpr, HD_PAD: tl.constexpr):
    b = tl.program_id(0)  # one program per request row of the batch
    row = tl.load(rows + b).to(tl.int64)
    n, newest, clock = tl.load(counts + b), tl.load(seq_lens + b) - 1, tl.load(clock_ptr)
    token_row, last_used_row, slot_of_row = token + row * B, last_used + row * B, slot_of + row * MAX_CTX
    scratch_row, base = scratch + b * B_PAD, 1 + row * (B + 1)  # the row's hot slots; slot B: the newest token
    j = tl.arange(0, W_PAD)
    t = tl.load(positions + b * W + j, mask=j < n, other=0)  # the tokens this step reads
    s, hit, miss = look_up(slot_of_row, last_used_row, t, (j < n) & (t != newest), clock)
    tl.debug_barrier()  # the hits' stamps are in memory before step 2 reads every slot's stamp
    rank_victims(token_row, last_used_row, scratch_row, clock, tl.sum(miss.to(tl.int32), axis=0), B, B_PAD)
    tl.debug_barrier()  # the victims are in the scratch row before step 3 reads them back
    victim = record_misses(token_row, last_used_row, slot_of_row, scratch_row, t, miss, clock)
    src = tl.load(req_to_token + row * R2T_W + t, mask=miss, other=0).to(tl.int64)  # the token's host row
    copy_in(host_k, host_v, hot_k, hot_v, src, (base + victim).to(tl.int64), miss, HD, HD_PAD)
    slot = tl.where(t == newest, B, tl.where(hit, s, victim))  # step 5: the row's page-size-1 table
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
