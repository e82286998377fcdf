"""The fast Walsh–Hadamard transform against the explicit Sylvester matrix."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_ref.errors import ShapeError
from sparse_ref.hadamard import hadamard_matrix, hadamard_rotate, hadamard_transform


def sylvester_by_formula(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j): an independent way to write the same matrix."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    bits = i & j
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).float()


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64, 128, 256])
def test_matrix_matches_formula_and_is_orthogonal(n):
    h = hadamard_matrix(n)
    assert torch.equal(h, sylvester_by_formula(n))
    assert torch.equal(h @ h.T, n * torch.eye(n))


@given(log_n=st.integers(0, 8), lead=st.lists(st.integers(1, 5), min_size=0, max_size=3), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 0.5, 0.125]))
def test_fast_matches_explicit(log_n, lead, seed, scale):
    n = 2**log_n
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n, generator=gen, dtype=torch.float64)
    want = x @ hadamard_matrix(n, dtype=torch.float64) * scale
    got = hadamard_transform(x, scale=scale)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_fp32_and_low_precision_dtypes():
    x = torch.randn(7, 128)
    want = x.double() @ hadamard_matrix(128, dtype=torch.float64) * 128**-0.5
    torch.testing.assert_close(hadamard_rotate(x).double(), want, rtol=1e-5, atol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        y = hadamard_rotate(x.to(dtype))
        assert y.dtype == dtype
        torch.testing.assert_close(y.double(), (x.to(dtype).double() @ hadamard_matrix(128, torch.float64))
                                   * 128**-0.5, rtol=1e-2, atol=1e-2)


def test_rotation_is_orthonormal_and_an_involution():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 64, generator=gen, dtype=torch.float64), torch.randn(9, 64, generator=gen,
                                                                                dtype=torch.float64)
    torch.testing.assert_close(hadamard_rotate(q) @ hadamard_rotate(k).T, q @ k.T)  # dot products kept
    torch.testing.assert_close(hadamard_rotate(hadamard_rotate(q)), q)  # H/sqrt(n) is its own inverse


def test_spreads_an_outlier():
    x = torch.zeros(128)
    x[17] = 100.0
    y = hadamard_rotate(x)
    assert torch.allclose(y.abs(), torch.full_like(y, 100.0 / 128**0.5))


@pytest.mark.parametrize("n", [3, 6, 12, 100])
def test_non_power_of_two_raises(n):
    with pytest.raises(ShapeError, match="power of two"):
        hadamard_transform(torch.randn(2, n))
    with pytest.raises(ShapeError, match="power of two"):
        hadamard_matrix(n)


def test_bad_inputs_raise():
    with pytest.raises(ShapeError, match="dtype"):
        hadamard_transform(torch.ones(4, dtype=torch.int64))
    with pytest.raises(ShapeError, match="scalar"):
        hadamard_transform(torch.tensor(1.0))
    with pytest.raises(ShapeError, match="torch.Tensor"):
        hadamard_transform([1.0, 2.0])
