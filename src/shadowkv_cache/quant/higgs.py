"""HIGGS-style vector quantiser for KV head vectors (YAKV mode, design.md §4).

Legend: D head dim, p grid dimension, M = D/p sub-vectors per head vector, N vectors, "..." leading dims.

A head vector `x` is rotated by an orthonormal Hadamard matrix with a fixed random sign flip, scaled by
`sqrt(D)/||x||` so that its coordinates are close to N(0, 1), cut into `M` sub-vectors of `p` coordinates,
and each sub-vector is replaced by the index of its nearest point in a 256-point grid fitted to N(0, 1)
samples by Lloyd's algorithm. Storage is one uint8 code per sub-vector plus the fp16 norm: `8/p + 16/D`
bits per value (4.125 / 2.125 / 1.125 at D = 128 for p = 2 / 4 / 8).

Grids are built here, deterministically from a seed (nothing is downloaded), cached in memory and, when
the cache directory is writable, on disk as a few KiB per grid. The points of 4-D grids (YAKV's scoring codes) are
rounded to multiples of 1/32 (quant/lattice.py), so that the scoring kernels multiply codes on integer tensor cores
exactly (kernels/score_codes.cu); other grids are kept as fitted.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..paths import cache_dir
from .lattice import LATTICE, to_lattice

__all__ = [
    "GRID_DIMS",
    "GRID_POINTS",
    "HiggsQuantizer",
    "QuantizedVectors",
    "check_tables",
    "gaussian_grid",
    "higgs_quantizer",
]

GRID_POINTS = 256  # one uint8 code per sub-vector
GRID_DIMS = (2, 4, 8)

# Lloyd fit: 2^15 seeded Gaussian samples (128 per point) and 40 iterations keep the build under ~3 s on one
# CPU core; the distortion is then measured on 2^16 fresh samples. Bump _GRID_VERSION whenever any of this
# changes so that grids cached on disk are rebuilt instead of trusted.
_FIT_SAMPLES = 1 << 15
_FIT_ITERS = 40
_EVAL_SAMPLES = 1 << 16
_GRID_VERSION = 4
_LATTICE_GRID_DIMS = (4,)  # grids whose points are on the 1/32 lattice (quant/lattice.py): the scoring codes'
# Nearest-point search works on this many sub-vectors at a time: the distance block is at most
# 2^17 x 256 float32 = 128 MiB whatever the input size. On the CPU a 4 MiB block stays in cache between the
# matmul and the argmin (measured 2.5x faster on one core than 2^17 rows).
_SEARCH_CHUNK = 1 << 17
_SEARCH_CHUNK_CPU = 1 << 12


@dataclass
class QuantizedVectors:
    """Codes and norms of quantised head vectors.

    Attributes:
        codes (`torch.Tensor`): `[..., M]` uint8, the grid point of each sub-vector of the rotated vector.
        norms (`torch.Tensor`): `[...]` fp16, the Euclidean norm of each original vector.
    """

    codes: torch.Tensor
    norms: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of storage (codes + norms)."""
        return self.codes.numel() * self.codes.element_size() + self.norms.numel() * self.norms.element_size()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantizedVectors:
        """Both tensors moved to `device`."""
        return QuantizedVectors(
            self.codes.to(device, non_blocking=non_blocking), self.norms.to(device, non_blocking=non_blocking)
        )


