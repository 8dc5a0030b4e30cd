"""Query-key dot products from quantised keys through a lookup table (YAKV token scoring).

Legend: B batch, Hkv KV heads, Q query rows per KV head (query heads of the group x query tokens), N tokens,
M sub-vectors per key, 256 grid points.

`table[b, h, q, m, j]` is the dot of sub-vector `m` of rotated query row `q` with grid point `j`
(`HiggsQuantizer.lookup_table`), so `q . k_hat = norm(k) / sqrt(D) * sum_m table[q, m, code(k)_m]`. This is
the PyTorch twin that defines the meaning; it works on blocks of tokens so that the gathered `[N, M, Q]`
block stays bounded whatever N.
"""

from __future__ import annotations

import math

import torch

__all__ = ["score_codes"]

# Elements of the gathered block per step: 2^24 float32 = 64 MiB.
_BLOCK_ELEMENTS = 1 << 24


def score_codes(table: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Scores `[B, Hkv, Q, N]` float32 of every token for every query row.

    Args:
        table (`torch.Tensor`): `[B, Hkv, Q, M, 256]` float32 lookup table of the rotated queries.
        codes (`torch.Tensor`): `[B, Hkv, N, M]` uint8 grid indices of the rotated, scaled keys; rows sharing
            one document may be stride-0 views.
        norms (`torch.Tensor`): `[B, Hkv, N]` fp16 key norms.
        head_dim (`int`): D, for the `norm / sqrt(D)` scale.
    """
    batch, heads, rows, m, points = table.shape
    num = codes.shape[2]
    # Sub-vector m's codes index the m-th block of 256 entries of the flattened table.
    flat = table.float().permute(0, 1, 3, 4, 2).reshape(batch, heads, m * points, rows)  # [B, Hkv, M*256, Q]
    offsets = torch.arange(m, device=codes.device) * points
    out = table.new_empty((batch, heads, num, rows), dtype=torch.float32)
    step = max(1, _BLOCK_ELEMENTS // max(1, m * rows * batch * heads))
    for start in range(0, num, step):
        block = codes[:, :, start : start + step]
        n = block.shape[2]
        index = (block.long() + offsets).reshape(batch, heads, n * m, 1).expand(-1, -1, -1, rows)
        dots = flat.gather(2, index).view(batch, heads, n, m, rows).sum(dim=3)  # [B, Hkv, n, Q]
        out[:, :, start : start + n] = dots
    out *= (norms.float() / math.sqrt(head_dim))[..., None]
    return out.transpose(2, 3)
