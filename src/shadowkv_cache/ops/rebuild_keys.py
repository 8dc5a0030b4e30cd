"""Key rebuild for missed chunks: rows of A times B, then RoPE at the chunk's true positions (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, Tc compressed tokens, R rank, D head dim, M missed chunks, c chunk size,
K slots.

`rebuild_keys` is the definition (the PyTorch twin). `rebuild_missed_keys` writes the rebuilt keys into
the slots flagged by the temporal scan: on CUDA through `kernels/rebuild_keys.cu` (one block per slot, hits
return at once, so the host never learns how many missed), otherwise through the twin.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ..kernel_loader import kernels_available, load_kernels

__all__ = ["RopeFn", "rebuild_keys", "rebuild_missed_keys"]

# (pre-RoPE keys [M, c, D], positions [M, c]) -> post-RoPE keys [M, c, D]. The kernel path also needs the
# attributes `inv_freq` ([D/2] fp32) and `attention_scaling` (float) of a rotate-half RoPE (see adapters).
RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def rebuild_keys(
    a: torch.Tensor,
    b: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    heads: torch.Tensor,
    chunks: torch.Tensor,
    chunk_size: int,
    rope: RopeFn,
) -> torch.Tensor:
    """Post-RoPE keys `[M, c, D]` of the chunks `(rows, heads, chunks)` (each `[M]` int64).

    Args:
        a (`torch.Tensor`): `[B, Tc, R]`, the left factor (`U·Σ`) of each row's pre-RoPE keys.
        b (`torch.Tensor`): `[B, R, Hkv, D]`, the right factor (`Vᵀ`) split per KV head.
        positions (`torch.Tensor`): `[B, Tc]` int64 RoPE positions of the compressed tokens.
        chunk_size (`int`): tokens per chunk `c`.
        rope (`RopeFn`): the model's rotary embedding applied at given positions.
    """
    tokens = chunks[:, None] * chunk_size + torch.arange(chunk_size, device=chunks.device)  # [M, c]
    a_rows = a[rows[:, None], tokens]  # [M, c, R]
    b_heads = b[rows, :, heads]  # [M, R, D]
    pre_rope = torch.bmm(a_rows, b_heads)  # [M, c, D]
    return rope(pre_rope, positions[rows[:, None], tokens])


def rebuild_missed_keys(
    keys: torch.Tensor,
    ids: torch.Tensor,
    miss: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    positions: torch.Tensor,
    rope: RopeFn,
) -> None:
    """Write the post-RoPE keys of chunk `ids` into `keys` where `miss`, in place.

    Args:
        keys (`torch.Tensor`): `[B, Hkv, K, c, D]` the key slots (contiguous).
        ids (`torch.Tensor`): `[B, Hkv, K]` int64 chunk of each slot.
        miss (`torch.Tensor`): `[B, Hkv, K]` bool, slots to rebuild.
        a, b, positions: as in `rebuild_keys`.
    """
    batch, heads, num_slots, c, dim = keys.shape
    if not num_slots or not batch:
        return
    inv_freq = getattr(rope, "inv_freq", None)
    if (
        kernels_available(keys.device)
        and inv_freq is not None
        and keys.dtype in _KERNEL_DTYPES
        and a.dtype == b.dtype == keys.dtype
        and keys.is_contiguous()
        and dim % 2 == 0
        and _shared_bytes(c, a.shape[-1], dim, keys.dtype) <= _max_shared_bytes(keys.device)
    ):
        _launch(keys, ids, miss, a, b, positions, inv_freq, float(rope.attention_scaling))
        return
    if keys.device.type == "cpu":  # a host synchronisation costs nothing here: rebuild the misses only
        rows, hs, slots = miss.nonzero(as_tuple=True)
        if rows.numel():
            keys[rows, hs, slots] = rebuild_keys(a, b, positions, rows, hs, ids[rows, hs, slots], c, rope).to(
                keys.dtype
            )
        return
    # Accelerator without kernels: rebuild every slot (fixed size, no synchronisation) and keep the misses.
    rows = torch.arange(batch, device=keys.device)[:, None, None].expand_as(ids).reshape(-1)
    hs = torch.arange(heads, device=keys.device)[None, :, None].expand_as(ids).reshape(-1)
    rebuilt = rebuild_keys(a, b, positions, rows, hs, ids.clamp(min=0).reshape(-1), c, rope)
    keys.copy_(torch.where(miss[..., None, None], rebuilt.view_as(keys).to(keys.dtype), keys))


_SLOTS_PER_BLOCK = 32  # ~13 misses per block at h = 0.6: the staged B slice is reused that often
_MAX_SHARED: dict[int, int] = {}


def _shared_bytes(c: int, rank: int, dim: int, dtype: torch.dtype) -> int:
    """Dynamic shared memory of `kernels/rebuild_keys.cu`: A tile and pre-RoPE rows in fp32, B slice in `dtype`."""
    rank4 = -(-rank // 4) * 4
    return 4 * c * rank4 + 4 * c * dim + dtype.itemsize * rank4 * dim


def _max_shared_bytes(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MAX_SHARED:
        props = torch.cuda.get_device_properties(index)
        _MAX_SHARED[index] = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
    return _MAX_SHARED[index]


def _launch(keys, ids, miss, a, b, positions, inv_freq, attention_scaling) -> None:
    batch, heads, num_slots, c, dim = keys.shape
    rank = a.shape[-1]
    kernels = load_kernels("rebuild_keys", keys.device)
    i32 = ctypes.c_int
    kernels.launch(
        f"rebuild_keys_{_KERNEL_DTYPES[keys.dtype]}",
        grid=(-(-num_slots // _SLOTS_PER_BLOCK), heads, batch),
        block=(128, 1, 1),
        args=[
            keys,
            ids.contiguous(),
            miss.contiguous(),
            a.contiguous(),
            b.contiguous(),
            positions.contiguous(),
            inv_freq.to(device=keys.device, dtype=torch.float32).contiguous(),
            (attention_scaling, ctypes.c_float),
            (heads, i32),
            (num_slots, i32),
            (c, i32),
            (dim, i32),
            (a.shape[1], i32),
            (rank, i32),
            (_SLOTS_PER_BLOCK, i32),
        ],
        shared_bytes=_shared_bytes(c, rank, dim, keys.dtype),
    )
