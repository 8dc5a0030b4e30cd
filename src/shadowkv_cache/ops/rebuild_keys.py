"""Key rebuild for missed chunks: rows of A times B, then RoPE at the chunk's true positions (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, Tc compressed tokens, R rank, D head dim, M missed chunks, c chunk size,
K slots.

`rebuild_keys` is the definition (the PyTorch twin). `rebuild_missed_keys` writes the rebuilt keys into
the slots flagged by the temporal scan, without the host learning how many missed. On CUDA, for 16-bit keys of head
size 64, 128 or 256, one kernel (`ops/rebuild_missed.py`) gathers the missed slots' rows of A, multiplies them by B on
tensor cores and applies RoPE; otherwise one batched GEMM multiplies every slot's rows (hits too) and `rope_missed`
(`kernels/rebuild_keys.cu`) applies RoPE to the misses. Without kernels the twin rebuilds the misses. The RoPE layout,
the reference RoPE and the slot products are in `ops/key_rope.py`.
"""

from __future__ import annotations

import ctypes

import torch

from .key_rope import RopeFn, RopeLayout, rope_into_missed, rope_missed_reference, rope_reference, slot_products
from .library import define_op
from .loader import kernels_available, load_kernels, strided_grid
from .rebuild_missed import fused_fits, rebuild_missed_op

__all__ = ["RopeFn", "RopeLayout", "rebuild_keys", "rebuild_missed_keys", "rope_missed_op", "rope_reference"]

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ROPE_THREADS = 128  # ROPE_THREADS in kernels/rebuild_keys.cu: four warps, one slot each at a time
# The RoPE kernel's warps stride over the slots (most hit and are skipped); this many blocks per SM, at 32 registers
# a thread, leave room for the value fetch that runs beside it. Not measured yet against other sizes.
ROPE_BLOCKS_PER_SM = 8


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
    layout: RopeLayout | None = getattr(rope, "layout", None)
    inv_freq_on = getattr(rope, "inv_freq_on", None)  # on the keys' device, made once (design.md §11)
    inv_freq = inv_freq_on(keys.device) if inv_freq_on is not None else None
    if (
        kernels_available(keys.device)
        and layout is not None
        and layout.rotary_dim <= dim
        and (layout.rotary_dim == 0 or (inv_freq is not None and 2 * inv_freq.numel() == layout.rotary_dim))
        and keys.dtype in _KERNEL_DTYPES
        and a.dtype == b.dtype == keys.dtype
        and keys.is_contiguous()
        and positions.stride(-1) == 1
    ):
        _launch(keys, ids, miss, a, b, positions, inv_freq, float(rope.attention_scaling), layout)
        return
    if keys.device.type == "cpu":  # a host synchronisation costs nothing here: rebuild the misses only
        rows, hs, slots = miss.nonzero(as_tuple=True)
        if rows.numel():
            keys[rows, hs, slots] = rebuild_keys(a, b, positions, rows, hs, ids[rows, hs, slots], c, rope).to(
                keys.dtype
            )
        return
    # Accelerator without kernels: rebuild every slot (fixed size, no synchronisation) and keep the misses.
    rope_into_missed(keys, slot_products(ids, a, b, c), ids, miss, positions, rope)


def _launch(keys, ids, miss, a, b, positions, inv_freq, attention_scaling, layout: RopeLayout) -> None:
    if layout.rotary_dim == 0:  # a layer without RoPE: the kernel never reads the frequencies
        # Made on the device: a copy from the host inside a CUDA graph capture would fail the capture.
        inv_freq = torch.zeros(1, device=keys.device)
    inv_freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
    ids, miss = ids.contiguous(), miss.contiguous()
    if fused_fits(keys, a, b):
        rebuild_missed_op(
            keys, a, b, ids, miss, positions, inv_freq, attention_scaling, layout.rotary_dim, layout.interleaved
        )
        return
    pre = slot_products(ids, a, b, keys.shape[3])
    rope_missed_op(keys, pre, ids, miss, positions, inv_freq, attention_scaling, layout.rotary_dim, layout.interleaved)


@define_op(
    "rope_missed(Tensor(a!) keys, Tensor pre, Tensor ids, Tensor miss, Tensor positions, Tensor inv_freq, "
    "float attention_scaling, int rotary_dim, bool interleaved) -> ()",
    cpu=rope_missed_reference,
    fake=lambda *args: None,
)
def rope_missed_op(
    keys: torch.Tensor,
    pre: torch.Tensor,
    ids: torch.Tensor,
    miss: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    rotary_dim: int,
    interleaved: bool,
) -> None:
    """`torch.ops.shadowkv.rope_missed`: writes RoPE of the slot products `pre` (`[B, Hkv, K, c, D]`) at each missed
    slot's chunk positions into `keys` (contiguous, same shape); `positions` `[B, Tc]` int64 contiguous in tokens,
    `inv_freq` `[rotary_dim/2]` (at least one element) fp32 on the keys' device."""
    batch, heads, num_slots, c, dim = keys.shape
    kernels = load_kernels("rebuild_keys", keys.device)
    i32 = ctypes.c_int
    total = batch * heads * num_slots
    kernels.launch(
        f"rope_missed_{_KERNEL_DTYPES[keys.dtype]}",
        grid=strided_grid(keys.device, -(-total // (_ROPE_THREADS // 32)), ROPE_BLOCKS_PER_SM),  # a slot per warp
        block=(_ROPE_THREADS, 1, 1),
        args=[
            keys,
            pre,
            ids,
            miss,
            positions,
            (positions.stride(0), ctypes.c_longlong),
            inv_freq,
            (attention_scaling, ctypes.c_float),
            (rotary_dim, i32),
            (int(interleaved), i32),
            (heads, i32),
            (num_slots, i32),
            (c, i32),
            (dim, i32),
            (total, ctypes.c_longlong),
        ],
    )
