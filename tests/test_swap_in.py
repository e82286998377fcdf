"""The offload swap-in kernel (``sparse_ref.kernels.swap_in``) equals the torch reference (``HotBuffer.swap_in``).

Both start from an empty buffer and see the same selections, step after step: rows that keep most of their
tokens, rows whose selection changes wholesale, dense rows, a row forgotten and reused, the newest token;
the tables, the slots each token ends up in, and every K/V byte of the buffer must be identical.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import sparse_ref
from sparse_ref.adaptor import Metadata
from sparse_ref.errors import PoolError, SparseRefError
from sparse_ref.kernels.swap_in import swap_in
from sparse_ref.offload import HostKVPool, HotBuffer, lru_order, positions_read

DEVICE = sparse_ref.default_device()


def selection(selected, lengths, sparse_mask, page_size, width):
    """The all-on-device metadata the swap-in reads: the selection, and a page table ``width`` tokens wide."""
    table = torch.zeros(selected.shape[0], width // max(page_size, 1), dtype=torch.int32, device=selected.device)
    return Metadata(table, None, page_size, selected, lengths, sparse_mask)


def decode_batch(rows, seq_lens, new_loc):
    """What the swap-in reads of a decode batch."""
    return SimpleNamespace(req_pool_indices=rows, seq_lens=seq_lens, out_cache_loc=new_loc)


def kernel_swap_in(hot, host, r2t, rows, positions, counts, seq_lens, new_k, new_v, new_loc):
    """The kernel on ``hot``'s layer-0 state (the same layout the reference keeps), given the positions read
    (a selection of single tokens: page size 1, every row sparse)."""
    md = selection(positions, counts, torch.ones_like(counts, dtype=torch.bool), 1, positions.shape[1])
    table, n = swap_in(hot, 0, md, decode_batch(rows, seq_lens, new_loc), (new_k, new_v), host, r2t)
    assert torch.equal(n, counts)
    return table


def padded(positions, width):
    pos = torch.zeros((len(positions), width), dtype=torch.int32)
    for b, p in enumerate(positions):
        pos[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
    return pos, torch.tensor([len(p) for p in positions], dtype=torch.int32)


def step(ref, kern, host_ref, host_kern, r2t, rows, positions, seq_lens, width, new_k, new_v):
    """One swap-in on both sides; the new tokens come in through each side's write path."""
    pos, counts = padded(positions, width)
    rows_t, seq_t = torch.tensor(rows), torch.tensor(seq_lens)
    new_loc = r2t[rows_t, seq_t - 1].long()
    host_ref.k[0][new_loc], host_ref.v[0][new_loc] = new_k, new_v  # the write path (TokenToKVPool.set_kv)
    ref.write_newest(0, rows_t, new_k, new_v)
    table_ref = ref.swap_in(0, rows_t, pos, counts, seq_t, host_ref, r2t)
    on = {"device": DEVICE}
    table = kernel_swap_in(kern, host_kern, r2t.to(**on), rows_t.to(**on), pos.to(**on), counts.to(**on),
                           seq_t.to(**on), new_k.to(**on), new_v.to(**on), new_loc.to(**on))
    assert torch.equal(table.cpu(), table_ref.cpu())
    for name in ("token", "last_used", "slot_of", "lru", "clock", "stats"):
        assert torch.equal(getattr(kern, name).cpu(), getattr(ref, name).cpu()), name
    assert torch.equal(kern.k[0].cpu(), ref.k[0].cpu()) and torch.equal(kern.v[0].cpu(), ref.v[0].cpu())
    assert torch.equal(host_kern.k[0], host_ref.k[0]) and torch.equal(host_kern.v[0], host_ref.v[0])


