"""The temporal cache: chunks selected at the previous step stay on the device (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, K selected chunks, c chunk size, D head dim, M missed chunks.

Consecutive decode steps select largely the same chunks, so only the misses are rebuilt (keys) and
fetched from host memory (values). The hit rate sets the PCIe bytes per step.
"""

from __future__ import annotations

import torch

from .compressed_prompt import CompressedPrompt
from .ops.rebuild_keys import RopeFn, rebuild_keys

__all__ = ["TemporalCache"]


class TemporalCache:
    """Selected chunks of one layer: ids `[B, Hkv, K]` (-1 = empty slot), keys and values `[B, Hkv, K, c, D]`."""

    def __init__(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        self.ids, self.keys, self.values = ids, keys, values
        # Counted on the device so that statistics never force a host synchronisation.
        self.hits = torch.zeros((), dtype=torch.int64, device=ids.device)
        self.lookups = torch.zeros((), dtype=torch.int64, device=ids.device)

    @classmethod
    def empty(cls, prompt: CompressedPrompt, num_slots: int) -> TemporalCache:
        batch, heads = prompt.selectable.shape[:2]
        c, d = prompt.chunk_size, prompt.outlier_keys.shape[-1]
        like = prompt.outlier_keys
        ids = torch.full((batch, heads, num_slots), -1, dtype=torch.int64, device=like.device)
        zeros = like.new_zeros((batch, heads, num_slots, c, d))
        return cls(ids, zeros, zeros.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.keys, self.values))

    def refresh(self, wanted: torch.Tensor, valid: torch.Tensor, prompt: CompressedPrompt, rope: RopeFn) -> None:
        """Hold the chunks `wanted` (`[B, Hkv, K]`, where `valid`): reuse hits, rebuild and fetch misses."""
        c, d = self.keys.shape[-2:]
        same = wanted[..., :, None] == self.ids[..., None, :]  # [B, Hkv, K(new), K(old)]
        hit = same.any(dim=-1) & valid
        source = same.int().argmax(dim=-1)[..., None, None].expand(-1, -1, -1, c, d)
        keys = torch.gather(self.keys, 2, source)
        values = torch.gather(self.values, 2, source)
        rows, heads, slots = (valid & ~hit).nonzero(as_tuple=True)  # PyTorch path: a host synchronisation
        if rows.numel():
            chunks = wanted[rows, heads, slots]
            keys[rows, heads, slots] = rebuild_keys(
                prompt.a, prompt.b, prompt.positions, rows, heads, chunks, prompt.chunk_size, rope
            ).to(keys.dtype)
            values[rows, heads, slots] = prompt.values.gather(rows, heads, chunks, keys.device).to(values.dtype)
        self.ids = wanted.masked_fill(~valid, -1)
        self.keys, self.values = keys, values
        self.hits += hit.sum()
        self.lookups += valid.sum()

    def select_rows(self, index: torch.Tensor) -> TemporalCache:
        out = TemporalCache(self.ids[index], self.keys[index], self.values[index])
        out.hits, out.lookups = self.hits, self.lookups
        return out
