"""Block-wise FP8 (e4m3) quantisation with one fp32 scale per block, as DeepSeek's ``act_quant``.

Per block of ``block_size`` values: ``amax`` clamped below at ``1e-4`` (an all-zero block gets a finite
scale), ``scale = amax / 448`` (e4m3's largest finite value; ``ue8m0``: rounded up to a power of two),
``q = clamp(x / scale, -448, 448)`` cast to ``float8_e4m3fn`` (out-of-range casts do not saturate on
every backend). Non-finite input is refused; while a CUDA graph captures, that check (a host sync) is
skipped and values are clamped to the fp32 range first. Dequantisation is ``q.float() * scale``: a
normal value comes back within a relative error of ``2**-4``.
"""
from __future__ import annotations

import torch

from sparse_ref.checks import check_tensor, skip_value_checks
from sparse_ref.errors import ShapeError, SparseRefError

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
FP32_MAX = torch.finfo(torch.float32).max


def round_scale_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to the next power of two (an exact power stays as it is).

    ``frexp`` writes ``s = m * 2**e`` with ``m`` in ``[0.5, 1)``; ``s`` is a power of two
    exactly when ``m == 0.5``, and otherwise ``2**e`` is the next power above it.
    """
    mantissa, exponent = torch.frexp(scale)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(scale), exponent)


def block_scales(x: torch.Tensor, block_size: int, ue8m0: bool = False) -> torch.Tensor:
    """fp32 scales ``[..., n // block_size]``: ``max(amax, 1e-4) / 448`` per block (power of two if ue8m0)."""
    blocks = _blocks(x, block_size)
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_E4M3_MAX
    return round_scale_ue8m0(scale) if ue8m0 else scale


def quantize_fp8(x: torch.Tensor, block_size: int = 128, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., n]`` to (``float8_e4m3fn [..., n]``, fp32 scales ``[..., n // block_size]``)."""
    blocks = _blocks(x, block_size)
    if not skip_value_checks() and blocks.numel() and not bool(torch.isfinite(blocks).all()):
        bad = int((~torch.isfinite(blocks)).sum())
        raise SparseRefError(f"x: expected finite values, got {bad} inf/NaN entries. An inf makes its block's scale "
                             "inf (every value of the block NaN or 0). Fix: clip the activations before quantising.")
    blocks = blocks.clamp(-FP32_MAX, FP32_MAX)
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale = amax / FP8_E4M3_MAX
    scale = round_scale_ue8m0(scale) if ue8m0 else scale
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block_size: int = 128) -> torch.Tensor:
    """fp32 values ``q * scale``, block by block (the inverse of ``quantize_fp8`` up to rounding)."""
    check_tensor("q", q, dtype=FP8_DTYPE, fix="pass the first output of quantize_fp8.")
    check_tensor("scale", scale, dtype=torch.float32, fix="pass the second output of quantize_fp8.")
    blocks = _blocks(q, block_size)
    if tuple(scale.shape) != tuple(blocks.shape[:-1]):
        raise ShapeError(
            f"dequantize_fp8: scale must have shape {tuple(blocks.shape[:-1])} (one per block of {block_size}), "
            f"got {tuple(scale.shape)}."
        )
    return (blocks.float() * scale.unsqueeze(-1)).reshape(q.shape)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x`` viewed as ``[..., n // block_size, block_size]`` (fp32 unless it is already fp8)."""
    check_tensor("x", x, dtype=(torch.float32, torch.float16, torch.bfloat16, torch.float64, FP8_DTYPE))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise SparseRefError(f"block_size: expected a positive int, got {block_size!r}.")
    if x.dim() == 0 or x.shape[-1] % block_size:
        n = x.shape[-1] if x.dim() else None
        raise ShapeError(
            f"FP8 quantisation: the last dim of x ({n}, shape {tuple(x.shape)}) must be a positive multiple of "
            f"block_size={block_size}. Fix: pick a block size that divides it."
        )
    if x.shape[-1] == 0:
        raise ShapeError(f"FP8 quantisation: x has an empty last dim (shape {tuple(x.shape)}).")
    view = x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    return view if x.dtype == FP8_DTYPE else view.float()