@pytest.mark.parametrize("size, seed", [(6, 0), (16, 1), (13, 2)])
def test_kernel_equals_the_reference_over_many_steps(size, seed):
    rows, max_ctx, width, heads, dim = 3, 40, 20, 2, 3
    g = torch.Generator().manual_seed(seed)
    host_ref = HostKVPool(1 + rows * max_ctx, 1, heads, dim)
    host_ref.k[0].copy_(torch.randn(host_ref.k[0].shape, generator=g))
    host_ref.v[0].copy_(torch.randn(host_ref.v[0].shape, generator=g))
    host_kern = HostKVPool(1 + rows * max_ctx, 1, heads, dim)
    host_kern.k[0].copy_(host_ref.k[0])
    host_kern.v[0].copy_(host_ref.v[0])
    r2t = (1 + torch.randperm(rows * max_ctx, generator=g)).int().view(rows, max_ctx)  # shuffled slots
    ref = HotBuffer(1, rows, size, heads, dim, max_ctx)
    kern = HotBuffer(1, rows, size, heads, dim, max_ctx, device=DEVICE)
    seq = [10, 25, 5]
    for it in range(12):
        seq = [s + 1 for s in seq]
        positions = []
        for b in range(rows):
            if seq[b] <= size:  # a short row reads everything (dense)
                positions.append(list(range(seq[b])))
                continue
            keep = min(size, width) - 1
            pool = torch.randperm(seq[b] - 1, generator=g)[:keep] if it % 4 == 3 else \
                torch.arange(max(0, seq[b] - 1 - keep), seq[b] - 1)  # mostly a sliding window, sometimes a jump
            positions.append(sorted(pool.tolist()) + [seq[b] - 1])
        new_k, new_v = torch.randn(rows, heads, dim, generator=g), torch.randn(rows, heads, dim, generator=g)
        order = [2, 0, 1] if it % 2 else [0, 1, 2]  # batch order is not row order
        step(ref, kern, host_ref, host_kern, r2t, order, [positions[r] for r in order], [seq[r] for r in order],
             width, new_k, new_v)
        if it == 6:  # row 1's request leaves; a new one starts in its row
            ref.forget(1)
            kern.forget(1)
            seq[1] = 3
    assert 0 < ref.misses < ref.hits + ref.misses


def test_kernel_lists_pages_and_dense_rows_as_positions_read_does():
    """Page size 4: a sparse row's kept pages (the last one cut at seq_len), a row kept nothing (dense), a row
    the mask leaves dense and longer than the table (cut at the width): the kernel's table and counts equal
    positions_read + the reference, step after step, with the selection moving."""
    rows, page, size, max_ctx, heads, dim = 3, 4, 24, 64, 1, 2
    g = torch.Generator().manual_seed(3)
    host_ref, host_kern = HostKVPool(1 + rows * max_ctx, 1, heads, dim), HostKVPool(1 + rows * max_ctx, 1, heads, dim)
    host_ref.k[0].copy_(torch.randn(host_ref.k[0].shape, generator=g))
    host_ref.v[0].copy_(torch.randn(host_ref.v[0].shape, generator=g))
    host_kern.k[0].copy_(host_ref.k[0])
    host_kern.v[0].copy_(host_ref.v[0])
    r2t = (1 + torch.randperm(rows * max_ctx, generator=g)).int().view(rows, max_ctx)
    ref, kern = HotBuffer(1, rows, size, heads, dim, max_ctx), HotBuffer(1, rows, size, heads, dim, max_ctx,
                                                                          device=DEVICE)
    on = {"device": DEVICE}
    for it, first in enumerate((0, 2, 7, 1)):
        seq = torch.tensor([41 + it, 10 + it, 30 + it])
        last = int(seq[0] - 1) // page  # the newest token's page: kept pages stop there
        pages = sorted({p for p in (first, first + 3, first + 5) if p < last} | {last})
        selected = torch.tensor([pages + [-1] * (6 - len(pages)), [-1] * 6, [2, 3, -1, -1, -1, -1]],
                                dtype=torch.int32)
        lengths, mask = torch.tensor([len(pages), 0, 2], dtype=torch.int32), torch.tensor([True, True, False])
        rows_t, width = torch.tensor([1, 0, 2]), 6 * page
        positions, counts = positions_read(selected, lengths, mask, seq, page, width)
        new_k, new_v = torch.randn(rows, heads, dim, generator=g), torch.randn(rows, heads, dim, generator=g)
        new_loc = r2t[rows_t, seq - 1].long()
        host_ref.k[0][new_loc], host_ref.v[0][new_loc] = new_k, new_v
        ref.write_newest(0, rows_t, new_k, new_v)
        want = ref.swap_in(0, rows_t, positions, counts, seq, host_ref, r2t)
        table, n = swap_in(kern, 0, selection(selected.to(**on), lengths.to(**on), mask.to(**on), page, width),
                           decode_batch(rows_t.to(**on), seq.to(**on), new_loc.to(**on)),
                           (new_k.to(**on), new_v.to(**on)), host_kern, r2t.to(**on))
        assert n.tolist() == counts.tolist() and counts.tolist()[1:] == [10 + it, width]
        assert torch.equal(table.cpu(), want.cpu())
        for name in ("token", "last_used", "slot_of", "lru", "stats"):
            assert torch.equal(getattr(kern, name).cpu(), getattr(ref, name).cpu()), (it, name)
        assert torch.equal(kern.k[0].cpu(), ref.k[0].cpu())
    assert 0 < ref.misses < ref.hits


