"""RoPE of rebuilt keys, as the key-rebuild kernels compute it: the layout, the reference RoPE, and the slot products
and masked write that the kernels' twins share (`ops/rebuild_keys.py`, `ops/rebuild_missed.py`).

Legend: B batch, Hkv KV heads, Tc compressed tokens, R rank, D head dim, c chunk size, K slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["RopeFn", "RopeLayout", "rope_into_missed", "rope_missed_reference", "rope_reference", "slot_products"]

# (pre-RoPE keys [M, c, D], positions [M, c]) -> post-RoPE keys [M, c, D], on the keys' device. The kernel path also
# needs `layout` (a `RopeLayout`, or None when the RoPE is of no layout the kernel knows), `inv_freq_on(device)`
# ([rotary_dim/2] fp32 on that device) and `attention_scaling` (float) (see hf/rope.py `ModelRope`).
RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RopeLayout:
    """Which dims of a head RoPE rotates, and how it pairs them (what the key-rebuild kernels compute).

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


def rope_into_missed(
    keys: torch.Tensor, pre: torch.Tensor, ids: torch.Tensor, miss: torch.Tensor, positions: torch.Tensor, rope: RopeFn
) -> None:
    """Every slot's pre-RoPE keys `pre` (`[B, Hkv, K, c, D]`) rotated by `rope` at its chunk's positions, written
    into `keys` where `miss`."""
    batch, heads, num_slots, c, dim = keys.shape
    tokens = ids.clamp(min=0)[..., None] * c + torch.arange(c, device=ids.device)  # [B, Hkv, K, c]
    token_positions = positions.gather(1, tokens.reshape(batch, -1)).view(batch * heads * num_slots, c)
    rebuilt = rope(pre.reshape(-1, c, dim), token_positions).view_as(keys)
    keys.copy_(torch.where(miss[..., None, None], rebuilt.to(keys.dtype), keys))


def rope_missed_reference(
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
    """The twin of the `rope_missed` operator (and, on `slot_products`, of `rebuild_missed`): `rope_into_missed` with
    the RoPE the kernels compute (`rope_reference`) from the operators' arguments."""
    layout = RopeLayout(rotary_dim, interleaved)
    rope_into_missed(
        keys, pre, ids, miss, positions, lambda k, p: rope_reference(k, p, inv_freq, attention_scaling, layout)
    )


def slot_products(ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: int) -> torch.Tensor:
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
