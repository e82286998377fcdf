"""Rotary position embedding (RoPE) on the first ``rope_dim`` dims of each vector.

Pair ``i`` of coordinates rotates by ``position * theta**(-2i / rope_dim)``, so ``rope(q, m) . rope(k, n)``
depends on the positions only through ``m - n``; dims from ``rope_dim`` on pass unchanged. Which
coordinates pair up is a convention a checkpoint is trained with: **non-interleaved** (``interleaved=False``,
"rotate half": ``(x[i], x[i + rope_dim/2])``), which DeepSeek-V3.2-Exp's lightning indexer uses, and
**interleaved** (``(x[2i], x[2i + 1])``), which DeepSeek's MLA attention uses (``docs/design.md`` 3.6).
Plain frequencies, no YaRN: the indexer only needs the relative-position property.
"""
from __future__ import annotations

import torch

from sparse_ref.checks import check_float, check_int, check_tensor, fail
from sparse_ref.errors import ShapeError


def rope_angles(positions: torch.Tensor, rope_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """Angles ``[T, rope_dim // 2]``: ``positions[t] * theta**(-2i / rope_dim)``.

    fp64, so that cos/sin stay accurate at large positions (an fp32 angle near 10^5 is off by ~10^-2 rad).
    """
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float = 10000.0,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``rope_dim`` dims of ``x`` ``[T, D]`` or ``[T, H, D]`` by ``positions`` ``[T]``.

    Computed in fp32, returned in ``x.dtype``. See the module docstring for the two layouts.
    """
    check_tensor("x", x, dtype=(torch.float32, torch.float16, torch.bfloat16), dims=(2, 3))
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), dims=1, device=x.device.type)
    if positions.shape[0] != x.shape[0]:
        raise ShapeError(f"apply_rope: x has {x.shape[0]} tokens but positions has {positions.shape[0]} entries.")
    D = x.shape[-1]
    rope_dim = check_int("rope_dim", rope_dim, low=0, high=D, error=ShapeError, fix="an even int up to the head dim.")
    if rope_dim % 2:
        fail("rope_dim", f"an even int in [0, {D}] (the head dim)", repr(rope_dim), error=ShapeError)
    theta = check_float("theta", theta, low=0, low_open=True, error=ShapeError)
    if rope_dim == 0:
        return x.clone()
    angles = rope_angles(positions, rope_dim, theta)  # [T, rope_dim/2]
    if x.dim() == 3:
        angles = angles[:, None, :]  # the same rotation for every head of a token
    cos, sin = angles.cos().float(), angles.sin().float()
    xf = x.float()
    rot, rest = xf[..., :rope_dim], xf[..., rope_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., : rope_dim // 2], rot[..., rope_dim // 2:]
    # (a + ib) * (cos + i sin) = (a cos - b sin) + i (a sin + b cos)
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        rotated = torch.stack([ra, rb], dim=-1).flatten(-2)
    else:
        rotated = torch.cat([ra, rb], dim=-1)
    return torch.cat([rotated, rest], dim=-1).to(x.dtype)
