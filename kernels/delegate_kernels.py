"""Lesson kernels of notebook 05, section 3: the delegates of a row and the candidates' bitmask.

``delegates_kernel``: the maximum of each of the ``G`` strided sub-ranges of a row (column maxima of its
``[N / G, G]`` view); the k-th largest delegate is a threshold ``T`` that at least k keys reach.
``bitmask_kernel``: one bit per key, set where the key is a candidate (``>= T``), 32 keys to a word.
These are the first two launches of the package's long-row top-k (``sparse_ref.kernels.topk``:
``threshold.py`` and ``candidates.py``), without its schedule; ``tests/test_lessons.py`` checks them.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def delegates_kernel(x_ptr, dlg_ptr, N: tl.constexpr, G: tl.constexpr):
    r = tl.program_id(0)
    x = tl.load(x_ptr + r * N + tl.arange(0, N))  # the whole (small) row
    dlg = tl.max(tl.reshape(x, [N // G, G]), axis=0)  # column maxima of the [N/G, G] view
    tl.store(dlg_ptr + r * G + tl.arange(0, G), dlg)


@triton.jit
def bitmask_kernel(x_ptr, t_ptr, mask_ptr, N: tl.constexpr):
    r = tl.program_id(0)
    x = tl.load(x_ptr + r * N + tl.arange(0, N))
    hit = (x >= tl.load(t_ptr + r)).to(tl.int32)  # 1 for a candidate
    bit = tl.arange(0, 32)[None, :]
    words = tl.sum(tl.reshape(hit, [N // 32, 32]) << bit, axis=1)  # bit b of word w = element 32w + b
    tl.store(mask_ptr + r * (N // 32) + tl.arange(0, N // 32), words)


def delegates(x: torch.Tensor, G: int) -> torch.Tensor:
    """fp32 ``[R, G]``: column maxima of each row's ``[N / G, G]`` view (N and G powers of two)."""
    out = torch.empty((x.shape[0], G), dtype=x.dtype, device=x.device)
    delegates_kernel[(x.shape[0],)](x.contiguous(), out, N=x.shape[1], G=G)
    return out


def candidate_bits(x: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N / 32]``: bit b of word w is set where ``x[r, 32 w + b] >= T[r]``."""
    words = torch.empty((x.shape[0], x.shape[1] // 32), dtype=torch.int32, device=x.device)
    bitmask_kernel[(x.shape[0],)](x.contiguous(), T.contiguous(), words, N=x.shape[1])  # one T per row, packed
    return words
