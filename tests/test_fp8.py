"""Block-wise FP8 e4m3 quantisation: scales, the amax floor, ue8m0 powers of two, saturation, round trip."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref.errors import ShapeError, SparseRefError
from sparse_ref.fp8 import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    block_scales,
    dequantize_fp8,
    quantize_fp8,
    round_scale_ue8m0,
)


def test_constants_match_e4m3():
    assert FP8_E4M3_MAX == torch.finfo(FP8_DTYPE).max == 448.0
    assert AMAX_FLOOR == 1e-4


def test_zeros_use_the_amax_floor():
    q, s = quantize_fp8(torch.zeros(3, 256), 128)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (3, 2)
    assert torch.equal(s, torch.full((3, 2), AMAX_FLOOR / FP8_E4M3_MAX))
    assert torch.equal(q.float(), torch.zeros(3, 256))
    # A tiny block is clamped the same way: its scale is not amax / 448 but 1e-4 / 448.
    tiny = torch.full((1, 128), 1e-7)
    assert torch.equal(block_scales(tiny, 128), torch.full((1, 1), AMAX_FLOOR / FP8_E4M3_MAX))


def test_scale_is_amax_over_448_and_amax_maps_to_448():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 384, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1e3, 0.2, 5.0])[:, None]
    q, s = quantize_fp8(x, 128)
    amax = x.view(6, 3, 128).abs().amax(-1)
    torch.testing.assert_close(s, amax / 448.0, rtol=0, atol=0)
    assert torch.equal(q.float().view(6, 3, 128).abs().amax(-1), torch.full((6, 3), 448.0))


def test_ue8m0_scales_are_powers_of_two_rounded_up():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50, 128, generator=gen) * torch.logspace(-6, 4, 50)[:, None]
    x[0] = 0.0
    s = block_scales(x, 128, ue8m0=True)
    exact = block_scales(x, 128, ue8m0=False)
    mantissa, _ = torch.frexp(s)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.all(s >= exact) and torch.all(s < 2 * exact)  # the next power up, not beyond
    # An exact power of two stays as it is; just above it goes to the next one.
    p = torch.tensor([2.0**-10, 0.25, 1.0, 2.0**-10 * 1.0001, 0.3])
    assert torch.equal(round_scale_ue8m0(p), torch.tensor([2.0**-10, 0.25, 1.0, 2.0**-9, 0.5]))
    q, _ = quantize_fp8(x, 128, ue8m0=True)
    assert torch.all(q.float().abs() <= 448.0)  # a larger scale never overflows


def test_block_extremes_map_to_plus_minus_448_never_nan():
    # The block's largest magnitude becomes exactly +-448 (the clamp guards against x / scale rounding
    # a hair past 448; CPU casts saturate anyway, other backends need not).
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 6, 64)[:, None]
    x[:, 7] = x.abs().amax(1) * torch.where(torch.arange(64) % 2 == 0, 1.0, -1.0)  # a +-amax in every row
    q, s = quantize_fp8(x, 128)
    assert not torch.isnan(q.float()).any()
    assert torch.equal(q.float()[:, 7].abs(), torch.full((64,), 448.0))
    assert torch.all(q.float().abs() <= 448.0)


@given(rows=st.integers(1, 6), blocks=st.integers(1, 3), block=st.sampled_from([1, 16, 32, 128]),
       log_scale=st.floats(-8, 8), ue8m0=st.booleans(), seed=st.integers(0, 2**16))
def test_round_trip_error_bound(rows, blocks, block, log_scale, ue8m0, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * block, generator=gen) * 10.0**log_scale
    q, s = quantize_fp8(x, block, ue8m0)
    assert s.shape == (rows, blocks)
    back = dequantize_fp8(q, s, block)
    per_elem_scale = s.repeat_interleave(block, dim=1)
    # 3 mantissa bits: relative error <= 2^-4 in the normal range; subnormal step 2^-9 * scale below it.
    bound = x.abs() * 2.0**-4 + per_elem_scale * 2.0**-10 + 1e-30
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))


def test_bad_shapes_raise():
    with pytest.raises(ShapeError, match="multiple of block_size=128"):
        quantize_fp8(torch.randn(2, 96), 128)
    with pytest.raises(SparseRefError, match="block_size"):
        quantize_fp8(torch.randn(2, 96), 0)
    with pytest.raises(ShapeError, match="dtype"):
        quantize_fp8(torch.ones(2, 128, dtype=torch.int32), 128)
    q, s = quantize_fp8(torch.randn(2, 128), 64)
    with pytest.raises(ShapeError, match="one per block"):
        dequantize_fp8(q, s[:, :1], 64)
    with pytest.raises(ShapeError, match="dtype"):
        dequantize_fp8(q.float(), s, 64)


def test_non_finite_input_is_refused():
    x = torch.randn(2, 128)
    x[1, 5] = float("inf")
    with pytest.raises(SparseRefError, match="x: expected finite values, got 1 inf/NaN"):
        quantize_fp8(x, 128)
    x[1, 5] = float("nan")
    with pytest.raises(SparseRefError, match="finite"):
        quantize_fp8(x, 64)
    q, s = quantize_fp8(torch.full((1, 128), 3.0e38), 128)  # huge but finite: a finite scale, values +-448
    assert torch.isfinite(s).all() and torch.equal(q.float(), torch.full((1, 128), 448.0))