def test_lru_list_is_the_eviction_order_of_the_stamps():
    """The kept list is what ``lru_order`` derives from ``token`` and ``last_used``: empty slots first by slot
    id, then the least recently used, ties by slot id (checked by hand on one row)."""
    token = torch.tensor([[5, -1, 7, 9, -1, 2]], dtype=torch.int32)
    last_used = torch.tensor([[3, 0, 1, 3, 0, 1]], dtype=torch.int32)
    assert lru_order(token, last_used).tolist() == [[1, 4, 2, 5, 0, 3]]
    hot = HotBuffer(2, 3, 6, 1, 1, 8)
    assert hot.lru.tolist() == [[list(range(6))] * 3] * 2


def test_refuses_bad_state_before_launch():
    """Each wrong argument is named; nothing (not even the clock) changes before the refusal."""
    hot = HotBuffer(1, 2, 4, 1, 2, 16, device=DEVICE)
    host = HostKVPool(33, 1, 1, 2)
    on = {"device": DEVICE}
    chosen = dict(selected=torch.zeros(2, 5, dtype=torch.int32, **on), lengths=torch.ones(2, dtype=torch.int32, **on),
                  sparse_mask=torch.ones(2, dtype=torch.bool, **on), page_size=1, width=5)
    r2t = torch.arange(1, 33, dtype=torch.int32, **on).view(2, 16)
    batch = decode_batch(torch.arange(2, **on), torch.ones(2, dtype=torch.int64, **on), r2t[:, 0].long())
    new_kv = (torch.zeros(2, 1, 2, **on), torch.zeros(2, 1, 2, **on))

    def call(hot=hot, new_kv=new_kv, **change):
        return swap_in(hot, 0, selection(*{**chosen, **change}.values()), batch, new_kv, host, r2t)

    for name, bad in (("selected", chosen["selected"].long()), ("lengths", chosen["lengths"][:1]),
                      ("sparse_mask", chosen["lengths"]), ("page_size", 0)):
        with pytest.raises(SparseRefError, match=name):
            call(**{name: bad})
    with pytest.raises(SparseRefError, match="new_k"):
        call(new_kv=(new_kv[0][:1], new_kv[1]))
    for name, bad in (("lru", hot.lru[:, :, :3].contiguous()), ("clock", torch.zeros(1, dtype=torch.int64, **on)),
                      ("stats", torch.zeros(2, dtype=torch.int32, **on)), ("size", 0),
                      ("last_used", hot.last_used.long()), ("last_used", hot.last_used[:, :, :3].contiguous()),
                      ("hot", [hot.k[0][: 1 + 2 * 4]])):  # K/V one slot short a row: 1 + rows x size
        broken = SimpleNamespace(**{**vars(hot), "k" if name == "hot" else name: bad})
        with pytest.raises(SparseRefError, match=name):
            call(hot=broken)
    assert int(hot.clock[0]) == 0 and hot.hits == hot.misses == 0
    call()  # the same arguments, all good: it runs
    assert int(hot.clock[0]) == 1 and hot.hits == 2  # each row reads its newest token (position 0): a hit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_reads_and_writes_the_pinned_host_pool_directly():
    """On a GPU the host pool stays in pinned host memory: the kernel reads the missed rows from it and writes
    the new tokens into it directly (no copy engine, no host sync)."""
    rows, size, max_ctx = 2, 8, 32
    host = HostKVPool(1 + rows * max_ctx, 1, 2, 4)
    assert host.k[0].is_pinned()
    host.k[0].copy_(torch.randn(host.k[0].shape))
    host.v[0].copy_(torch.randn(host.v[0].shape))
    r2t = torch.arange(1, 1 + rows * max_ctx, dtype=torch.int32).view(rows, max_ctx).cuda()
    kern = HotBuffer(1, rows, size, 2, 4, max_ctx, device="cuda")
    positions = torch.tensor([[0, 3, 5, 9], [1, 2, 6, 19]], dtype=torch.int32, device="cuda")
    new_k, new_v = torch.randn(2, 2, 4, device="cuda"), torch.randn(2, 2, 4, device="cuda")
    new_loc = r2t[[0, 1], [19, 19]].long()
    table = kernel_swap_in(kern, host, r2t, torch.tensor([0, 1], device="cuda"), positions,
                           torch.tensor([4, 4], dtype=torch.int32, device="cuda"),
                           torch.tensor([20, 20], device="cuda"),
                           new_k, new_v, new_loc)
    torch.cuda.synchronize()
    assert torch.equal(host.k[0][new_loc.cpu()], new_k.cpu()) and torch.equal(host.v[0][new_loc.cpu()], new_v.cpu())
    got = kern.k[0][table.long().view(-1)].cpu()
    want = host.k[0][r2t.cpu()[[0, 0, 0, 0, 1, 1, 1, 1], positions.cpu().view(-1).long()].long()]
    assert torch.equal(got, want)
    assert kern.hits == 1 and kern.misses == 7  # row 1's newest token (19) is the only hit


