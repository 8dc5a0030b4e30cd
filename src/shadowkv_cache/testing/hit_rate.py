"""The hit rate by construction, and its counters.

Legend: B batch, Hkv KV heads, N selectable units (ShadowKV chunks, YAKV tokens), K selected units per KV head,
h hit rate.

With random weights the hit rate of a decode step means nothing, yet it sets the bytes a step moves over PCIe (a
ShadowKV miss rebuilds a chunk's keys and fetches its values, a YAKV miss fetches a token's record).
`ControlledHitRate` fixes it: it does the work of the policy it wraps and then selects so that each step keeps a
share `h` of the previous step's units.
"""

from __future__ import annotations

import torch

from ..hf.cache import ShadowKVCache
from ..hf.layer import CompressedLayer
from ..policies import LandmarkTopK
from ..policies.base import SelectionPolicy

__all__ = ["ControlledHitRate", "reset_hit_counts"]


class ControlledHitRate(SelectionPolicy):
    """Scores like `inner` (same cost, same state), then returns a selection that keeps a share `hit_rate` of the
    previous step's units: a window of `K` entries of a fixed random permutation of the `N` units, starting at a random
    entry per layer, row and head, sliding by `shift = max(1, round((1 - h) * K))` entries each step (0 at `h = 1`).

    The permutation is one `[N]` tensor shared by every layer, row and head, and each layer keeps only its windows'
    positions (`[B, Hkv, K]`): a permutation per layer, row and head (`[B, Hkv, N]` int64) held 8 MiB per layer and row
    of a 128K YAKV cache, 0.25 GiB per row over 32 layers that a benchmark counted as the cache's.

    From the second step on, the measured hit rate is exactly `1 - shift / K` when `N >= K + shift` (the first step,
    with nothing held, misses everything). The step counter lives on the device, so the selection also slides when
    the decode step is replayed as a CUDA graph. One instance serves every layer of a cache (state is kept per
    layer, keyed by the layer's policy state).

    Args:
        hit_rate (`float`): h in [0, 1].
        inner (`SelectionPolicy`, *optional*): the policy whose work each step does (`LandmarkTopK` for ShadowKV
            mode, the default; `QuantizedKeyTopK` for YAKV mode). Not one that shares the budget across heads: its
            heads select different counts, which a window of `K` per head cannot stand for.
    """

    def __init__(self, hit_rate: float, inner: SelectionPolicy | None = None):
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be in [0, 1]; got {hit_rate!r}.")
        if inner is not None and inner.shares_budget:
            raise ValueError(
                f"ControlledHitRate selects K units per head; {type(inner).__name__} shares the budget across heads. "
                "Wrap its inner policy instead (e.g. QuantizedKeyTopK)."
            )
        self.hit_rate = hit_rate
        self.inner = inner if inner is not None else LandmarkTopK()
        self.granularity = self.inner.granularity
        self.observation_window = self.inner.observation_window
        self.positions: dict[int, torch.Tensor] = {}  # per layer: its windows' entries this step, `[B, Hkv, K]` int64
        self.perms: dict[tuple[int, str], torch.Tensor] = {}  # per (N, device): the permutation, `[N]` int64

    def prepare(self, chunk_keys, recent_queries=None, scaling=None) -> dict[str, torch.Tensor]:
        extra = {"recent_queries": recent_queries, "scaling": scaling} if self.observation_window else {}
        return self.inner.prepare(chunk_keys, **extra)

    def score(self, query, state, selectable, scaling) -> torch.Tensor:
        return self.inner.score(query, state, selectable, scaling)

    def select(self, query, state, selectable, k, scaling, query_mask=None):
        self.inner.select(query, state, selectable, k, scaling, query_mask)  # the real work, result unused
        key = id(state[min(state)])
        batch, heads, units = selectable.shape
        device = selectable.device
        perm = self.perms.get((units, str(device)))
        if perm is None:
            perm = self.perms[(units, str(device))] = torch.randperm(units, device=device)
        positions = self.positions.get(key)
        if positions is None or positions.shape != (batch, heads, k):
            start = torch.randint(0, units, (batch, heads, 1), device=device)
            positions = self.positions[key] = (start + torch.arange(k, device=device)) % units
        chosen = perm.expand(batch, heads, units).gather(-1, positions)  # a view: no copy per row and head
        # Slid in place for the next step (two small kernels beside the gather: the harness should cost a step
        # little of what a real policy's selection would not).
        positions.add_(self.shift(k)).remainder_(units)
        return chosen

    def shift(self, k: int) -> int:
        """Entries the window slides per step when `k` units are selected."""
        return max(1, round((1 - self.hit_rate) * k)) if self.hit_rate < 1 else 0

    def expected_hit_rate(self, k: int) -> float:
        """The hit rate of every step after the first, when `k` units of at least `k + shift(k)` are selected."""
        return 1 - self.shift(k) / k


def reset_hit_counts(cache: ShadowKVCache) -> None:
    """Zero the hit and lookup counters of every compressed layer (ShadowKV's temporal caches, YAKV's held tokens; in
    place, so captured CUDA graphs keep counting), e.g. after warm-up steps, so that `cache.memory_report().hit_rate`
    covers only the steps after this call."""
    for layer in cache.layers:
        if isinstance(layer, CompressedLayer) and layer.is_compressed:
            layer.mode.reset_hit_counts()
