"""Key rebuild for missed chunks: rows of A times B, then RoPE at the chunk's true positions (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, Tc compressed tokens, R rank, D head dim, M missed chunks, c chunk size,
K slots.

`rebuild_keys` is the definition (the PyTorch twin). `rebuild_missed_keys` writes the rebuilt keys into
the slots flagged by the temporal scan. On CUDA the product runs as one batched GEMM over every slot (tensor
cores; the host never learns how many missed) and `kernels/rebuild_keys.cu` applies RoPE to the misses and
writes them; otherwise the twin rebuilds the misses.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .library import define_op
from .loader import kernels_available, load_kernels, strided_grid

__all__ = ["RopeFn", "RopeLayout", "rebuild_keys", "rebuild_missed_keys", "rope_missed_op", "rope_reference"]

# (pre-RoPE keys [M, c, D], positions [M, c]) -> post-RoPE keys [M, c, D], on the keys' device. The kernel path also
# needs `layout` (a `RopeLayout`, or None when the RoPE is of no layout the kernel knows), `inv_freq_on(device)`
# ([rotary_dim/2] fp32 on that device) and `attention_scaling` (float) (see hf/rope.py `ModelRope`).
RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RopeLayout:
    """Which dims of a head RoPE rotates, and how it pairs them (what `kernels/rebuild_keys.cu` computes).

    Args:
        rotary_dim (`int`): the first `rotary_dim` dims of each head are rotated, the rest pass through
            unchanged (partial rotary: Phi, StableLM, GPT-NeoX, GLM); `0` for a layer without RoPE.
        interleaved (`bool`): pairs `(2i, 2i+1)` rotate by frequency `i` (GLM, Cohere); otherwise pairs
            `(i, i + rotary_dim/2)` do (the rotate-half form of Llama).
    """

    rotary_dim: int
    interleaved: bool = False

    def __post_init__(self):
        if self.rotary_dim < 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 0 (dims rotate in pairs), got {self.rotary_dim}.")


def rope_reference(
    keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, layout: RopeLayout
) -> torch.Tensor:
    """The RoPE the key-rebuild kernel computes, in PyTorch: cos/sin in fp32 from `inv_freq` at each position,
    times `attention_scaling`, one rounding to the keys' dtype.

    Args:
        keys (`torch.Tensor`): `[..., T, D]` pre-RoPE keys.
        positions (`torch.Tensor`): `[..., T]` int64 positions.
        inv_freq (`torch.Tensor`): `[rotary_dim/2]` the rotary inverse frequencies.
        layout (`RopeLayout`): which dims rotate, paired how.
    Returns:
        `[..., T, D]` post-RoPE keys in `keys.dtype`.
    """
    r = layout.rotary_dim
    if r > keys.shape[-1]:
        raise ValueError(f"rotary_dim {r} exceeds the head dim {keys.shape[-1]}.")
    x, rest = keys[..., :r].float(), keys[..., r:]
    angles = positions[..., None].float() * inv_freq.float()  # [..., T, r/2]
    cos, sin = angles.cos() * attention_scaling, angles.sin() * attention_scaling
    if layout.interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    else:
        first, second = x[..., : r // 2], x[..., r // 2 :]
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((rotated.to(keys.dtype), rest), dim=-1)


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
    _rope_into_missed(keys, _slot_products(ids, a, b, c), ids, miss, positions, rope)


def _rope_into_missed(
    keys: torch.Tensor, pre: torch.Tensor, ids: torch.Tensor, miss: torch.Tensor, positions: torch.Tensor, rope: RopeFn
) -> None:
    """Every slot's pre-RoPE keys `pre` (`[B, Hkv, K, c, D]`) rotated by `rope` at its chunk's positions, written
    into `keys` where `miss`."""
    batch, heads, num_slots, c, dim = keys.shape
    tokens = ids.clamp(min=0)[..., None] * c + torch.arange(c, device=ids.device)  # [B, Hkv, K, c]
    token_positions = positions.gather(1, tokens.reshape(batch, -1)).view(batch * heads * num_slots, c)
    rebuilt = rope(pre.reshape(-1, c, dim), token_positions).view_as(keys)
    keys.copy_(torch.where(miss[..., None, None], rebuilt.to(keys.dtype), keys))


def _slot_products(ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: int) -> torch.Tensor:
    """Pre-RoPE keys `[B, Hkv, K, c, D]` of every slot's chunk (empty slots read chunk 0): one batched GEMM."""
    batch, heads, num_slots = ids.shape
    rank = a.shape[-1]
    chunks = a.shape[1] // c
    # Rows sharing one document (stride 0) index the single copy; a reshape would materialise one per row.
    shared = batch > 1 and a.stride(0) == 0
    chunk_rows = (a[:1] if shared else a).reshape(-1, c * rank)  # [B' * C, c*R]: one chunk's rows of A per row
    index = ids.clamp(min=0)
    if not shared:
        index = index + torch.arange(batch, device=ids.device)[:, None, None] * chunks
    a_sel = chunk_rows[index].view(batch, heads, num_slots * c, rank)
    b_heads = (b[:1] if shared else b).permute(0, 2, 1, 3)  # [B', Hkv, R, D]
    return torch.matmul(a_sel, b_heads).view(batch, heads, num_slots, c, -1)


def _launch(keys, ids, miss, a, b, positions, inv_freq, attention_scaling, layout: RopeLayout) -> None:
    pre = _slot_products(ids, a, b, keys.shape[3])
    if layout.rotary_dim == 0:  # a layer without RoPE: the kernel never reads the frequencies
        # Made on the device: a copy from the host inside a CUDA graph capture would fail the capture.
        inv_freq = torch.zeros(1, device=keys.device)
    inv_freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
    rope_missed_op(
        keys, pre, ids.contiguous(), miss.contiguous(), positions, inv_freq, attention_scaling,
        layout.rotary_dim, layout.interleaved,
    )  # fmt: skip


def _rope_missed_reference(
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
    """The op's twin: `_rope_into_missed` with the RoPE the kernel computes (`rope_reference`)."""
    layout = RopeLayout(rotary_dim, interleaved)
    _rope_into_missed(
        keys, pre, ids, miss, positions, lambda k, p: rope_reference(k, p, inv_freq, attention_scaling, layout)
    )


@define_op(
    "rope_missed(Tensor(a!) keys, Tensor pre, Tensor ids, Tensor miss, Tensor positions, Tensor inv_freq, "
    "float attention_scaling, int rotary_dim, bool interleaved) -> ()",
    cpu=_rope_missed_reference,
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