# ---------------------------------------------------------------- the swap-in never touches another request's state
def swap_in_case(page=4, size=8, rows=3, max_ctx=32):
    """A hot buffer on the device, its host pool, req_to_token, and a valid two-row call at page size ``page``."""
    on = {"device": DEVICE}
    hot, host = HotBuffer(1, rows, size, 1, 2, max_ctx, device=DEVICE), HostKVPool(1 + rows * max_ctx, 1, 1, 2)
    host.k[0].copy_(torch.randn(host.k[0].shape))
    r2t = torch.arange(1, 1 + rows * max_ctx, dtype=torch.int32, **on).view(rows, max_ctx)
    seq = torch.tensor([10, 9], **on)
    call = dict(selected=torch.tensor([[0, 2], [1, 2]], dtype=torch.int32, **on),
                lengths=torch.tensor([2, 2], dtype=torch.int32, **on),
                sparse_mask=torch.ones(2, dtype=torch.bool, **on), page_size=page, width=2 * page,
                rows=torch.tensor([0, 1], **on), seq_lens=seq, new_loc=r2t[[0, 1], seq - 1].long(), r2t=r2t)
    return hot, host, call


def run_swap_in(hot, host, c):
    new = torch.zeros(c["rows"].shape[0], 1, 2, device=DEVICE)
    batch = decode_batch(c["rows"], c["seq_lens"], c["new_loc"])
    return swap_in(hot, 0, selection(c["selected"], c["lengths"], c["sparse_mask"], c["page_size"], c["width"]), batch,
                   (new, new), host, c["r2t"])


def state(hot, host):
    return [t.clone().cpu() for t in (hot.token, hot.last_used, hot.slot_of, hot.lru, hot.clock, hot.stats,
                                      hot.k[0], host.k[0])]


