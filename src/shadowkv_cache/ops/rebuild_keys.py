"""Key rebuild for missed chunks: rows of A times B, then RoPE at the chunk's true positions (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, Tc compressed tokens, R rank, D head dim, M missed chunks, c chunk size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["RopeFn", "rebuild_keys"]

# (pre-RoPE keys [M, c, D], positions [M, c]) -> post-RoPE keys [M, c, D]
RopeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
