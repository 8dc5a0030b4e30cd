"""HIGGS quantisation of head vectors, fused on CUDA (YAKV prefill: host records and the device scoring copy; ShadowKV's
higgs4 host values).

Legend: N vectors, D head dim, p grid dim, M = D/p sub-vectors, "..." leading dims.

`quantize_vectors_reference` is the definition (and the CPU path): `HiggsQuantizer.quantize`, which rotates in
a matmul, materialises the rotated fp32 copy and searches the grid through a `[N*M, 256]` distance block. On
CUDA, `kernels/quantize_higgs.cu` reads each vector once (strided views in place) and writes only its codes and
norm.
"""

from __future__ import annotations

import ctypes
import math

import torch

from ..quant import HiggsQuantizer, QuantizedVectors, check_tables, higgs_quantizer
from .library import define_op
from .loader import kernels_available, load_kernels, strided_grid

__all__ = ["quantize_higgs_op", "quantize_vectors", "quantize_vectors_reference", "vector_strides"]

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_DIM = 256  # the kernel's shared row per warp
_WARPS = 8  # vectors in flight per block of 256 threads
_BLOCKS_PER_SM = 8  # as many as fit (2048 threads at <= 32 registers; <= 21 KiB of shared memory per block)


def quantize_vectors_reference(quantizer: HiggsQuantizer, x: torch.Tensor) -> QuantizedVectors:
    """The PyTorch twin of `quantize_vectors`: `quantizer.quantize(x)`."""
    return quantizer.quantize(x)


def vector_strides(x: torch.Tensor) -> tuple[int, int, int] | None:
    """`(inner, outer_stride, inner_stride)` in elements such that vector `n` of `x` `[..., D]` (leading dims in
    row-major order) starts at `(n // inner) * outer_stride + (n % inner) * inner_stride`, or `None` when the
    leading dims do not fold into two levels (or the last dim is not contiguous)."""
    if x.stride(-1) != 1:
        return None
    levels: list[tuple[int, int]] = []  # (size, stride), outermost first
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue  # any stride: it is never stepped
        if levels and levels[-1][1] == stride * size:
            levels[-1] = (levels[-1][0] * size, stride)
        else:
            levels.append((size, stride))
    if len(levels) > 2:
        return None
    if len(levels) < 2:
        return (levels[0][0] if levels else 1, 0, levels[0][1] if levels else 0)
    (_, outer_stride), (inner, inner_stride) = levels
    return inner, outer_stride, inner_stride


def quantize_vectors(quantizer: HiggsQuantizer, x: torch.Tensor) -> QuantizedVectors:
    """Codes `[..., M]` uint8 and norms `[...]` fp16 of `x` `[..., D]`, as `quantizer.quantize(x)` defines them.

    On CUDA (cuda-python, `SHADOWKV_KERNELS` not 0, D <= 256) one fused kernel; a view whose leading dims fold
    into two strided levels (e.g. `keys[row, :, span]`) is read in place, anything else is made contiguous
    first. Other float dtypes go through float32 first, as the twin does. The kernel's transform and distances
    round in another order than the twin's matmuls: norms agree to float32 round-off (before the one rounding to
    fp16), and a code may differ only where two grid points are equidistant from the sub-vector to round-off.
    Never synchronises with the host.
    """
    quantizer._check_last_dim(x, "x")
    dim = quantizer.head_dim
    if not (kernels_available(x.device) and dim <= _MAX_DIM):
        return quantize_vectors_reference(quantizer, x)
    if not x[..., 0].numel():  # nothing to quantise: empty outputs, no kernel, nothing copied to the device
        return QuantizedVectors(*_codes_like(x, None, None, quantizer.grid_dim, quantizer.seed))
    if x.dtype not in _KERNEL_DTYPES:
        x = x.float()
    if vector_strides(x) is None:
        x = x.contiguous()
    grid, signs = quantizer.device_tables(x.device)
    return QuantizedVectors(*quantize_higgs_op(x, grid, signs, quantizer.grid_dim, quantizer.seed))


def _quantize_twin(x: torch.Tensor, grid: torch.Tensor, signs: torch.Tensor, grid_dim: int, seed: int):
    quantizer = higgs_quantizer(x.shape[-1], grid_dim, seed)
    check_tables(quantizer, grid, signs)
    packed = quantizer.quantize(x)
    return packed.codes, packed.norms


def _codes_like(x: torch.Tensor, grid: torch.Tensor | None, signs: torch.Tensor | None, grid_dim: int, seed: int):
    lead = x.shape[:-1]
    codes = torch.empty((*lead, x.shape[-1] // grid_dim), dtype=torch.uint8, device=x.device)
    return codes, torch.empty(lead, dtype=torch.float16, device=x.device)


@define_op(
    "quantize_higgs(Tensor x, Tensor grid, Tensor signs, int grid_dim, int seed) -> (Tensor, Tensor)",
    cpu=_quantize_twin,
    fake=_codes_like,
)
def quantize_higgs_op(
    x: torch.Tensor, grid: torch.Tensor, signs: torch.Tensor, grid_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.ops.shadowkv.quantize_higgs`: codes `[..., M]` uint8 and norms `[...]` fp16 of `x` `[..., D]` (a dtype
    the kernel takes, leading dims folding into two strided levels, D <= 256) through the kernel. `grid` and `signs`
    are the quantiser's `device_tables`; `(grid_dim, seed)` name it for the twin, which rebuilds it."""
    codes, norms = _codes_like(x, grid, signs, grid_dim, seed)
    n = norms.numel()
    if n == 0:
        return codes, norms
    dim = x.shape[-1]
    inner, outer_stride, inner_stride = vector_strides(x)
    i32, i64, f32 = ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    load_kernels("quantize_higgs", x.device).launch(
        f"quantize_higgs_{_KERNEL_DTYPES[x.dtype]}_p{grid_dim}",
        grid=strided_grid(x.device, -(-n // _WARPS), _BLOCKS_PER_SM),
        block=(32 * _WARPS, 1, 1),
        args=[
            codes,
            norms,
            x,
            (n, i64),
            (inner, i64),
            (outer_stride, i64),
            (inner_stride, i64),
            (dim, i32),
            grid,
            signs,
            (1.0 / math.sqrt(dim), f32),
            (math.sqrt(dim), f32),
        ],
    )
    return codes, norms