BAD_CALLS = {
    "row out of range": lambda c: {"rows": torch.tensor([0, 3], device=DEVICE)},
    "row listed twice": lambda c: {"rows": torch.tensor([1, 1], device=DEVICE)},
    "page -1 inside lengths": lambda c: {"selected": torch.tensor([[0, 2], [-1, 2]], dtype=torch.int32,
                                                                    device=DEVICE)},
    "a page past the request": lambda c: {"selected": torch.tensor([[0, 2], [1, 3]], dtype=torch.int32,
                                                                     device=DEVICE)},
    "a page twice": lambda c: {"selected": torch.tensor([[0, 0], [1, 2]], dtype=torch.int32, device=DEVICE)},
    "pages out of order": lambda c: {"selected": torch.tensor([[2, 0], [1, 2]], dtype=torch.int32, device=DEVICE)},
    "lengths past the selection": lambda c: {"lengths": torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)},
    "a dense row past the buffer": lambda c: {"sparse_mask": torch.tensor([False, True], device=DEVICE),
                                              "width": 16},
    "a slot past the host pool": lambda c: {"r2t": c["r2t"] + 1000},
    "a slot equal to the host pool's size": lambda c: {"r2t": c["r2t"].index_fill(1, torch.tensor([0], device=DEVICE),
                                                                                  97)},  # host: 1 + 3 x 32 slots
    "a row of seq_len 0": lambda c: {"seq_lens": torch.tensor([10, 0], device=DEVICE), "sparse_mask":
                                     torch.tensor([True, False], device=DEVICE)},
    "a row one past max_context_len": lambda c: {"seq_lens": torch.tensor([10, 33], device=DEVICE)},
    "the newest token on the padding slot": lambda c: {"new_loc": torch.zeros(2, dtype=torch.int64, device=DEVICE)},
    "another request's new-token slot": lambda c: {"new_loc": c["new_loc"].flip(0)},
    "a stale batch (row 0 reused since)": lambda c: {"r2t": torch.cat([c["r2t"][:1] + 64, c["r2t"][1:]])},
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_the_swap_in_refuses_bad_inputs_before_any_state_changes(name):
    hot, host, call = swap_in_case()
    before = state(hot, host)
    with pytest.raises(SparseRefError):
        run_swap_in(hot, host, {**call, **BAD_CALLS[name](call)})
    assert all(torch.equal(a, b) for a, b in zip(before, state(hot, host), strict=True)), name
    run_swap_in(hot, host, call)  # the same buffer, good inputs: it runs
    assert int(hot.clock[0]) == 1


def test_an_unchecked_page_minus_one_never_reaches_the_row_before():
    """Value checks skipped (a CUDA graph, or a caller that checked the batch): row 1 selecting page -1 once rewrote
    row 0's slot map entries 12-15; the kernel reads no position below 0, so row 0's state is untouched."""
    from sparse_ref.checks import values_checked

    hot, host, call = swap_in_case()
    run_swap_in(hot, host, call)  # row 0 holds its tokens now
    row0 = [t[:, 0].clone() for t in (hot.token, hot.last_used, hot.slot_of, hot.lru)]
    bad = {**call, "rows": torch.tensor([1], device=DEVICE), "seq_lens": call["seq_lens"][1:],
           "new_loc": call["new_loc"][1:], "lengths": call["lengths"][1:], "sparse_mask": call["sparse_mask"][1:],
           "selected": torch.tensor([[-1, 2]], dtype=torch.int32, device=DEVICE)}
    with values_checked():
        table, counts = run_swap_in(hot, host, bad)
    assert all(torch.equal(a, t[:, 0]) for a, t in zip(row0, (hot.token, hot.last_used, hot.slot_of, hot.lru),
                                                       strict=True))
    assert int(counts[0]) == 1  # page 2 holds token 8 below seq_len 9 (the newest); page -1 adds nothing


@pytest.mark.parametrize("case", ["sparse without its last page", "dense cut at the width"])
def test_size_plus_one_reads_fit_only_with_the_newest_token(case):
    """A row has ``size`` slots and the newest token's reserved one: ``size + 1`` reads fit only when the newest
    token is one of them. A sparse row without its last page, or a dense row cut at the table's width, reading
    ``size + 1`` tokens is refused before anything changes (it once took an uninitialised victim)."""
    hot, host, call = swap_in_case(page=3, size=8)  # row 0: seq_len 10, the newest (9) on page 3; row 1: 9
    three = torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32, device=DEVICE)
    bad = {**call, "selected": three, "lengths": torch.tensor([3, 3], dtype=torch.int32, device=DEVICE),
           "width": 12}
    if case == "dense cut at the width":
        bad.update(sparse_mask=torch.tensor([False, True], device=DEVICE), width=9)
    before = state(hot, host)
    with pytest.raises(SparseRefError, match="hot.size"):
        run_swap_in(hot, host, bad)
    assert all(torch.equal(a, b) for a, b in zip(before, state(hot, host), strict=True))
    good = {**bad, "selected": torch.tensor([[1, 2, 3], [0, 1, 2]], dtype=torch.int32, device=DEVICE),
            "sparse_mask": torch.ones(2, dtype=torch.bool, device=DEVICE), "width": 12}
    table, counts = run_swap_in(hot, host, good)  # row 0 reads 7 of pages 1-3 (with its newest), row 1 its 9
    assert counts.tolist() == [7, 9]


