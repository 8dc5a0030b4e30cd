"""The HIGGS-style quantiser: distortion, bits, determinism, rotation, scoring from codes, bad input.

Legend: N vectors, D head dim, p grid dim, M = D/p sub-vectors.
"""

from __future__ import annotations

import math

import pytest
import torch

import shadowkv_cache.quant.higgs as higgs
from shadowkv_cache.quant import GRID_POINTS, LATTICE, HiggsQuantizer, QuantizedVectors, gaussian_grid, lattice_points

# Per-coordinate MSE of an optimal 256-point quantiser of N(0, I_p) is about 0.0083 / 0.096 / 0.31 for
# p = 2 / 4 / 8 (4 / 2 / 1 bits); scalar Lloyd-Max at the same rate gives 0.0095 / 0.118 / 0.363.
# Our fitted grids must land between the two, below the scalar bound.
SCALAR_BOUND = {2: 0.0095, 4: 0.1175, 8: 0.3634}
NEAR_OPTIMAL = {2: 0.0080, 4: 0.093, 8: 0.30}


@pytest.mark.parametrize("p", [2, 4, 8])
def test_grid_distortion_is_near_gaussian_optimal(p):
    grid, mse = gaussian_grid(p)
    assert grid.shape == (GRID_POINTS, p) and grid.dtype == torch.float32
    assert NEAR_OPTIMAL[p] < mse < SCALAR_BOUND[p]


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dim", [64, 128])
def test_round_trip_error_matches_grid_distortion(p, dim):
    q = HiggsQuantizer(dim, p, seed=0)
    gen = torch.Generator().manual_seed(7)
    # Gaussian vectors of varied scale with a few large coordinates: the rotation spreads them out.
    x = torch.randn(8192, dim, generator=gen) * torch.rand(8192, 1, generator=gen).mul(10).add(0.1)
    x[:, 3] *= 8
    x_hat = q.dequantize(q.quantize(x), torch.float32)
    rel = ((x - x_hat).square().sum(-1) / x.square().sum(-1)).mean().item()
    # Scaling to norm sqrt(D) puts the rotated vector on a sphere, whose coordinates have slightly lighter
    # tails than N(0, 1): the round trip is at most the grid's Gaussian distortion and a little below it at
    # 4 bits (measured: -11% at D = 64, -7% at D = 128 for p = 2; within 2% for p = 4, 8).
    assert 0.85 * q.expected_distortion < rel < 1.03 * q.expected_distortion


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_bits_per_value_accounted_exactly(p, dim):
    q = HiggsQuantizer(dim, p)
    assert q.bits_per_value == 8 / p + 16 / dim
    shape = (3, 5, 7)
    packed = q.quantize(torch.randn(*shape, dim))
    assert packed.codes.shape == (*shape, dim // p) and packed.codes.dtype == torch.uint8
    assert packed.norms.shape == shape and packed.norms.dtype == torch.float16
    values = math.prod(shape) * dim
    assert packed.nbytes * 8 == q.bits_per_value * values
    counted = packed.codes.numel() * packed.codes.element_size() + packed.norms.numel() * packed.norms.element_size()
    assert counted == packed.nbytes
    if dim == 128:
        assert q.bits_per_value == {2: 4.125, 4: 2.125, 8: 1.125}[p]


def test_same_seed_same_grid_and_codes():
    a, b = HiggsQuantizer(64, 4, seed=3), HiggsQuantizer(64, 4, seed=3)
    x = torch.randn(512, 64)
    assert torch.equal(a.grid, b.grid)
    assert torch.equal(a.quantize(x).codes, b.quantize(x).codes)
    # The fit itself is deterministic, not only the cache: a fresh build equals the cached grid.
    grid, mse = higgs._fit_grid(4, 3)
    assert torch.equal(grid, a.grid) and mse == a.expected_distortion
    other = HiggsQuantizer(64, 4, seed=4)
    assert not torch.equal(other.grid, a.grid)
    assert not torch.equal(other.rotate(x), a.rotate(x))


def test_rotation_is_orthonormal_inverse_and_norm_preserving():
    q = HiggsQuantizer(128, 2, seed=0)
    x = torch.randn(64, 128, dtype=torch.float64)
    y = q.rotate(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(q.unrotate(y), x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=1e-6)
    # A signed Hadamard: every entry is +-1/sqrt(D), and the seeded sign flip makes it differ from H and -H.
    matrix = q.rotate(torch.eye(128))
    torch.testing.assert_close(matrix.abs(), torch.full((128, 128), 128**-0.5))
    plain = higgs._hadamard(128)
    assert not torch.equal(matrix, plain) and not torch.equal(matrix, -plain)
    assert q.rotate(x.to(torch.bfloat16)).dtype == torch.float32


def test_zero_vector_dequantises_to_zero():
    q = HiggsQuantizer(32, 2)
    x = torch.zeros(2, 32)
    x[1, 0] = 1.0
    out = q.dequantize(q.quantize(x), torch.float32)
    assert torch.equal(out[0], torch.zeros(32)) and torch.isfinite(out).all()


@pytest.mark.parametrize("p", [2, 4, 8])
def test_score_codes_equals_dot_with_dequantised_keys(p):
    q = HiggsQuantizer(64, p)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, 50, 64, generator=gen) * 4  # [B, Hkv, N, D]
    query = torch.randn(2, 3, 4, 64, generator=gen)  # [B, Hkv, G, D]: G query heads per KV head
    packed = q.quantize(keys)
    table = q.lookup_table(q.rotate(query))  # [B, Hkv, G, M, 256]
    assert table.shape == (2, 3, 4, 64 // p, GRID_POINTS)
    scores = q.score_codes(
        table[:, :, :, None], QuantizedVectors(packed.codes[:, :, None], packed.norms[:, :, None])
    )  # [B, Hkv, G, N]
    expected = query @ q.dequantize(packed, torch.float32).transpose(-1, -2)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4)


def test_dequantize_dtype_and_device_of_inputs():
    q = HiggsQuantizer(16, 2)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    packed = q.quantize(x)
    assert q.dequantize(packed).dtype == torch.bfloat16
    assert q.dequantize(packed, torch.float16).dtype == torch.float16


def test_bad_input_raises():
    with pytest.raises(ValueError, match="power of two"):
        HiggsQuantizer(96, 2)
    with pytest.raises(ValueError, match="grid_dim must be one of"):
        HiggsQuantizer(128, 3)
    with pytest.raises(ValueError, match="must divide head_dim"):
        HiggsQuantizer(4, 8)
    q = HiggsQuantizer(32, 4)
    with pytest.raises(ValueError, match="last dimension head_dim=32"):
        q.quantize(torch.randn(3, 16))
    with pytest.raises(ValueError, match="floating-point"):
        q.quantize(torch.ones(3, 32, dtype=torch.int64))
    packed = q.quantize(torch.randn(3, 32))
    with pytest.raises(ValueError, match="codes must be uint8"):
        q.dequantize(QuantizedVectors(packed.codes.long(), packed.norms))
    with pytest.raises(ValueError, match="norms shape"):
        q.dequantize(QuantizedVectors(packed.codes, packed.norms[:2]))
    with pytest.raises(ValueError, match="table must be"):
        q.score_codes(torch.zeros(3, 8, 16), packed)


def test_search_is_chunked(monkeypatch):
    # A chunk smaller than the input must give the same codes as one block.
    q = HiggsQuantizer(32, 2)
    x = torch.randn(300, 32)
    whole = q.quantize(x).codes
    monkeypatch.setattr(higgs, "_SEARCH_CHUNK", 7)
    monkeypatch.setattr(higgs, "_SEARCH_CHUNK_CPU", 7)
    assert torch.equal(q.quantize(x).codes, whole)


def test_scoring_grid_is_on_the_int8_lattice_and_matches_only_lattice_grids():
    """The 4-D grid (YAKV's scoring codes) holds multiples of 1/LATTICE within +-127/LATTICE, so the integer
    tensor-core kernels read its points as exact int8 operands (`lattice_points`); a saved grid matches when it lies on
    the lattice within one step of this one, and a grid of an earlier version (fp16 values off the lattice) does not."""
    q = HiggsQuantizer(128, 4)
    scaled = q.grid * LATTICE
    assert torch.equal(scaled, scaled.round()) and scaled.abs().max() <= 127
    words = lattice_points(q.grid)
    assert words.shape == (256,) and words.dtype == torch.int32
    assert torch.equal(words.view(torch.int8).view(256, 4).float(), scaled)  # coordinate i in byte i
    assert lattice_points(q.grid) is words  # made once per grid tensor
    with pytest.raises(ValueError, match="off that lattice"):
        lattice_points(q.grid + 1 / (4 * LATTICE))
    saved = q.identity()
    assert q.matches(saved)
    moved = dict(saved, grid=[v + (1 / LATTICE if i == 5 else 0) for i, v in enumerate(saved["grid"])])
    assert q.matches(moved)  # a lattice step: another machine's last bits may round one point the other way
    off = dict(saved, grid=[round(v + 3e-3, 6) for v in saved["grid"]])
    assert not q.matches(off)  # fp16 points of grid version 3, say
    far = dict(saved, grid=[v + (2 / LATTICE if i == 5 else 0) for i, v in enumerate(saved["grid"])])
    assert not q.matches(far)
    # On the lattice the grid keeps its distortion (0.09991 against 0.09989 for the same fit off it), on fresh
    # samples too.
    held_out = torch.randn(1 << 16, 4, generator=torch.Generator().manual_seed(7))
    rounded_mse = (held_out - q.grid[higgs._nearest(held_out, q.grid)]).square().mean().item()
    assert NEAR_OPTIMAL[4] < rounded_mse < NEAR_OPTIMAL[4] * 1.08
