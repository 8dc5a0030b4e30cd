"""Landmark logits of a one-token step on tensor cores (design.md §3): from int8 landmarks, ShadowKV's scoring GEMM at
half the bytes; from 16-bit landmarks, the same kernel in place of cuBLAS's GEMM at small batches.

Legend: B batch, Hkv KV heads, G query heads per KV head, T query tokens, C landmarks (chunks), D head dim.

At long context the landmarks are the largest tensor a decode step reads (32 MiB per row and layer in bf16 at 128K
on the Llama-3.1-8B shape, half of a batch-32 step's HBM bytes), and cuBLAS reads them at ~85% of HBM bandwidth, so
only fewer bytes make that GEMM faster. `LandmarkTopK(landmark_format="int8")` stores each landmark as int8 codes
with one fp32 scale (`core.landmarks.quantize_landmarks`); `landmark_logits_int8_reference` is the definition (the
dequantised landmarks times the queries in fp32, rounded to the query's dtype). On CUDA a one-token step runs
`kernels/landmark_logits.cu` (tensor cores, the codes converted in registers); anything else runs the twin, which
converts the codes to fp32 at every call: on CUDA, outside the kernel's shapes (multi-token sparse steps, more than 8
query heads per KV head, head dims other than 64, 128 and 256, fp32 models) int8 landmarks cost more than native ones.

16-bit landmarks (`landmark_format="native"`) are read as they are by the same kernel with bf16 or fp16 MMAs
(`landmark_logits_native`, defined by `landmark_logits_native_reference`). cuBLAS reads them near HBM bandwidth at
large batches, but a one-token step's GEMM at small batches needs its query rows padded to 8 (a fill and a copy) and
came with a memset node after which the device idled ~14 us at every layer (an H200 machine, batch 1, 128K): ~35 us a
layer for ~8 us of reads. The kernel was as fast or faster at every batch measured, so `LandmarkTopK` takes it
wherever it fits (`NATIVE_KERNEL_MAX_ROWS` can keep cuBLAS above a batch size).
"""

from __future__ import annotations

import ctypes
import math

import torch

from .library import define_op
from .loader import kernels_available, load_kernels, multiprocessors

__all__ = [
    "NATIVE_KERNEL_MAX_ROWS",
    "landmark_logits_int8",
    "landmark_logits_int8_op",
    "landmark_logits_int8_reference",
    "landmark_logits_native",
    "landmark_logits_native_op",
    "landmark_logits_native_reference",
    "native_kernel_fits",
]

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}  # the query's (fp16 MMA operands hold them exactly)
_HEAD_DIMS = (64, 128, 256)
_MAX_GROUP = 8  # one MMA's B columns
_THREADS, _LOADS = 128, 16  # LL_THREADS and LL_LOADS in the kernel
# Blocks stride over a (row, head)'s landmarks; this many per SM keep enough 16-byte loads in flight (4 blocks of
# 118 registers per thread fit an SM at D = 128) while each block converts its queries once for many landmarks.
# Not swept yet: `benchmarks/profile_decode.py --landmark-blocks-per-sm N` compares others.
BLOCKS_PER_SM = 4
# (batch x KV heads) up to which 16-bit landmarks take the kernel rather than cuBLAS (`native_kernel_fits`); None: at
# every batch. One layer at 128K on an H100 machine (`selection_kernels_cuda_128k_logits`, Hkv = 8, G = 4): 10.3
# against 15.4 us at batch 1, 29.7 against 34.9 at 2, 105 against 110 at 8, 550 against 552 at 44.
NATIVE_KERNEL_MAX_ROWS: int | None = None


