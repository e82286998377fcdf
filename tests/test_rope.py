"""RoPE on the first rope_dim dims: both pair layouts against a complex-number reference."""

import pytest
import torch

from sparse_ref.errors import ShapeError, SparseRefError
from sparse_ref.rope import apply_rope


def rope_complex(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float, interleaved: bool):
    """Reference: pair i -> complex number, multiplied by exp(i * pos * theta^(-2i/rope_dim))."""
    x = x.double()
    head = x[..., :rope_dim]
    if interleaved:
        z = torch.view_as_complex(head.reshape(*head.shape[:-1], rope_dim // 2, 2).contiguous())
    else:
        z = torch.complex(head[..., : rope_dim // 2], head[..., rope_dim // 2:])
    freqs = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    ang = positions.double()[:, None] * freqs[None, :]
    if x.dim() == 3:
        ang = ang[:, None, :]
    z = z * torch.polar(torch.ones_like(ang), ang)
    if interleaved:
        rot = torch.view_as_real(z).flatten(-2)
    else:
        rot = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rot, x[..., rope_dim:]], dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,rope_dim", [((7, 32), 16), ((5, 3, 64), 64), ((1, 2, 8), 2), ((0, 16), 8)])
def test_matches_complex_reference(interleaved, shape, rope_dim):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=gen)
    positions = torch.randint(0, 5000, (shape[0],), generator=gen)
    got = apply_rope(x, positions, rope_dim, 10000.0, interleaved)
    want = rope_complex(x, positions, rope_dim, 10000.0, interleaved)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[..., rope_dim:], x[..., rope_dim:])  # the rest passes unchanged


def test_layouts_differ_and_pair_the_documented_dims():
    x = torch.zeros(1, 8)
    x[0, 1] = 1.0  # non-interleaved pairs dim 1 with dim 5; interleaved pairs dim 1 with dim 0
    pos = torch.tensor([1])
    half = apply_rope(x, pos, 8, 10000.0, interleaved=False)
    inter = apply_rope(x, pos, 8, 10000.0, interleaved=True)
    assert half[0, 5] != 0 and half[0, 0] == 0
    assert inter[0, 0] != 0 and inter[0, 5] == 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_relative_positions_and_norms(interleaved):
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 64, generator=gen), torch.randn(1, 64, generator=gen)
    def dot(m, n):
        return float(apply_rope(q, torch.tensor([m]), 64, 10000.0, interleaved)
                     @ apply_rope(k, torch.tensor([n]), 64, 10000.0, interleaved).T)
    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-4, abs=1e-4)
    assert dot(10, 3) != pytest.approx(dot(10, 4), rel=1e-3)
    r = apply_rope(q, torch.tensor([1234]), 64, 10000.0, interleaved)
    assert float(r.norm()) == pytest.approx(float(q.norm()), rel=1e-5)


def test_bad_inputs_raise():
    x = torch.randn(3, 16)
    with pytest.raises(SparseRefError, match="rope_dim"):
        apply_rope(x, torch.arange(3), 5)
    with pytest.raises(SparseRefError, match="rope_dim"):
        apply_rope(x, torch.arange(3), 18)
    with pytest.raises(ShapeError, match="3 tokens"):
        apply_rope(x, torch.arange(4), 8)
    with pytest.raises(ShapeError, match="dtype"):
        apply_rope(x, torch.arange(3).float(), 8)
