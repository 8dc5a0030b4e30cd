"""Key rebuild for missed chunks: rows of A times B, then RoPE at the chunk's true positions (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, Tc compressed tokens, R rank, D head dim, M missed chunks, c chunk size,
K slots.

`rebuild_keys` is the definition (the PyTorch twin). `rebuild_missed_keys` writes the rebuilt keys into
the slots flagged by the temporal scan, without the host learning how many missed. On CUDA, for 16-bit keys of head
size 64, 128 or 256, one kernel (`rebuild_missed`, `kernels/rebuild_keys.cu`) gathers the missed slots' rows of A,
multiplies them by B on tensor cores and applies RoPE; otherwise one batched GEMM multiplies every slot's rows (hits
too) and `rope_missed` applies RoPE to the misses. Without kernels the twin rebuilds the misses.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .library import define_op
from .loader import kernels_available, load_kernels, multiprocessors, strided_grid

__all__ = [
    "RopeFn",
    "RopeLayout",
    "rebuild_keys",
    "rebuild_missed_keys",
    "rebuild_missed_op",
    "rope_missed_op",
    "rope_reference",
]

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
    if layout.rotary_dim == 0:  # a layer without RoPE: the kernel never reads the frequencies
        # Made on the device: a copy from the host inside a CUDA graph capture would fail the capture.
        inv_freq = torch.zeros(1, device=keys.device)
    inv_freq = inv_freq.to(device=keys.device, dtype=torch.float32).contiguous()
    ids, miss = ids.contiguous(), miss.contiguous()
    if _fused_fits(keys, a, b):
        rebuild_missed_op(
            keys, a, b, ids, miss, positions, inv_freq, attention_scaling, layout.rotary_dim, layout.interleaved
        )
        return
    pre = _slot_products(ids, a, b, keys.shape[3])
    rope_missed_op(keys, pre, ids, miss, positions, inv_freq, attention_scaling, layout.rotary_dim, layout.interleaved)


# The fused kernel (`rebuild_missed_*`): tensor cores of sm_80+, compiled for these head sizes.
_FUSED_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FUSED_HEAD_DIMS = (64, 128, 256)
_FUSED_THREADS, _FUSED_PAD = 256, 8  # REBUILD_THREADS and REBUILD_PAD in the kernel
# Grid (B*Hkv, splits): a head's slots are split over blocks until there are this many blocks per SM, each with at
# least `_MIN_SLOTS_PER_BLOCK` slots (every block stages its head's B, so smaller splits mostly re-read B).
_FUSED_BLOCKS_PER_SM, _MIN_SLOTS_PER_BLOCK = 2, 32


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


def _fused_fits(keys: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The fused kernel takes 16-bit keys of a compiled head size on sm_80+, A and B in the keys' dtype with unit
    stride over the rank and the head dim, and B of a head within the device's shared memory."""
    batch, heads, num_slots, _, dim = keys.shape
    if keys.dtype not in _FUSED_DTYPES or dim not in _FUSED_HEAD_DIMS or a.stride(-1) != 1 or b.stride(-1) != 1:
        return False
    if torch.cuda.get_device_capability(keys.device) < (8, 0):
        return False
    spb = _slots_per_block(keys.device, batch * heads, num_slots)
    return _fused_shared_bytes(dim, a.shape[-1], spb) <= _max_shared_bytes(keys.device)


@functools.cache
def _max_shared_bytes_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def _max_shared_bytes(device: torch.device) -> int:
    return _max_shared_bytes_of(device.index if device.index is not None else torch.cuda.current_device())


def _rebuild_missed_reference(
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
    """The twin of the fused op: every slot's product (`_slot_products`, in the keys' dtype), then
    `rope_missed`'s twin."""
    pre = _slot_products(ids, a, b, keys.shape[3])
    _rope_missed_reference(keys, pre, ids, miss, positions, inv_freq, attention_scaling, rotary_dim, interleaved)


@define_op(
    "rebuild_missed(Tensor(a!) keys, Tensor a, Tensor b, Tensor ids, Tensor miss, Tensor positions, Tensor inv_freq, "
    "float attention_scaling, int rotary_dim, bool interleaved) -> ()",
    cpu=_rebuild_missed_reference,
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
    kernels = load_kernels("rebuild_keys", keys.device)
    kernels.set_max_dynamic_shared(name, shared)
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    kernels.launch(
        name,
        grid=(rows, -(-num_slots // spb), 1),
        block=(_FUSED_THREADS, 1, 1),
        args=[
            keys, a, (a.stride(0), i64), (a.stride(1), i64), b, (b.stride(0), i64), (b.stride(1), i64),
            (b.stride(2), i64), ids, miss, positions, (positions.stride(0), i64), inv_freq,
            (attention_scaling, ctypes.c_float), (rotary_dim, i32), (int(interleaved), i32), (heads, i32),
            (num_slots, i32), (c, i32), (rank, i32), (spb, i32), (vec, i32),
        ],
        shared_bytes=shared,
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
