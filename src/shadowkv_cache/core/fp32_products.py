"""Matrix products of 16-bit tensors with fp32 sums and an fp32 result, without an fp32 copy of the operands.

The prefill's compression multiplies the whole prompt's keys (`[T, Hkv*D]`, 256 MiB per layer at 128K tokens on
the Llama-3.1-8B shape): upcasting them first writes an fp32 copy twice their size and runs the product on CUDA
cores. On CUDA, `mm`/`bmm` with `out_dtype=float32` multiply 16-bit operands on tensor cores with fp32 sums: each
product of two 16-bit numbers is exact in fp32, so the result is the fp32 product's up to summation order.
"""

from __future__ import annotations

import torch

__all__ = ["matmul_fp32", "project_fp32"]

_OUT_DTYPE = [True]  # whether this torch's CUDA mm/bmm take `out_dtype` (2.8 and later); cleared at first refusal
_HALF = (torch.bfloat16, torch.float16)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` in fp32 for `[M, K] @ [K, N]` or `[G, M, K] @ [G, K, N]`: on tensor cores when both are 16-bit of one
    dtype on CUDA, else through fp32 copies."""
    if a.is_cuda and a.dtype in _HALF and b.dtype == a.dtype and _OUT_DTYPE[0]:
        try:
            return (torch.mm if a.dim() == 2 else torch.bmm)(a, b, out_dtype=torch.float32)
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE[0] = False
    return a.float() @ b.float()


def project_fp32(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """`x @ basis` in fp32 for 16-bit `x` `[T, K]` and fp32 `basis` `[K, R]`. On CUDA the basis is split into a 16-bit
    head and the 16-bit rounding of its remainder, two tensor-core products: the basis then carries ~16 bits more
    than one 16-bit rounding, within a few fp32 ulps of its own precision for the unit-norm eigenvectors it holds."""
    if not (x.is_cuda and x.dtype in _HALF and _OUT_DTYPE[0]):
        return x.float() @ basis.float()
    head = basis.to(x.dtype)
    tail = (basis - head.float()).to(x.dtype)
    return matmul_fp32(x, head) + matmul_fp32(x, tail)