def landmark_logits_int8_reference(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Logits `[B, Hkv, G, T, C]` in `q`'s dtype: `q` `[B, Hkv, G, T, D]` (scaling applied) times the landmarks
    `codes * scales` (`codes` int8 `[B or 1, Hkv, C, D]`, `scales` fp32 `[B or 1, Hkv, C]`), in fp32."""
    return _logits_fp32(q, codes, scales.float()[:, :, None, :])


def landmark_logits_native_reference(q: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """Logits `[B, Hkv, G, T, C]` in `q`'s dtype: `q` `[B, Hkv, G, T, D]` (scaling applied) times 16-bit `landmarks`
    `[B or 1, Hkv, C, D]`, in fp32."""
    return _logits_fp32(q, landmarks, None)


def _logits_fp32(q: torch.Tensor, landmarks: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    batch, heads, group, steps, dim = q.shape
    rows = q.float().reshape(batch, heads, group * steps, dim)
    logits = torch.matmul(rows, landmarks.float().transpose(-1, -2))
    if scales is not None:
        logits = logits * scales
    return logits.to(q.dtype).reshape(batch, heads, group, steps, -1)


def landmark_logits_int8(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`landmark_logits_int8_reference`'s logits `[B, Hkv, G, T, C]`; on CUDA, one-token steps through the kernel
    (a strided view of a `[B, Hkv, C, G]` tensor, which `ops.landmark_scores` reads as it lies).

    Args:
        q (`torch.Tensor`): `[B, Hkv, G, T, D]` grouped queries, the attention's scaling applied.
        codes (`torch.Tensor`): int8 `[B or 1, Hkv, C, D]` (1: one document shared by every row).
        scales (`torch.Tensor`): fp32 `[B or 1, Hkv, C]`.
    """
    if not _kernel_fits(q, codes, scales):
        return landmark_logits_int8_reference(q, codes, scales)
    return landmark_logits_int8_op(q, codes, scales).transpose(2, 3).unsqueeze(3)


def _one_token(q: torch.Tensor) -> None:
    torch._check(q.shape[3] == 1, lambda: "the landmark_logits_int8 operator takes one query token")


def _logits_twin(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _one_token(q)
    return landmark_logits_int8_reference(q, codes, scales).squeeze(3).transpose(2, 3).contiguous()


def _logits_like(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _one_token(q)
    batch, heads, group, _, _ = q.shape
    return q.new_empty((batch, heads, codes.shape[2], group))


@define_op("landmark_logits_int8(Tensor q, Tensor codes, Tensor scales) -> Tensor", cpu=_logits_twin, fake=_logits_like)
def landmark_logits_int8_op(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`torch.ops.shadowkv.landmark_logits_int8`: the kernel on what `landmark_logits_int8` checked (one query
    token); the logits as `[B, Hkv, C, G]`, contiguous."""
    _one_token(q)
    batch, heads, group, _, dim = q.shape
    chunks = codes.shape[2]
    out = torch.empty((batch, heads, chunks, group), dtype=q.dtype, device=q.device)
    blocks = _blocks(q, chunks, 1)
    shared = codes.shape[0] == 1 and batch > 1
    cb, ch, cc, _ = codes.stride()
    sb, sh, _ = scales.stride()
    qb, qh, qg, _, _ = q.stride()
    i64 = ctypes.c_longlong
    load_kernels("landmark_logits", q.device).launch(
        f"landmark_logits_int8_{_KERNEL_DTYPES[q.dtype]}_d{dim}",
        grid=(blocks, heads, batch),
        block=(_THREADS, 1, 1),
        args=[out, (out.stride(0), i64), (out.stride(1), i64), (out.stride(3), i64), (out.stride(2), i64),
              q, (qb, i64), (qh, i64), (qg, i64),
              codes, (0 if shared else cb, i64), (ch, i64), (cc, i64),
              scales, (0 if shared else sb, i64), (sh, i64),
              (group, ctypes.c_int), (chunks, i64)],
    )  # fmt: skip
    return out


def landmark_logits_native(q: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """`landmark_logits_native_reference`'s logits `[B, Hkv, G, T, C]`: through the kernel where `native_kernel_fits`
    (a strided view of a `[B, Hkv, C, G]` tensor, which `ops.landmark_scores` reads as it lies), else the twin.

    Args:
        q (`torch.Tensor`): `[B, Hkv, G, T, D]` grouped queries in the landmarks' dtype, the attention's scaling
            applied.
        landmarks (`torch.Tensor`): `[B or 1, Hkv, C, D]` (1: one document shared by every row).
    """
    if not native_kernel_fits(q, landmarks, max_rows=None):
        return landmark_logits_native_reference(q, landmarks)
    return landmark_logits_native_op(q, landmarks).transpose(2, 3).unsqueeze(3)


def _native_twin(q: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    _one_token(q)
    return landmark_logits_native_reference(q, landmarks).squeeze(3).transpose(2, 3).contiguous()


def _native_like(q: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    _one_token(q)
    batch, heads, group, _, _ = q.shape
    return q.new_empty((batch, heads, landmarks.shape[2], group))


@define_op("landmark_logits_native(Tensor q, Tensor landmarks) -> Tensor", cpu=_native_twin, fake=_native_like)
def landmark_logits_native_op(q: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """`torch.ops.shadowkv.landmark_logits_native`: the kernel on what `native_kernel_fits` checked (one query token,
    landmarks of the query's dtype); the logits as `[B, Hkv, C, G]`, contiguous."""
    _one_token(q)
    torch._check(landmarks.dtype == q.dtype, lambda: "landmark_logits_native takes landmarks of the query's dtype")
    batch, heads, group, _, dim = q.shape
    chunks = landmarks.shape[2]
    out = torch.empty((batch, heads, chunks, group), dtype=q.dtype, device=q.device)
    shared = landmarks.shape[0] == 1 and batch > 1
    lb, lh, lc, _ = landmarks.stride()
    qb, qh, qg, _, _ = q.stride()
    i64 = ctypes.c_longlong
    load_kernels("landmark_logits", q.device).launch(
        f"landmark_logits_native_{_KERNEL_DTYPES[q.dtype]}_d{dim}",
        grid=(_blocks(q, chunks, 2), heads, batch),
        block=(_THREADS, 1, 1),
        args=[out, (out.stride(0), i64), (out.stride(1), i64), (out.stride(3), i64), (out.stride(2), i64),
              q, (qb, i64), (qh, i64), (qg, i64),
              landmarks, (0 if shared else lb, i64), (lh, i64), (lc, i64),
              (group, ctypes.c_int), (chunks, i64)],
    )  # fmt: skip
    return out


def _blocks(q: torch.Tensor, chunks: int, element_bytes: int) -> int:
    """Blocks per (row, head): enough for `BLOCKS_PER_SM` blocks per SM over the grid, at most one per batch of
    landmarks (4 warps of `_LOADS` 16-byte loads per lane, two landmarks per quad of lanes)."""
    batch, heads, _, _, dim = q.shape
    per_block = (_THREADS // 32) * (_LOADS // (2 * (dim * element_bytes // 64))) * 16
    wanted = math.ceil(BLOCKS_PER_SM * multiprocessors(q.device) / (batch * heads))
    return max(1, min(math.ceil(chunks / per_block), wanted))


def native_kernel_fits(q: torch.Tensor, landmarks: torch.Tensor, max_rows: int | None | str = "default") -> bool:
    """Whether the kernel serves `landmark_logits_native(q, landmarks)`: `_kernel_reads` them, the landmarks in the
    query's dtype, and at most `max_rows` (batch x KV heads; `"default"`: `NATIVE_KERNEL_MAX_ROWS` as it is now;
    None: any)."""
    if max_rows == "default":
        max_rows = NATIVE_KERNEL_MAX_ROWS
    if not _kernel_reads(q, landmarks) or landmarks.dtype != q.dtype:
        return False
    return max_rows is None or q.shape[0] * q.shape[1] <= max_rows


def _kernel_fits(q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the kernel serves `landmark_logits_int8(q, codes, scales)`: `_kernel_reads` the query and the int8
    codes, and the fp32 scales are contiguous in C, one per landmark."""
    if not _kernel_reads(q, codes) or codes.dtype != torch.int8 or scales.dim() != 3:
        return False
    if scales.dtype != torch.float32 or scales.device != q.device or scales.stride(2) != 1:
        return False
    return tuple(scales.shape) == tuple(codes.shape[:3])


def _kernel_reads(q: torch.Tensor, landmarks: torch.Tensor) -> bool:
    """What both kernels need: a one-token step on a CUDA device with kernels (sm_80+ tensor cores), a bf16/fp16 query
    `[B, Hkv, G, 1, D]` contiguous in D, head dim 64, 128 or 256, at most 8 query heads per KV head, landmarks
    `[B or 1, Hkv, C, D]` (C > 0) on its device whose rows are 16-byte aligned and contiguous in D, and grid dimensions
    the device takes."""
    if q.dim() != 5 or landmarks.dim() != 4 or not kernels_available(q.device):
        return False
    batch, heads, group, steps, dim = q.shape
    if steps != 1 or q.dtype not in _KERNEL_DTYPES or dim not in _HEAD_DIMS or not 0 < group <= _MAX_GROUP:
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 8 or q.stride(4) != 1:
        return False
    if landmarks.device != q.device or landmarks.stride(3) != 1 or landmarks.shape[3] != dim:
        return False
    if landmarks.shape[0] not in (1, batch) or landmarks.shape[1] != heads or landmarks.data_ptr() % 16:
        return False
    if any(s * landmarks.element_size() % 16 for s, n in zip(landmarks.stride()[:3], landmarks.shape[:3]) if n > 1):
        return False
    return landmarks.shape[2] > 0 and 0 < batch <= 65535 and heads <= 65535