def test_lengths_past_the_slot_maps_context_are_refused():
    """A hot buffer built for a shorter context than req_to_token holds: a row past it would write the next row's
    slot map (the lengths were checked against req_to_token's width)."""
    _, host, call = swap_in_case()
    hot = HotBuffer(1, 3, 8, 1, 2, 8, device=DEVICE)  # max_context_len 8; the batch's rows reach 10 and 9
    before = state(hot, host)
    with pytest.raises(SparseRefError, match="seq_lens"):
        run_swap_in(hot, host, call)
    assert all(torch.equal(a, b) for a, b in zip(before, state(hot, host), strict=True))


@pytest.mark.parametrize("which", ["new_v", "hot_v", "host_v"])
def test_the_v_side_is_checked_as_the_k_side(which):
    hot, host, call = swap_in_case()
    new = torch.zeros(2, 1, 2, device=DEVICE)
    new_v = torch.zeros(2, 1, 3, device=DEVICE) if which == "new_v" else new
    if which == "hot_v":
        hot.v[0] = hot.v[0][:-1].contiguous()
    if which == "host_v":
        host.v[0] = torch.zeros(host.v[0].shape[0], 2, 2)
    batch = decode_batch(call["rows"], call["seq_lens"], call["new_loc"])
    md = selection(call["selected"], call["lengths"], call["sparse_mask"], call["page_size"], call["width"])
    with pytest.raises(SparseRefError, match=which.replace("_", " ") if which == "host_v" else which):
        swap_in(hot, 0, md, batch, (new, new_v), host, call["r2t"])
    assert int(hot.clock[0]) == 0


def test_the_reference_refuses_a_row_that_wraps():
    """``rows=[-1]`` once wrote the last row's reserved slot (another request's state), in both the write path and
    the reference swap-in; an unread position or a buffer too small is refused before the clock moves."""
    hot = HotBuffer(1, 3, 4, 1, 2, 16)
    k = torch.ones(1, 1, 2)
    with pytest.raises(PoolError, match="rows"):
        hot.write_newest(0, torch.tensor([-1]), k, k)
    host, r2t = HostKVPool(49, 1, 1, 2), torch.arange(1, 49, dtype=torch.int32).view(3, 16)
    positions, counts, seq = torch.tensor([[0, 1, 2, 3, 4, 5]]), torch.tensor([6]), torch.tensor([7])
    with pytest.raises(PoolError, match="rows"):
        hot.swap_in(0, torch.tensor([-1]), positions, counts, seq, host, r2t)
    with pytest.raises(SparseRefError, match="hot.size"):  # six besides the newest, four slots
        hot.swap_in(0, torch.tensor([2]), positions, counts, seq, host, r2t)
    with pytest.raises(PoolError, match="positions"):
        hot.swap_in(0, torch.tensor([2]), torch.tensor([[0, 9]]), torch.tensor([2]), seq, host, r2t)
    assert int(hot.clock[0]) == 0 and not hot.k[0].any()


@pytest.mark.parametrize("size", [8, 600])  # one chunk of READY_CHUNK table entries a row; three
def test_the_copies_flag_every_chunk_of_the_batch_rows_and_no_other(size):
    """After a swap-in every chunk flag of the batch's rows is 0, "copied" (the bookkeeping sets each to minus its
    copy units, each unit counts itself in; attention waits for 0), whatever it held before; the rows past the batch
    keep theirs. The reference swap-in leaves them at 0 (nothing copies later)."""
    hot, host, call = swap_in_case(size=size, max_ctx=700)
    assert tuple(hot.ready.shape) == (3, -(-(size + 1) // 256)) and bool((hot.ready == 0).all())
    hot.ready.fill_(7)  # (a value neither launch writes)
    run_swap_in(hot, host, call)
    assert bool((hot.ready[:2] == 0).all()) and bool((hot.ready[2] == 7).all())
    ref = HotBuffer(1, 3, size, 1, 2, 700)
    ref.swap_in(0, call["rows"].cpu(), *positions_read(call["selected"].cpu(), call["lengths"].cpu(),
                                                       call["sparse_mask"].cpu(), call["seq_lens"].cpu(), 4, 8),
                call["seq_lens"].cpu(), HostKVPool(1 + 3 * 700, 1, 1, 2), call["r2t"].cpu())
    assert bool((ref.ready == 0).all())
