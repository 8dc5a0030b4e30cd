"""The temporal-cache hit rate by construction, and its counters.

Legend: B batch, Hkv KV heads, C chunks, K selected chunks per KV head, h hit rate.

With random weights the hit rate of a ShadowKV decode step means nothing, yet it sets the bytes a step moves over
PCIe (a miss rebuilds a chunk's keys and fetches its values). `ControlledHitRate` fixes it: it does the work of
`LandmarkTopK` and then selects so that each step keeps a share `h` of the previous step's chunks.
"""

from __future__ import annotations

import torch

from ..hf.cache import ShadowKVCache
from ..policies import LandmarkTopK

__all__ = ["ControlledHitRate", "reset_hit_counts"]


class ControlledHitRate(LandmarkTopK):
    """Scores chunks like `LandmarkTopK` (same cost), then returns a selection that keeps a share `hit_rate` of the
    previous step's chunks: a window of `K` entries of a fixed random permutation of the `C` chunks (per row and
    head), sliding by `shift = max(1, round((1 - h) * K))` entries each step (0 at `h = 1`).

    From the second step on, the measured hit rate is exactly `1 - shift / K` when `C >= K + shift` (the first step,
    with an empty temporal cache, misses everything). The step counter lives on the device, so the selection also
    slides when the decode step is replayed as a CUDA graph. One instance serves every layer of a cache (state is
    kept per layer, keyed by the layer's landmarks tensor).

    Args:
        hit_rate (`float`): h in [0, 1].
    """

    def __init__(self, hit_rate: float):
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1]; got {hit_rate!r}.")
        self.hit_rate = hit_rate
        self.steps: dict[int, torch.Tensor] = {}
        self.perms: dict[int, torch.Tensor] = {}

    def select(self, query, state, selectable, k, scaling, query_mask=None):
        super().select(query, state, selectable, k, scaling, query_mask)  # the real work, result unused
        key = id(state["landmarks"])
        batch, heads, chunks = selectable.shape
        if key not in self.perms:
            self.perms[key] = torch.rand(batch, heads, chunks, device=selectable.device).argsort(dim=-1)
            self.steps[key] = torch.zeros((), dtype=torch.int64, device=selectable.device)
        step = self.steps[key]
        window = (step * self.shift(k) + torch.arange(k, device=selectable.device)) % chunks
        step += 1
        return self.perms[key].gather(-1, window.expand(batch, heads, k))

    def shift(self, k: int) -> int:
        """Entries the window slides per step when `k` chunks are selected."""
        return max(1, round((1 - self.hit_rate) * k)) if self.hit_rate < 1 else 0

    def expected_hit_rate(self, k: int) -> float:
        """The hit rate of every step after the first, when `k` chunks of at least `k + shift(k)` are selected."""
        return 1 - self.shift(k) / k


def reset_hit_counts(cache: ShadowKVCache) -> None:
    """Zero the temporal caches' hit and lookup counters (in place, so captured CUDA graphs keep counting), e.g.
    after warm-up steps, so that `cache.memory_report().hit_rate` covers only the steps after this call."""
    for layer in cache.layers:
        temporal = getattr(getattr(layer, "mode", None), "temporal", None)
        if temporal is not None:  # YAKV keeps no temporal cache; a layer before its first step has none yet
            temporal.hits.zero_()
            temporal.lookups.zero_()
