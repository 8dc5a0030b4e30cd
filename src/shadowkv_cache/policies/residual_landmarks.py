"""Residual landmarks: a ~4-bit landmark per group of keys plus a 1-bit residual per key (a YAKV extension).

"KV Cache Offloading for Context-Intensive Tasks" (the YAKV study, §4.3 and
Appendix E): the mean of each group of 8 consecutive keys is HIGGS-quantised (~4 bits), the residual of each
key against its quantised landmark is quantised to 1 bit, and the query scores every key as
`q . k_hat = repeat(q . L_hat) + q . R_hat` without rebuilding any key.

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, N tokens, c tokens per group, Ng = ceil(N/c)
groups, D head dim, M = D/2 landmark sub-vectors, D/8 residual bytes.

It plugs in as a token-granularity policy of YAKV mode, in place of the ~2-bit scoring copy:
`ShadowKVCache(model, mode="yakv", policy=ResidualLandmarkTopK())`. The host records, the fetch and the
attention are YAKV's; only the device copy that scores the tokens changes (about 1.6-1.8 bits per value instead
of ~2.1, see `device_bits_per_value`).

The 1-bit residual is the sign of each coordinate after the quantiser's Hadamard rotation, with one fp16 scale
per key: `R_hat = s * sign(H r)`, `s = mean |H r|` (the least-squares scale for fixed signs). The signs of 8
coordinates form one byte, i.e. the index of a point of the 256-point grid `{-1, +1}^8`, so the residual is
scored through the same lookup table op as YAKV's codes (`ops.score_codes`).
"""

from __future__ import annotations

import functools
import math

import torch

from ..ops.score_codes import score_codes
from ..quant import GRID_POINTS, HiggsQuantizer
from .base import SelectionPolicy, grouped_query
from .quantized_keys import attention_scores

__all__ = ["ResidualLandmarkTopK", "sign_grid"]

_SIGN_DIM = 8  # coordinates per residual byte


@functools.cache
def sign_grid() -> torch.Tensor:
    """`[256, 8]` float32: point `j` has coordinate `i` equal to +1 where bit `i` of `j` is set, else -1."""
    bits = (torch.arange(GRID_POINTS)[:, None] >> torch.arange(_SIGN_DIM)) & 1
    return (2 * bits - 1).float()


