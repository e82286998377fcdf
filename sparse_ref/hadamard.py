"""The Walsh–Hadamard transform: a fast, orthonormal rotation that spreads outliers.

``H_n / sqrt(n)`` is orthonormal and symmetric, so it keeps every dot product while mixing each coordinate
into all the others: one large channel becomes ``n`` moderate ones, and the FP8 block scale stops being
dictated by a single outlier (DeepSeek's indexer rotates q and k so before quantising). ``hadamard_matrix``
builds ``H_n`` (Sylvester); ``hadamard_transform`` applies it with the ``O(n log n)`` butterfly.
"""
from __future__ import annotations

import torch

from sparse_ref.checks import check_device, check_float, check_tensor, describe, fail
from sparse_ref.errors import ShapeError


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0  # (True is no size)


def hadamard_matrix(n: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """The unscaled Sylvester Hadamard matrix ``H_n`` (entries +-1): ``H_2n = [[H, H], [H, -H]]``."""
    if not is_power_of_two(n):
        raise ShapeError(f"hadamard_matrix: n must be a power of two, got {n!r}.")
    if not isinstance(dtype, torch.dtype):
        fail("dtype", "a torch.dtype such as torch.float32", describe(dtype), "pass the dtype object, not a string.")
    h = torch.ones(1, 1, dtype=dtype, device=check_device("device", device, ShapeError))
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``(x @ H_n) * scale`` over the last dim, by the fast Walsh–Hadamard butterfly.

    Each of the ``log2(n)`` rounds pairs entries ``h`` apart and replaces ``(a, b)`` by
    ``(a + b, a - b)``. Computed in fp32 (or fp64 for fp64 inputs) and returned in
    ``x.dtype``. ``H_n`` is symmetric, so ``x @ H_n == H_n @ x`` for a vector.
    """
    check_tensor("x", x, dtype=(torch.float32, torch.float64, torch.float16, torch.bfloat16),
                 fix="pass a floating-point tensor whose last dim is a power of two.")
    if x.dim() == 0:
        raise ShapeError("hadamard_transform: x must have at least one dim (the one to transform), got a scalar.")
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ShapeError(
            f"hadamard_transform: the last dim of x must be a power of two, got {n} (shape {tuple(x.shape)}). "
            "Fix: pad the vectors, or choose a head_dim that is a power of two."
        )
    scale = check_float("scale", scale, error=ShapeError)
    work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    lead = work.shape[:-1]
    y = work.reshape(-1, n)
    h = 1
    while h < n:
        # View each row as [n / 2h blocks, 2 halves, h]: the butterfly combines the two halves.
        pairs = y.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack([a + b, a - b], dim=2).reshape(-1, n)
        h *= 2
    return (y * scale).reshape(*lead, n).to(x.dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal rotation the indexer uses: ``hadamard_transform(x, scale=n**-0.5)``."""
    n = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else 1
    return hadamard_transform(x, scale=float(n) ** -0.5)
