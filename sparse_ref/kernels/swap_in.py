"""The offload swap-in in two Triton launches (bookkeeping per request row, then the copies): no host sync.

``sparse_ref.offload.HotBuffer.swap_in`` in a kernel. The buffer's state lives on the device: per row, the
token each slot holds (``token``, -1 empty), the step it was last used (``last_used``), the reverse map
token -> slot (``slot_of``, -1: not held), the slots in eviction order (``lru``), a step counter (``clock``)
and the hit / miss counts. Each program (one request row):

0. writes the row's new token's K/V into its reserved slot ``B`` and into the host pool (the write path);
1. lists the tokens attention reads from the selection (``positions_read`` in registers: a sparse row's
   kept pages or tokens below ``seq_len``, all of a dense row's) and looks them up in ``slot_of`` (the
   newest token is always in slot ``B``): hits are stamped with this step's ``clock``;
2. takes its ``m`` misses' victims as the first ``m`` slots of its ``lru`` list that this step does not
   use (two prefix sums: no sort, no search) and lists them in slot order; the ``j``-th miss (in position
   order) takes the ``j``-th victim;
3. for each miss: forgets the slot's old token, records the new one and stamps the slot; writes which host
   row each missed entry copies from;
4. writes the row's page-size-1 table (0 past its tokens);
5. rewrites ``lru``: the slots it kept, in their order, then every slot used this step by slot id (they
   share the newest stamp, and ties go by slot id), so the list stays sorted by (empty, last used, slot).

A second launch (``_copy_in_kernel``) copies the missed K/V rows in from the host pool: on a GPU the host pool is
pinned memory, read through unified addressing (no copy engine, no sync). Its ``COPY_PROGRAMS`` programs take the
units of ``COPY_ROWS`` table entries in order (the first entries of every row first), enough of them at once to
keep PCIe busy, and count each unit into its chunk's flag in ``hot.ready`` (the bookkeeping set each to minus its
units): attention launched with the flags starts while the copies run, and each of its programs waits only for
its own entries' chunks (``paged_decode_attention(ready=...)``), which land in the order it reads them. The list
of copies is the buffer's (``hot.copy_list``), not a temporary: attention's buffers may be allocated while the
copy launch still reads it.

It must equal the torch reference bit for bit: the same tables, the same slots replaced, the same K/V.
Each row's state is its own (one program per row), so programs never race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_ref.checks import (
    check_int,
    check_kernel_device,
    check_new_token_slots,
    check_range,
    check_tensor,
    fail,
    skip_value_checks,
)
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels import pdl_options


@triton.jit
def _swap_in_kernel(selected, lengths, sparse_mask, seq_lens, rows, req_to_token, host_k, host_v, hot_k, hot_v,
                    new_k, new_v, new_loc, token, last_used, slot_of, lru, scratch, table, counts, copies, clock_ptr,
                    stats, ready, W, SPAN, SEL_W, R2T_W, MAX_CTX, NC, P: tl.constexpr, B: tl.constexpr,
                    HD: tl.constexpr, W_PAD: tl.constexpr, B_PAD: tl.constexpr, NC_PAD: tl.constexpr,
                    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    c = tl.arange(0, NC_PAD)  # each chunk's flag: minus its copy units (each adds 1 when done; 0: all landed)
    units = tl.cdiv(tl.minimum(tl.maximum(SPAN - c * CHUNK, 0), CHUNK), ROWS)
    tl.store(ready + b.to(tl.int64) * NC + c, -units, mask=c < NC)
    row = tl.load(rows + b).to(tl.int64)
    seq_len, clock = tl.load(seq_lens + b).to(tl.int32), tl.load(clock_ptr)
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
    j = tl.arange(0, W_PAD)  # 1. the positions read: entry j is token j // P of the selection, offset j % P
    kept = tl.load(lengths + b).to(tl.int32)
    sparse = (tl.load(sparse_mask + b) != 0) & (kept > 0)
    page = tl.load(selected + b.to(tl.int64) * SEL_W + j // P, mask=sparse & (j < kept * P), other=0)
    pos = page * P + j % P
    valid = (j < SPAN) & tl.where(sparse, (j < kept * P) & (pos >= 0) & (pos < seq_len), j < seq_len)  # (a page
    # id below 0 would index the row before this one's slot map: never read, whatever arrives unchecked)
    t = tl.where(valid, tl.where(sparse, pos, j), 0)
    tl.store(counts + b, tl.sum(valid.to(tl.int32), axis=0))
    lookup = valid & (t != seq_len - 1)
    s = tl.load(slot_of + row * MAX_CTX + t, mask=lookup, other=-1)
    hit = lookup & (s >= 0)
    miss = lookup & ~hit
    tl.store(last_used + row * B + s, tl.full([W_PAD], 0, tl.int32) + clock, mask=hit)
    tl.debug_barrier()
    # 2. the victims: the first m slots of the LRU list that this step does not use, then in slot order
    p = tl.arange(0, B_PAD)
    order = tl.load(lru + row * B + p, mask=p < B, other=0)
    free = (p < B) & (tl.load(last_used + row * B + order, mask=p < B, other=0) != clock)
    rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    m = tl.sum(miss.to(tl.int32), axis=0)
    flags = scratch + b.to(tl.int64) * (2 * B_PAD)  # [B_PAD] victim flags by slot, then [B_PAD] victims
    tl.store(flags + p, tl.zeros([B_PAD], tl.int32))
    tl.debug_barrier()
    tl.store(flags + order, tl.full([B_PAD], 1, tl.int32), mask=free & (rank < m))
    tl.debug_barrier()
    chosen = tl.load(flags + p) != 0
    tl.store(flags + B_PAD + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, p, mask=chosen)
    tl.debug_barrier()
    tl.atomic_add(stats, tl.sum((valid & ~miss).to(tl.int64), axis=0))
    tl.atomic_add(stats + 1, m.to(tl.int64))
    victim = tl.load(flags + B_PAD + tl.cumsum(miss.to(tl.int32), axis=0) - 1, mask=miss, other=0)
    old = tl.load(token + row * B + victim, mask=miss, other=-1)  # 3. the victims' old tokens are forgotten
    tl.store(slot_of + row * MAX_CTX + old, tl.full([W_PAD], -1, tl.int32), mask=miss & (old >= 0))
    tl.debug_barrier()
    tl.store(slot_of + row * MAX_CTX + t, victim, mask=miss)
    tl.store(token + row * B + victim, t, mask=miss)
    tl.store(last_used + row * B + victim, tl.full([W_PAD], 0, tl.int32) + clock, mask=miss)
    src = tl.load(req_to_token + row * R2T_W + t, mask=miss, other=0)  # the copies for _copy_in_kernel
    tl.store(copies + b.to(tl.int64) * SPAN + j, tl.where(miss, src, -1), mask=j < SPAN)
    slot = tl.where(t == seq_len - 1, B, tl.where(hit, s, victim))  # 4. the table
    tl.store(table + b.to(tl.int64) * W + j, tl.where(valid, base + slot, 0).to(tl.int32), mask=j < SPAN)
    tl.debug_barrier()
    # 5. the LRU list: the slots kept, in order, then the slots used this step (hits and victims) by slot id
    keep = free & (rank >= m)
    tl.store(lru + row * B + rank - m, order, mask=keep)
    now = (p < B) & (tl.load(last_used + row * B + p, mask=p < B, other=0) == clock)
    tl.store(lru + row * B + tl.sum(keep.to(tl.int32), axis=0) + tl.cumsum(now.to(tl.int32), axis=0) - 1, p,
             mask=now)


@triton.jit
def _copy_in_kernel(copies, table, ready, host_k, host_v, hot_k, hot_v, W, SPAN, NC, BS, UNITS, HD: tl.constexpr,
                    CHUNK: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """3b. the missed rows' K/V: unit ``u`` is the ``ROWS`` entries ``u // BS`` of row ``u % BS``; the programs
    take the units in order, so the table's first entries land first, in every row (as attention reads them)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # (its table and flags were written by the launch before this one)
    for u in range(tl.program_id(0), UNITS, tl.num_programs(0)):
        b, j = (u % BS).to(tl.int64), (u // BS) * ROWS + tl.arange(0, ROWS)
        src = tl.load(copies + b * SPAN + j, mask=j < SPAN, other=-1).to(tl.int64)
        go = src >= 0
        dst = tl.load(table + b * W + j, mask=go, other=0).to(tl.int64)
        for d0 in range(0, HD, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            cols = go[:, None] & (d < HD)[None, :]
            tl.store(hot_k + dst[:, None] * HD + d[None, :],
                     tl.load(host_k + src[:, None] * HD + d[None, :], mask=cols), mask=cols)
            tl.store(hot_v + dst[:, None] * HD + d[None, :],
                     tl.load(host_v + src[:, None] * HD + d[None, :], mask=cols), mask=cols)
        tl.debug_barrier()  # every thread's stores happen before the flag counts the unit
        tl.atomic_add(ready + b * NC + (u // BS) * ROWS // CHUNK, 1, sem="release")


def swap_in(hot, layer: int, md, batch, new_kv: tuple, host, req_to_token: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, counts)``: int32 ``[bs, width]``, the hot slots of the tokens each row reads, in order, 0 past
    them, and int32 ``[bs]``, how many each row reads. ``hot``: the hot buffers' state (``HotBuffer``: ``k``,
    ``v``, ``token``, ``last_used``, ``slot_of``, ``lru``, ``clock``, ``stats``, ``size``), updated in place for
    ``layer``; ``md``: the layer's all-on-device metadata (``selected`` int32 ``[bs, S]``, ``lengths``,
    ``sparse_mask``, ``page_size``; ``width``: its ``page_table``'s in tokens), read as ``positions_read`` reads
    it; ``batch``: the decode batch (``req_pool_indices``, ``seq_lens``,
    ``out_cache_loc``); ``new_kv``: the new tokens' ``(k, v)`` ``[bs, H_kv, D]``, written to their reserved slots
    and to ``host.k[layer]`` / ``host.v[layer]`` at ``out_cache_loc``; misses copied in from the host pool.
    No host sync: graph-capturable. The table is ``width`` wide (the all-on-device table's, which attention
    reads), but a program only lists its first ``size + 1`` entries: no row reads more than its buffer and
    its newest token (``check_offload`` sizes the buffer so), and a 128K-wide row in one program cost the
    swap-in 1.9 ms at bs=8 on the H200."""
    selected, lengths, sparse_mask, page_size = md.selected, md.lengths, md.sparse_mask, md.page_size
    width = md.page_table.shape[1] * page_size  # the all-on-device table's width in tokens
    token, last_used, slot_of, lru = (getattr(hot, name)[layer] for name in ("token", "last_used", "slot_of", "lru"))
    clock, size, hot_k, hot_v = hot.clock[layer: layer + 1], hot.size, hot.k[layer], hot.v[layer]
    # the buffers' dtype here, by torch (round to nearest even, as set_kv stores): the kernel then only copies
    new_k, new_v = (t.to(hot_k.dtype).contiguous() if isinstance(t, torch.Tensor) else t for t in new_kv)
    check_swap_in(selected, lengths, sparse_mask, page_size, width, (hot_k, hot_v), (new_k, new_v),
                  (host.k[layer], host.v[layer]), token, last_used, slot_of, lru, clock, hot.stats, size,
                  (hot.ready, hot.ready_chunk, hot.copy_list))
    check_swap_in_values(selected, lengths, sparse_mask, page_size, width, size, batch, token.shape[0],
                         slot_of.shape[1], host.k[layer], req_to_token)
    clock += 1
    bs = selected.shape[0]
    hd = hot_k.shape[1] * hot_k.shape[2]
    table = torch.zeros(bs, width, dtype=torch.int32, device=selected.device)
    counts = torch.empty(bs, dtype=torch.int32, device=selected.device)
    if bs == 0:
        return table, counts
    span = min(width, size + 1)  # a row reads at most its buffer and its newest token (check_offload sizes it so)
    b_pad, w_pad = triton.next_power_of_2(size), triton.next_power_of_2(max(span, 1))
    scratch = torch.empty(bs, 2 * b_pad, dtype=torch.int32, device=selected.device)
    ready, nc = hot.ready, hot.ready.shape[1]  # (nc * hot.ready_chunk >= span: HotBuffer sizes it)
    copies = hot.copy_list.view(-1)[: bs * span].view(bs, span)  # (kept: the copy launch reads it, see above)
    host_k, host_v = host.k[layer], host.v[layer]
    _swap_in_kernel[(bs,)](selected, lengths, sparse_mask, batch.seq_lens, batch.req_pool_indices, req_to_token,
                           host_k, host_v, hot_k, hot_v, new_k, new_v, batch.out_cache_loc, token, last_used, slot_of,
                           lru, scratch, table, counts, copies, clock, hot.stats, ready, width, span,
                           selected.shape[1], req_to_token.shape[1], slot_of.shape[1], nc, P=page_size, B=size, HD=hd,
                           W_PAD=w_pad, B_PAD=b_pad, NC_PAD=triton.next_power_of_2(nc), CHUNK=hot.ready_chunk,
                           ROWS=COPY_ROWS, BLOCK_D=min(triton.next_power_of_2(hd), 1024), num_warps=BOOK_WARPS)
    units = bs * triton.cdiv(span, COPY_ROWS)
    _copy_in_kernel[(min(units, COPY_PROGRAMS),)](copies, table, ready, host_k, host_v, hot_k, hot_v, width, span, nc,
                                                  bs, units, HD=hd, CHUNK=hot.ready_chunk, ROWS=COPY_ROWS,
                                                  BLOCK_D=min(triton.next_power_of_2(hd), 1024), num_warps=8,
                                                  PDL=bool(pdl_options(selected.device)["PDL"]))
    return table, counts


BOOK_WARPS = 16  # warps of the bookkeeping program (H200, 32K, bs=1, the program alone: 43.7 us at 8, 33.5 at 16,
#                  54.7 at 32; the swap-in with its copies 138 us at 4 warps)
COPY_ROWS = 16  # table entries (token rows) of a copy unit (a ready chunk holds several)
COPY_PROGRAMS = 264  # copy programs (two an SM of an H100): the units they keep in flight keep PCIe busy


# ------------------------------ argument checks (each entry point above calls one first)
def check_swap_in(selected, lengths, sparse_mask, page_size, width, hot_kv, new_kv, host_kv, token, last_used,
                  slot_of, lru, clock, stats, size, copy_state) -> None:
    """Shapes and dtypes, without a host sync: the buffer's state of one layer (``token`` ``[rows, size]``, the list
    and the stamps alike, ``slot_of`` ``[rows, max_ctx]``, K and V holding every row's ``size + 1`` slots), the new
    tokens' K and V, the host pool's K and V (the buffers' heads and dims, and dtype)."""
    (hot_k, hot_v), (new_k, new_v), (host_k, host_v) = hot_kv, new_kv, host_kv
    size = check_int("size", size, low=1, high=1 << 16)
    if token.dim() != 2 or token.shape[1] != size or hot_k.dim() != 3 or \
            hot_k.shape[0] < 1 + token.shape[0] * (size + 1):
        fail("hot", f"token [rows, size={size}] and K/V buffers of at least 1 + rows x {size + 1} slots",
             f"token {tuple(token.shape)}, k {tuple(hot_k.shape)}", "pass a HotBuffer (its state is consistent).")
    check_int("page_size", page_size, low=1, high=1 << 10)
    check_int("width", width, low=0, high=(1 << 31) - 1)
    check_tensor("selected", selected, dtype=torch.int32, dims=2, contiguous=True)
    check_tensor("lengths", lengths, dtype=torch.int32, shape=(selected.shape[0],))
    check_tensor("sparse_mask", sparse_mask, dtype=torch.bool, shape=(selected.shape[0],))
    check_tensor("token", token, dtype=torch.int32, dims=2, contiguous=True)
    check_tensor("lru", lru, dtype=torch.int32, shape=tuple(token.shape), contiguous=True)
    check_tensor("last_used", last_used, dtype=torch.int32, shape=tuple(token.shape), contiguous=True)
    check_tensor("slot_of", slot_of, dtype=torch.int32, shape=(token.shape[0], None), contiguous=True)
    check_tensor("hot_k", hot_k, dims=3, contiguous=True)
    check_tensor("hot_v", hot_v, dtype=hot_k.dtype, shape=tuple(hot_k.shape), contiguous=True)
    for name, t in (("new_k", new_k), ("new_v", new_v)):
        check_tensor(name, t, dtype=hot_k.dtype, shape=(selected.shape[0], *hot_k.shape[1:]), contiguous=True)
    check_tensor("host k", host_k, dtype=hot_k.dtype, shape=(None, *hot_k.shape[1:]), contiguous=True,
                 fix="pass the host pool of this layer (its K/V as the hot buffer's: heads, head_dim, dtype).")
    check_tensor("host v", host_v, dtype=hot_k.dtype, shape=tuple(host_k.shape), contiguous=True)
    check_tensor("clock", clock, dtype=torch.int32, shape=(1,))
    check_tensor("stats", stats, dtype=torch.int64, shape=(2,))
    ready, chunk, copy_list = copy_state  # (hot.ready, hot.ready_chunk, hot.copy_list)
    chunk = check_int("hot.ready_chunk", chunk, low=COPY_ROWS, high=1 << 16)
    if chunk % COPY_ROWS:
        fail("hot.ready_chunk", f"a multiple of the copy unit ({COPY_ROWS} entries)", str(chunk), "keep the default.")
    check_tensor("hot.ready", ready, dtype=torch.int32, shape=(token.shape[0], triton.cdiv(size + 1, chunk)),
                 contiguous=True, fix="pass a HotBuffer (its flags: a row per request row, a flag per chunk).")
    check_tensor("hot.copy_list", copy_list, dtype=torch.int32, shape=(token.shape[0] * (size + 1),),
                 fix="pass a HotBuffer (its list of copies: a row of size + 1 per request row).")
    check_kernel_device("selected", selected, "move it with .cuda().")


def check_swap_in_values(selected, lengths, sparse_mask, page_size, width, size, batch, num_rows, max_ctx, host_k,
                         req_to_token):
    """Values (host syncs; skipped while a graph captures or a caller checked the batch): each request row once and
    in range, its length within the slot map's ``max_ctx``, its new token's slot the one req_to_token keeps for it,
    each sparse row naming only its own pages once, each row reading at most its buffer (and its newest token, in
    the reserved slot, where it reads it), and the host pool holding every slot the table names. A bad value never
    reaches another row's state."""
    bs = selected.shape[0]
    if bs == 0 or skip_value_checks():
        return
    rows, seq_lens = batch.req_pool_indices, batch.seq_lens.long()
    check_range("batch.req_pool_indices", rows, 0, num_rows - 1, "rows of the hot buffer (the requests' rows).")
    if rows.unique().numel() != bs:
        fail("batch.req_pool_indices", "each request row once", str(rows.tolist()), "batch each request once.")
    check_range("batch.seq_lens", seq_lens, 1, min(req_to_token.shape[1], max_ctx),
                "each request holds its newest token, within req_to_token and the hot buffer's max_context_len.")
    check_new_token_slots(req_to_token, rows, seq_lens - 1, batch.out_cache_loc, "batch.", SparseRefError)
    check_range("lengths", lengths, 0, selected.shape[1], "at most the selection's width (past it, a row would "
                "read the next row's pages).")
    live = torch.arange(selected.shape[1], device=selected.device)[None, :] < lengths[:, None]
    sparse = (sparse_mask & (lengths > 0))[:, None] & live
    pages = -(-seq_lens // page_size)
    if bool((sparse & ((selected < 0) | (selected >= pages[:, None]))).any()):
        fail("selected", "within lengths, pages of the row's own request: [0, ceil(seq_len / page_size))",
             str(selected.tolist()[:4]), "pass the selection of retrieve_topk for this batch.")
    if bool((sparse[:, 1:] & (selected[:, 1:] <= selected[:, :-1])).any()):  # ascending: each page once, and the
        fail("selected", "each row's kept pages ascending, each once", str(selected.tolist()[:4]),  # tokens read
             "pass retrieve_topk's selection (ascending, -1 padded).")  # form a prefix, as positions_read lists them
    reads = torch.where(sparse, (seq_lens[:, None] - selected.long() * page_size).clamp(0, page_size), 0).sum(1)
    sparse_row = sparse_mask & (lengths > 0)
    reads = torch.where(sparse_row, reads, seq_lens.clamp(max=width))  # (a table cuts at width)
    newest = torch.where(sparse_row, (sparse & (selected.long() == (seq_lens[:, None] - 1) // page_size)).any(1),
                         seq_lens <= width)  # the newest token is read: it takes the reserved slot, not the LRU
    if int((reads - newest.long()).max()) > size:
        fail("hot.size", f"room for every token a row reads but its newest (the reserved slot): at most {size}",
             f"a row reading {int((reads - newest.long()).max())} besides its newest",
             "build the buffer for the largest selection (check_offload).")
    check_range("req_to_token", req_to_token, 0, host_k.shape[0] - 1, "slots of the host pool.")
    check_range("batch.out_cache_loc", batch.out_cache_loc, 1, host_k.shape[0] - 1, "slots of the host pool.")
