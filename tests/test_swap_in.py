"""The offload swap-in kernel (``sparse_ref.kernels.swap_in``) equals the torch reference (``HotBuffer.swap_in``).

Both start from an empty buffer and see the same selections, step after step: rows that keep most of their
tokens, rows whose selection changes wholesale, dense rows, a row forgotten and reused, the newest token;
the tables, the slots each token ends up in, and every K/V byte of the buffer must be identical.
"""

from __future__ import annotations

import pytest
import torch

import sparse_ref
from sparse_ref.errors import SparseRefError
from sparse_ref.kernels.swap_in import swap_in
from sparse_ref.offload import HostKVPool, HotBuffer

DEVICE = sparse_ref.default_device()


class KernelBuffer:
    """The device state the kernel keeps: per row, each slot's token and last use, and token -> slot."""

    def __init__(self, rows, size, max_ctx, ref: HotBuffer):
        self.size, self.ref = size, ref
        self.token = torch.full((rows, size), -1, dtype=torch.int32, device=DEVICE)
        self.last_used = torch.zeros((rows, size), dtype=torch.int32, device=DEVICE)
        self.slot_of = torch.full((rows, max_ctx), -1, dtype=torch.int32, device=DEVICE)
        self.k = torch.zeros_like(ref.k[0], device=DEVICE)
        self.v = torch.zeros_like(ref.v[0], device=DEVICE)

    def forget(self, row):
        self.token[row] = -1
        self.last_used[row] = 0
        self.slot_of[row] = -1


def step(ref, kern, host, r2t, rows, positions, seq_lens, width):
    table_ref, _ = ref.swap_in(0, rows, positions, seq_lens, host, r2t, width)
    pos = torch.full((len(rows), width), -1, dtype=torch.int32)
    for b, p in enumerate(positions):
        pos[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
    counts = torch.tensor([len(p) for p in positions], dtype=torch.int32)
    on = {"device": DEVICE}
    table = swap_in(pos.to(**on), counts.to(**on), torch.tensor(seq_lens, dtype=torch.int32, **on),
                    torch.tensor(rows, dtype=torch.int32, **on), r2t.to(**on), host.k[0].to(**on), host.v[0].to(**on),
                    kern.k, kern.v, kern.token, kern.last_used, kern.slot_of, ref.clock, kern.size)
    assert torch.equal(table.cpu(), table_ref.cpu())
    assert torch.equal(kern.token.cpu().long(), ref.token[0])
    assert torch.equal(kern.last_used.cpu().long(), ref.last_used[0])
    held = kern.token.cpu() >= 0
    assert torch.equal(kern.k.cpu()[1:].view(len(kern.token), -1, *kern.k.shape[1:])[:, :-1][held],
                       ref.k[0][1:].view(len(kern.token), -1, *kern.k.shape[1:])[:, :-1][held])


@pytest.mark.parametrize("size, seed", [(6, 0), (16, 1), (13, 2)])
def test_kernel_equals_the_reference_over_many_steps(size, seed):
    rows, max_ctx, width = 3, 40, 20
    g = torch.Generator().manual_seed(seed)
    host = HostKVPool(1 + rows * max_ctx, 1, 2, 3)
    host.k[0].copy_(torch.randn(host.k[0].shape, generator=g))
    host.v[0].copy_(torch.randn(host.v[0].shape, generator=g))
    r2t = (1 + torch.randperm(rows * max_ctx, generator=g)).int().view(rows, max_ctx)  # shuffled slots
    ref = HotBuffer(1, rows, size, 2, 3)
    kern = KernelBuffer(rows, size, max_ctx, ref)
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
        for b in range(rows):  # the newest token, written by the write path into the reserved slot
            src = r2t[b, seq[b] - 1].long()
            ref.write_newest(0, [b], host.k[0][src][None], host.v[0][src][None])
            kern.k[1 + b * (size + 1) + size] = host.k[0][src].to(DEVICE)
            kern.v[1 + b * (size + 1) + size] = host.v[0][src].to(DEVICE)
        step(ref, kern, host, r2t, [0, 1, 2], positions, seq, width)
        if it == 6:  # row 1's request leaves; a new one starts in its row
            ref.forget(1)
            kern.forget(1)
            seq[1] = 3


def test_refuses_bad_state_before_launch():
    with pytest.raises(SparseRefError, match="positions"):
        swap_in(torch.zeros(2, 3, dtype=torch.int64, device=DEVICE), *([None] * 12), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_reads_the_pinned_host_pool_directly():
    """On a GPU the host pool stays in pinned host memory: the kernel reads the missed rows from it directly."""
    rows, size, max_ctx = 2, 8, 32
    host = HostKVPool(1 + rows * max_ctx, 1, 2, 4)
    assert host.k[0].is_pinned()
    host.k[0].copy_(torch.randn(host.k[0].shape))
    host.v[0].copy_(torch.randn(host.v[0].shape))
    r2t = torch.arange(1, 1 + rows * max_ctx, dtype=torch.int32).view(rows, max_ctx).cuda()
    ref = HotBuffer(1, rows, size, 2, 4, device="cuda")
    kern = KernelBuffer(rows, size, max_ctx, ref)
    positions = torch.tensor([[0, 3, 5, 9], [1, 2, 6, 7]], dtype=torch.int32, device="cuda")
    table = swap_in(positions, torch.tensor([4, 4], dtype=torch.int32, device="cuda"),
                    torch.tensor([20, 20], dtype=torch.int32, device="cuda"),
                    torch.tensor([0, 1], dtype=torch.int32, device="cuda"), r2t, host.k[0], host.v[0], kern.k, kern.v,
                    kern.token, kern.last_used, kern.slot_of, 1, size)
    torch.cuda.synchronize()
    got = kern.k[table.long().view(-1)].cpu()
    want = host.k[0][r2t.cpu()[[0, 0, 0, 0, 1, 1, 1, 1], positions.cpu().view(-1).long()].long()]
    assert torch.equal(got, want)
