"""The missed slots' keys in one kernel: rows of A gathered, multiplied by B on tensor cores, RoPE (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, Tc compressed tokens, R rank, D head dim, c chunk size, K slots.

`rebuild_missed_reference` is the definition: every slot's product `A·B` in the keys' dtype, then RoPE at the missed
slots (the same keys as `rebuild_keys.rebuild_keys`). `kernels/rebuild_missed.cu` computes only the misses, for 16-bit
keys of head size 64, 128 or 256 on sm_80+; `rebuild_keys.rebuild_missed_keys` chooses it where `fused_fits`.
"""

from __future__ import annotations

import ctypes

import torch

from .key_rope import rope_missed_reference, slot_products
from .library import define_op
from .loader import load_kernels, max_shared_bytes, multiprocessors, strided_grid

__all__ = ["fused_fits", "rebuild_missed_op", "rebuild_missed_reference"]

# The fused kernel (`rebuild_missed_*`): tensor cores of sm_80+, compiled for these head sizes.
_FUSED_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FUSED_HEAD_DIMS = (64, 128, 256)
_FUSED_THREADS, _FUSED_PAD = 256, 8  # REBUILD_THREADS and REBUILD_PAD in the kernel
# Grid (B*Hkv, splits): a head's slots are split over blocks until there are this many blocks per SM, each with at
# least `_MIN_SLOTS_PER_BLOCK` slots (every block stages its head's B, so smaller splits mostly re-read B). Past that
# many blocks per SM the grid's x is capped and each block takes several (row, head)s: the blocks all start at once,
# so the value fetch launched beside the rebuild (shadowkv/temporal_cache.py) need not wait behind queued ones.
_FUSED_BLOCKS_PER_SM, _MIN_SLOTS_PER_BLOCK = 2, 32
CAP_GRID = True  # off: one block per (row, head) however many, as before the cap (for comparisons)
_STATIC_SHARED = 64  # the kernel's own shared memory (its warp counts, 32 bytes), with room to spare