def _nearest(points: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid point of each row of `points` `[N, p]` in `grid` `[256, p]`, as int64 `[N]`.

    ||x - g||^2 = ||x||^2 - 2 x.g + ||g||^2 and ||x||^2 is the same for every g, so the argmin needs only the
    matmul; done in chunks so that memory stays bounded.
    """
    half_sq = 0.5 * (grid * grid).sum(-1)
    out = torch.empty(points.shape[0], dtype=torch.int64, device=points.device)
    chunk = _SEARCH_CHUNK_CPU if points.device.type == "cpu" else _SEARCH_CHUNK
    for start in range(0, points.shape[0], chunk):
        block = points[start : start + chunk]
        # addmm: ||g||^2/2 - x.g in one pass over the block.
        out[start : start + block.shape[0]] = torch.addmm(half_sq, block, grid.T, alpha=-1).argmin(-1)
    return out


def _product_init(dim: int) -> torch.Tensor:
    """A `256 x dim` product of equal-probability scalar levels of N(0, 1): a good start for Lloyd in 2-D."""
    levels = round(GRID_POINTS ** (1.0 / dim))
    mids = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    scalar = (math.sqrt(2.0) * torch.erfinv(2.0 * mids - 1.0)).float()
    axes = torch.meshgrid(*([scalar] * dim), indexing="ij")
    return torch.stack([a.reshape(-1) for a in axes], -1)


def _fit_grid(dim: int, seed: int) -> tuple[torch.Tensor, float]:
    """Lloyd's algorithm on seeded N(0, I_dim) samples; returns the grid and its per-coordinate MSE."""
    gen = torch.Generator().manual_seed(seed)
    samples = torch.randn(_FIT_SAMPLES, dim, generator=gen)
    # In 2-D a product start converges faster to the near-hexagonal optimum; in 4-D and 8-D the product grid
    # is a fixed point of Lloyd (the hypercube), so the start is seeded samples instead.
    grid = _product_init(dim) if dim == 2 else samples[:GRID_POINTS].clone()
    for _ in range(_FIT_ITERS):
        assign = _nearest(samples, grid)
        sums = torch.zeros_like(grid).index_add_(0, assign, samples)
        counts = torch.bincount(assign, minlength=GRID_POINTS).to(grid.dtype)
        filled = counts > 0  # an empty cell keeps its point
        grid[filled] = sums[filled] / counts[filled, None]
    if dim in _LATTICE_GRID_DIMS:  # exact int8 for the integer tensor cores; the distortion is measured after
        grid = to_lattice(grid)
    held_out = torch.randn(_EVAL_SAMPLES, dim, generator=gen)
    mse = (held_out - grid[_nearest(held_out, grid)]).square().mean().item()
    return grid, mse


def _disk_path(dim: int, seed: int) -> Path:
    return cache_dir() / "grids" / f"higgs-v{_GRID_VERSION}-p{dim}-n{GRID_POINTS}-seed{seed}.safetensors"


@functools.cache
def gaussian_grid(dim: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """The 256-point grid fitted to N(0, I_dim) with `seed`, and its per-coordinate MSE on fresh samples.

    Returns:
        `(grid, mse)`: grid `[256, dim]` float32 on the CPU (shared; do not modify), mse a float.
    """
    if dim not in GRID_DIMS:
        raise ValueError(f"grid dimension must be one of {GRID_DIMS}, got {dim}")
    path = _disk_path(dim, seed)
    if path.is_file():
        try:
            saved = load_file(path)
            if saved["grid"].shape == (GRID_POINTS, dim) and saved["grid"].dtype == torch.float32:
                return saved["grid"], float(saved["mse"])
        except Exception:  # noqa: BLE001 - a damaged cache file is rebuilt, whatever the damage
            pass
    grid, mse = _fit_grid(dim, seed)
    try:  # best effort: a read-only cache directory only costs a rebuild per process
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"grid": grid, "mse": torch.tensor(mse)}, tmp)
        os.replace(tmp, path)
    except OSError:
        pass
    return grid, mse


