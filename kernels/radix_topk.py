"""Lesson kernel of notebook 05, section 1: an exact top-k by radix select, one program per row.

Three steps, each a small ``@triton.jit`` function: ``sortable_key`` (a float's bits as an unsigned key
whose order is the float order), ``walk_from_top`` (one digit of the threshold from a 256-bin
histogram), and ``radix_topk_kernel`` (four digit rounds, then the winners written in id order by one
prefix sum). The whole row lives in registers, so rows of up to a few thousand scores. The package's
``sparse_ref.kernels.topk.topk`` handles any row length; ``tests/test_lessons.py`` holds the two equal.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def sortable_key(x, valid):
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0, so both get the same key
    bits = x.to(tl.uint32, bitcast=True)  # the float's bits, as an unsigned integer
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)  # negative: flip all; else set sign
    ok = valid & (x == x) & (x != float("-inf"))  # NaN != NaN; -inf is never a candidate
    return tl.where(ok, key, tl.zeros_like(key))  # key 0 = "not a candidate"


@triton.jit
def keys_kernel(x_ptr, key_ptr, n, BLOCK: tl.constexpr):
    j = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + j, mask=j < n, other=0.0)
    tl.store(key_ptr + j, sortable_key(x, j < n).to(tl.int32, bitcast=True), mask=j < n)


def sortable_keys(x: torch.Tensor) -> torch.Tensor:
    """The keys of a 1-D fp32 tensor: uint32 bits in an int32 tensor (one program)."""
    keys = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    keys_kernel[(1,)](x, keys, x.numel(), BLOCK=triton.next_power_of_2(max(x.numel(), 16)))
    return keys


@triton.jit
def walk_from_top(hist, k_rem):
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys in bin b or higher
    digit = tl.max(tl.where(at_or_above >= k_rem, bins, 0), axis=0)  # highest bin reaching k_rem
    k_rem = k_rem - tl.sum(tl.where(bins > digit, hist, 0), axis=0)  # bins above it are surely in
    return digit, k_rem


@triton.jit
def radix_topk_kernel(x_ptr, out_ptr, len_ptr, N, K, N_PAD: tl.constexpr, K_PAD: tl.constexpr):
    r = tl.program_id(0)  # this program's row
    j = tl.arange(0, N_PAD)  # every column of the row at once (the row lives in registers)
    length = tl.minimum(tl.load(len_ptr + r), N)  # valid prefix of the row
    x = tl.load(x_ptr + r.to(tl.int64) * N + j, mask=j < length, other=0.0)  # read the row once
    key = sortable_key(x.to(tl.float32), j < length)  # 0 = not a candidate
    k = tl.minimum(K, tl.sum((key != 0).to(tl.int32), axis=0))  # at most as many winners as candidates
    prefix = tl.zeros([], tl.uint32)  # the threshold's digits found so far
    k_rem = k  # how many winners are still to be found at or below that prefix
    for p in tl.static_range(4):  # four 8-bit digits, the top one first
        shift = 24 - 8 * p
        match = (key != 0) & ((key >> shift >> 8) == (prefix >> shift >> 8))  # higher digits equal T's
        digit = ((key >> shift) & 0xFF).to(tl.int32)  # this round's digit of every key
        hist = tl.histogram(digit, 256, mask=match)  # count the matching keys per digit
        d, k_rem = walk_from_top(hist, k_rem)  # the digit of T, and what is left to find
        prefix |= d.to(tl.uint32) << shift  # append it to T
    eq = (key == prefix) & (key != 0)  # the keys equal to T ...
    tie_rank = tl.cumsum(eq.to(tl.int32), axis=0) - 1  # ... ranked by id (prefix sum)
    keep = (key > prefix) | (eq & (tie_rank < k_rem))  # above T, or one of the first k_rem ties
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1  # output slot of each winner: ascending ids
    tl.store(out_ptr + r * K + slot, j, mask=keep)  # the ordered compaction
    w = tl.arange(0, K_PAD)
    tl.store(out_ptr + r * K + w, tl.full([K_PAD], -1, tl.int32), mask=(w >= k) & (w < K))  # -1 padding


def radix_topk(x: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """Launch one program per row: ids of the top-k in ascending id order, -1 padded (int32 [R, k])."""
    R, N = x.shape
    out = torch.empty((R, k), dtype=torch.int32, device=x.device)
    radix_topk_kernel[(R,)](x, out, lengths, N, k, N_PAD=triton.next_power_of_2(N),
                            K_PAD=triton.next_power_of_2(max(k, 1)))
    return out