def _fused_shared_bytes(dim: int, rank: int, slots_per_block: int) -> int:
    """`rebuild_shared_bytes` of the kernel: B of a head, a 16-row tile per warp (rows of A, then products), the
    block's missed slots."""
    rank16 = -(-rank // 16) * 16
    tile = 16 * (max(rank16, dim) + _FUSED_PAD)
    return 2 * dim * (rank16 + _FUSED_PAD) + 2 * (_FUSED_THREADS // 32) * tile + 4 * slots_per_block


def _aligned_rows(t: torch.Tensor, strides: tuple[int, ...], width: int) -> bool:
    """Whether rows of `width` elements starting at `t`'s data plus any combination of `strides` are 16-byte aligned
    and hold whole 16-byte groups (the kernel's vector loads)."""
    per = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and width % per == 0 and all(stride % per == 0 for stride in strides)


def _slots_per_block(device: torch.device, rows: int, num_slots: int) -> int:
    want = -(-int(_FUSED_BLOCKS_PER_SM * multiprocessors(device)) // max(rows, 1))  # splits per (row, head)
    splits = max(1, min(want, num_slots // _MIN_SLOTS_PER_BLOCK))
    return -(-num_slots // splits)


def _resident_per_sm(device: torch.device, shared: int) -> int:
    """Blocks of the kernel that one SM holds at once (at most `_FUSED_BLOCKS_PER_SM`), by their shared memory: an SM
    has the most a block may opt into plus the 1 KiB reserved per block."""
    return max(1, min(_FUSED_BLOCKS_PER_SM, (max_shared_bytes(device) + 1024) // (shared + _STATIC_SHARED + 1024)))


def _grid_rows(device: torch.device, rows: int, shared: int) -> int:
    return strided_grid(device, rows, _resident_per_sm(device, shared))[0] if CAP_GRID else rows


def fused_fits(keys: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The fused kernel takes 16-bit keys of a compiled head size on sm_80+, A and B in the keys' dtype with unit
    stride over the rank and the head dim, and B of a head within the device's shared memory."""
    return _refusal(keys, a, b) is None


def _refusal(keys: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why the kernel cannot take these keys and factors, or None."""
    batch, heads, num_slots, _, dim = keys.shape
    if keys.dtype not in _FUSED_DTYPES or not a.dtype == b.dtype == keys.dtype:
        return f"keys, a and b must share one dtype of {list(_FUSED_DTYPES)}, got {keys.dtype}, {a.dtype}, {b.dtype}"
    if dim not in _FUSED_HEAD_DIMS:
        return f"the kernel is compiled for head dims {_FUSED_HEAD_DIMS}, got {dim}"
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        return "a and b need unit stride over the rank and the head dim"
    if keys.is_cuda and torch.cuda.get_device_capability(keys.device) < (8, 0):
        return "the kernel's tensor-core MMAs need sm_80 or newer"
    if keys.is_cuda:
        spb = _slots_per_block(keys.device, batch * heads, num_slots)
        need = _fused_shared_bytes(dim, a.shape[-1], spb) + _STATIC_SHARED
        if need > max_shared_bytes(keys.device):
            return f"B of a head needs {need} bytes of shared memory, more than the device gives a block"
    return None


def rebuild_missed_reference(
    keys: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ids: torch.Tensor,
    miss: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    interleaved: bool,
) -> None:
    """The PyTorch twin: every slot's product (`slot_products`, in the keys' dtype), then the RoPE the kernel computes
    (`rope_missed_reference`) at each missed slot's chunk positions, written where `miss`."""
    pre = slot_products(ids, a, b, keys.shape[3])
    rope_missed_reference(keys, pre, ids, miss, positions, inv_freq, attention_scaling, rotary_dim, interleaved)


@define_op(
    "rebuild_missed(Tensor(a!) keys, Tensor a, Tensor b, Tensor ids, Tensor miss, Tensor positions, Tensor inv_freq, "
    "float attention_scaling, int rotary_dim, bool interleaved) -> ()",
    cpu=rebuild_missed_reference,
    fake=lambda *args: None,
)
def rebuild_missed_op(
    keys: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ids: torch.Tensor,
    miss: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    interleaved: bool,
) -> None:
    """`torch.ops.shadowkv.rebuild_missed`: the missed slots' keys `[B, Hkv, K, c, D]` (contiguous, bf16 or fp16,
    D of 64, 128 or 256) from `a` `[B, Tc, R]` and `b` `[B, R, Hkv, D]` (unit stride over R and D; rows may be
    stride-0 views of one document) in one kernel: the products on tensor cores, rounded to the keys' dtype, then
    RoPE as `rope_missed`; `ids`, `miss` contiguous, the rest as `rope_missed`."""
    refusal = _refusal(keys, a, b)
    torch._check(refusal is None, lambda: f"the rebuild_missed operator: {refusal}")
    contiguous = keys.is_contiguous() and ids.is_contiguous() and miss.is_contiguous()
    torch._check(contiguous, lambda: "the rebuild_missed operator needs keys, ids and miss contiguous")
    torch._check(positions.stride(-1) == 1, lambda: "the rebuild_missed operator needs positions of unit stride")
    batch, heads, num_slots, c, dim = keys.shape
    rank = a.shape[-1]
    rows = batch * heads
    if not rows or not num_slots:
        return
    spb = _slots_per_block(keys.device, rows, num_slots)
    shared = _fused_shared_bytes(dim, rank, spb)
    vec = int(_aligned_rows(a, (a.stride(0), a.stride(1)), rank))
    vec |= 2 * int(_aligned_rows(b, (b.stride(0), b.stride(1), b.stride(2)), dim))
    vec |= 4 * int(_aligned_rows(keys, (), dim))
    name = f"rebuild_missed_{_FUSED_DTYPES[keys.dtype]}_d{dim}"
    kernels = load_kernels("rebuild_missed", keys.device)
    kernels.set_max_dynamic_shared(name, shared)
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    kernels.launch(
        name,
        grid=(_grid_rows(keys.device, rows, shared), -(-num_slots // spb), 1),
        block=(_FUSED_THREADS, 1, 1),
        args=[
            keys, a, (a.stride(0), i64), (a.stride(1), i64), b, (b.stride(0), i64), (b.stride(1), i64),
            (b.stride(2), i64), ids, miss, positions, (positions.stride(0), i64), inv_freq,
            (attention_scaling, ctypes.c_float), (rotary_dim, i32), (int(interleaved), i32), (heads, i32),
            (num_slots, i32), (c, i32), (rank, i32), (spb, i32), (vec, i32), (rows, i32),
        ],
        shared_bytes=shared,
    )  # fmt: skip