@functools.cache
def _hadamard(dim: int) -> torch.Tensor:
    """Sylvester Hadamard matrix `[dim, dim]` scaled to be orthonormal (and symmetric)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).float()


class HiggsQuantizer:
    """Quantise head vectors of dimension `head_dim` to one of 256 grid points per `grid_dim` coordinates.

    Args:
        head_dim (`int`): D, a power of two.
        grid_dim (`int`): p in {2, 4, 8}, dividing D; 8/p bits per value plus 16/D for the fp16 norm.
        seed (`int`): seeds both the sign flip of the rotation and the grid fit.

    Attributes:
        grid (`torch.Tensor`): `[256, p]` float32, the grid points (multiples of 1/`LATTICE` at p = 4; CPU; copies
            per device are cached).
        expected_distortion (`float`): the grid's per-coordinate MSE on N(0, 1) samples, i.e. about the
            relative squared error `||x - x_hat||^2 / ||x||^2` of a round trip (a little above it at p = 2).

    Legend: D head dim, p grid dim, M = D/p sub-vectors, "..." leading dims (broadcast where stated).
    """

    def __init__(self, head_dim: int, grid_dim: int = 2, seed: int = 0) -> None:
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two (the Hadamard rotation needs one), got {head_dim!r}")
        if grid_dim not in GRID_DIMS:
            raise ValueError(f"grid_dim must be one of {GRID_DIMS} (~4 / 2 / 1 bits per value), got {grid_dim!r}")
        if head_dim % grid_dim:
            raise ValueError(f"grid_dim {grid_dim} must divide head_dim {head_dim}; use a smaller grid_dim")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.head_dim, self.grid_dim, self.seed = head_dim, grid_dim, seed
        self.num_subvectors = head_dim // grid_dim
        grid, self.expected_distortion = gaussian_grid(grid_dim, seed)
        self.grid = grid
        signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed + 1_000_003))
        self._signs = (1 - 2 * signs).float()
        self._rotation = self._signs[:, None] * _hadamard(head_dim)  # row i of H times sign i
        self._device_cache: dict[tuple[str, str], torch.Tensor] = {}

    def identity(self) -> dict:
        """What decides the codes (JSON, for prefix files): head dim, grid dim, seed, the rotation's signs (a string of
        `0`/`1` for +/-) and the grid (`256·p` floats, rounded to 6 decimals)."""
        grid = [round(v, 6) for v in self.grid.flatten().tolist()]
        signs = "".join("1" if s < 0 else "0" for s in self._signs.tolist())
        return {"head_dim": self.head_dim, "grid_dim": self.grid_dim, "seed": self.seed, "signs": signs, "grid": grid}

    def matches(self, saved: object) -> bool:
        """Whether codes made by the quantiser of `identity() == saved` decode correctly with this one. The grid is a
        Lloyd fit in float32 that other machines may round differently in its last bits, which can move a point by
        one rounding step: at p = 4 the saved points must lie on the lattice (multiples of 1/`LATTICE`, which the
        grids of earlier versions do not) and each may be one lattice step away; other grids' points may differ by
        1e-4 plus one fp16 step (2^-10 relative). Another grid differs by far more."""
        if not isinstance(saved, dict):
            return False
        mine = self.identity()
        grid = saved.get("grid")
        if not (
            {k: v for k, v in saved.items() if k != "grid"} == {k: v for k, v in mine.items() if k != "grid"}
            and isinstance(grid, list)
            and len(grid) == len(mine["grid"])
            and all(isinstance(a, int | float) for a in grid)
        ):
            return False
        if self.grid_dim in _LATTICE_GRID_DIMS:
            return all(abs(a * LATTICE - round(a * LATTICE)) <= 1e-4 for a in grid) and all(
                abs(a - b) <= 1e-4 + 1 / LATTICE for a, b in zip(grid, mine["grid"])
            )
        return all(abs(a - b) <= 1e-4 + abs(b) * 2**-10 for a, b in zip(grid, mine["grid"]))

    @property
    def bits_per_value(self) -> float:
        """Storage bits per vector coordinate: `8/p + 16/D` exactly."""
        return 8 / self.grid_dim + 16 / self.head_dim

    def _on(self, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        if key not in self._device_cache:
            self._device_cache[key] = tensor.to(device)
        return self._device_cache[key]

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The grid `[256, p]` and the rotation's sign flips `[D]` (+-1), float32 on `device`, for the kernels.

        Cached per device. The signs come from the rotation already on the device (its first column, since
        `H[:, 0] > 0`), so once `quantize` or `rotate` has run there, this never copies from the host.
        """
        key = ("signs", str(device))
        if key not in self._device_cache:
            self._device_cache[key] = self._on("rotation", self._rotation, device)[:, 0].sign().contiguous()
        return self._on("grid", self.grid, device), self._device_cache[key]

    def _check_last_dim(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            got = f"{type(x).__name__} {getattr(x, 'dtype', '')}"
            raise ValueError(f"{what} must be a floating-point tensor, got {got}")
        if x.ndim == 0 or x.shape[-1] != self.head_dim:
            raise ValueError(f"{what} must have last dimension head_dim={self.head_dim}, got shape {tuple(x.shape)}")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[..., D]` times the signed orthonormal Hadamard matrix; float32 (float64 stays float64)."""
        self._check_last_dim(x, "x")
        dtype = torch.promote_types(x.dtype, torch.float32)
        return x.to(dtype) @ self._on("rotation", self._rotation, x.device).to(dtype)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of `rotate` for `y` `[..., D]` (the transpose, as the rotation is orthonormal)."""
        self._check_last_dim(y, "y")
        dtype = torch.promote_types(y.dtype, torch.float32)
        return y.to(dtype) @ self._on("rotation", self._rotation, y.device).to(dtype).T

    def quantize(self, x: torch.Tensor) -> QuantizedVectors:
        """Codes `[..., M]` uint8 and norms `[...]` fp16 of `x` `[..., D]` (any float dtype, any device).

        The definition; `ops.quantize_higgs.quantize_vectors` computes it in one CUDA kernel where it can.
        """
        self._check_last_dim(x, "x")
        rotated = self.rotate(x.float())
        norms = rotated.norm(dim=-1)
        # A zero vector gets arbitrary codes; its zero norm makes it dequantise to zero.
        scaled = rotated * (math.sqrt(self.head_dim) / norms.clamp_min(torch.finfo(torch.float32).tiny))[..., None]
        codes = _nearest(scaled.reshape(-1, self.grid_dim), self._on("grid", self.grid, x.device))
        return QuantizedVectors(
            codes.to(torch.uint8).reshape(*x.shape[:-1], self.num_subvectors), norms.to(torch.float16)
        )

    def _check_packed(self, packed: QuantizedVectors) -> None:
        if not isinstance(packed, QuantizedVectors):
            raise ValueError(f"expected QuantizedVectors, got {type(packed).__name__}")
        codes, norms = packed.codes, packed.norms
        if codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] != self.num_subvectors:
            raise ValueError(
                f"codes must be uint8 [..., {self.num_subvectors}] for head_dim={self.head_dim}, "
                f"grid_dim={self.grid_dim}; got {codes.dtype} {tuple(codes.shape)}"
            )
        if norms.shape != codes.shape[:-1]:
            raise ValueError(f"norms shape {tuple(norms.shape)} must equal codes shape without its last dim")

    def dequantize(self, packed: QuantizedVectors, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The reconstructed vectors `[..., D]` in `dtype` (computed in float32)."""
        self._check_packed(packed)
        grid = self._on("grid", self.grid, packed.codes.device)
        rotated = grid[packed.codes.long()].flatten(-2)  # [..., D]
        rotated = rotated * (packed.norms.float() / math.sqrt(self.head_dim))[..., None]
        return self.unrotate(rotated).to(dtype)

    def lookup_table(self, query_rot: torch.Tensor) -> torch.Tensor:
        """Dot of each sub-vector of a rotated query `[..., D]` with every grid point: `[..., M, 256]` float32."""
        self._check_last_dim(query_rot, "query_rot")
        sub = query_rot.float().unflatten(-1, (self.num_subvectors, self.grid_dim))
        return sub @ self._on("grid", self.grid, query_rot.device).T

    def score_codes(self, table: torch.Tensor, packed: QuantizedVectors) -> torch.Tensor:
        """`q . dequantize(k)` from codes: `table` `[..., M, 256]` (from `lookup_table(rotate(q))`) and `packed`
        codes `[..., M]` / norms `[...]`, leading dims broadcast; float32 `[...]` (the broadcast shape).

        The rotation is orthonormal, so the dot in the rotated space is the dot in the original space.
        """
        self._check_packed(packed)
        if table.ndim < 2 or table.shape[-2:] != (self.num_subvectors, GRID_POINTS):
            raise ValueError(f"table must be [..., {self.num_subvectors}, {GRID_POINTS}], got {tuple(table.shape)}")
        lead = torch.broadcast_shapes(table.shape[:-2], packed.codes.shape[:-1])
        idx = packed.codes.long().expand(*lead, self.num_subvectors)[..., None]
        dots = table.float().expand(*lead, *table.shape[-2:]).gather(-1, idx).squeeze(-1).sum(-1)
        return dots * (packed.norms.float() / math.sqrt(self.head_dim))


@functools.cache
def higgs_quantizer(head_dim: int, grid_dim: int, seed: int = 0) -> HiggsQuantizer:
    """One shared `HiggsQuantizer(head_dim, grid_dim, seed)` per process: its codes depend on those three alone, so
    any instance with them quantises alike (the operators' twins rebuild the caller's from them)."""
    return HiggsQuantizer(head_dim, grid_dim, seed)


def check_tables(quantizer: HiggsQuantizer, grid: torch.Tensor, signs: torch.Tensor) -> None:
    """Refuse `grid` and `signs` that are not `quantizer.device_tables` (an operator's twin rebuilds its quantiser from
    `(grid_dim, seed)`, where its kernel reads the tables it is given)."""
    want_grid, want_signs = quantizer.device_tables(grid.device)
    if not (torch.equal(grid, want_grid) and torch.equal(signs.to(grid.device), want_signs)):
        raise ValueError(
            f"The grid and signs passed are not those of HiggsQuantizer(head_dim={quantizer.head_dim}, "
            f"grid_dim={quantizer.grid_dim}, seed={quantizer.seed}); pass that quantiser's device_tables()."
        )