class ResidualLandmarkTopK(SelectionPolicy):
    """Scores each token by the attention its residual-landmark key `repeat(L_hat) + R_hat` would get: softmax over
    the tokens of each query head, summed over query tokens, max over each GQA group (as `QuantizedKeyTopK`).

    Groups are `group_size` consecutive quantised tokens of a row, counted from its first one (rows are
    left-aligned), so a padded row groups its tokens as it would alone. Padding tokens hold zero keys (the
    interface's convention), so a landmark is the mean of its group's nonzero keys.

    Args:
        group_size (`int`, *optional*, defaults to 8): keys per landmark (the study's 8).
        landmark_grid_dim (`int`, *optional*, defaults to 2): HIGGS grid dimension of the landmarks (2 -> ~4 bits).
        seed (`int`, *optional*, defaults to 0): the quantiser's seed (rotation and grid).
    """

    granularity = "token"

    def __init__(self, group_size: int = 8, landmark_grid_dim: int = 2, seed: int = 0):
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"group_size must be a positive int (the study uses 8), got {group_size!r}")
        if landmark_grid_dim not in (2, 4, 8) or isinstance(landmark_grid_dim, bool):
            raise ValueError(f"landmark_grid_dim must be one of (2, 4, 8) (~4 / 2 / 1 bits), got {landmark_grid_dim!r}")
        self.group_size, self.landmark_grid_dim, self.seed = group_size, landmark_grid_dim, seed
        self._quantizers: dict[int, HiggsQuantizer] = {}

    def quantizer(self, head_dim: int) -> HiggsQuantizer:
        """The landmarks' quantiser for head dim `head_dim` (made once); its rotation also serves the residuals."""
        if head_dim not in self._quantizers:
            if head_dim % _SIGN_DIM:
                raise ValueError(
                    f"residual landmarks pack 8 sign bits per byte: head dim {head_dim} must be a "
                    "multiple of 8; use QuantizedKeyTopK for this model."
                )
            self._quantizers[head_dim] = HiggsQuantizer(head_dim, self.landmark_grid_dim, self.seed)
        return self._quantizers[head_dim]

    def device_bits_per_value(self, head_dim: int) -> float:
        """Device bits per key coordinate: the landmark's share `(8/p + 16/D) / c` plus `1 + 16/D` of residual."""
        return (8 / self.landmark_grid_dim + 16 / head_dim) / self.group_size + 1 + 16 / head_dim

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """State from post-RoPE keys `[B, Hkv, N, 1, D]`: landmark codes `[B, Hkv, Ng, M]` and norms `[B, Hkv, Ng]`,
        residual sign bytes `[B, Hkv, N, D/8]` uint8 and norms `[B, Hkv, N]` fp16 (`||R_hat|| = s * sqrt(D)`)."""
        if chunk_keys.ndim != 5 or chunk_keys.shape[3] != 1:
            raise ValueError(
                f"ResidualLandmarkTopK scores tokens: keys must be [B, Hkv, N, 1, D], got "
                f"{tuple(chunk_keys.shape)}; use it with mode='yakv'."
            )
        keys = chunk_keys.flatten(2, 3).float()  # [B, Hkv, N, D]
        batch, heads, num, dim = keys.shape
        quantizer, c = self.quantizer(dim), self.group_size
        groups = -(-num // c)
        padded = keys.new_zeros((batch, heads, groups * c, dim))
        padded[:, :, :num] = keys
        padded = padded.view(batch, heads, groups, c, dim)
        count = (padded != 0).any(dim=-1).sum(dim=-1, keepdim=True).clamp_min(1)  # [B, Hkv, Ng, 1]
        landmarks = quantizer.quantize(padded.sum(dim=-2) / count)
        rebuilt = quantizer.dequantize(landmarks, torch.float32)  # [B, Hkv, Ng, D]
        residual = quantizer.rotate(keys - rebuilt.repeat_interleave(c, dim=2)[:, :, :num])
        bits = (residual >= 0).to(torch.uint8).unflatten(-1, (dim // _SIGN_DIM, _SIGN_DIM))
        codes = (bits << torch.arange(_SIGN_DIM, dtype=torch.uint8, device=keys.device)).sum(-1, dtype=torch.uint8)
        norms = residual.abs().mean(dim=-1) * math.sqrt(dim)  # ||s * sign|| with s = mean |H r|
        return {
            "landmark_codes": landmarks.codes,
            "landmark_norms": landmarks.norms,
            "residual_codes": codes,
            "residual_norms": norms.to(torch.float16),
        }

    def logits(self, query: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        """`q . (repeat(L_hat) + R_hat)` `[B, Hkv, G*T, N]` float32 (unscaled) for `query` `[B, Hq, T, D]`."""
        res_codes = state["residual_codes"]
        heads, num = res_codes.shape[1], res_codes.shape[2]
        q = grouped_query(query, heads)  # [B, Hkv, G, T, D]
        dim = q.shape[-1]
        quantizer = self.quantizer(dim)
        rotated = quantizer.rotate(q.flatten(2, 3))  # once per step, for both tables
        by_landmark = score_codes(
            quantizer.lookup_table(rotated), state["landmark_codes"], state["landmark_norms"], dim
        )
        signs = sign_grid().to(rotated.device)
        table = rotated.unflatten(-1, (dim // _SIGN_DIM, _SIGN_DIM)) @ signs.T  # [B, Hkv, G*T, D/8, 256]
        by_residual = score_codes(table, res_codes, state["residual_norms"], dim)  # [B, Hkv, G*T, N]
        return by_landmark.repeat_interleave(self.group_size, dim=-1)[..., :num] + by_residual

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        groups = query.shape[1] // state["residual_codes"].shape[1]
        return attention_scores(self.logits(query, state) * scaling, selectable, groups)
