"""Selection quality measured directly: how much of the exact attention mass the selected chunks hold.

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, C chunks, K selected chunks, L layers.

`SelectionProbe` wraps any `SelectionPolicy` and changes nothing it selects. It keeps the exact post-RoPE keys
of the prompt's chunks (saved at prefill), and at every decode step and layer it computes each query head's exact
softmax attention over the selectable chunks' tokens (the prompt minus outliers and local window, which every
method keeps anyway) and records

- recall: the share of that mass on the chunks the policy selected;
- oracle recall: the same for the best `K` chunks of that KV head (top-K by mass summed over the group's heads).

Both are averaged over layers, query heads, query tokens and steps (per layer in `per_layer()`). They do not
depend on whether the model can do the task, which matters for a 135M model (SPEC §6).
"""

from __future__ import annotations

import torch

from shadowkv_cache.policies import SelectionPolicy
from shadowkv_cache.policies.oracle import exact_chunk_mass

__all__ = ["SelectionProbe"]


class SelectionProbe(SelectionPolicy):
    """Wraps `inner`; the cache calls `select` once per layer per step, layers in order (`num_layers` of them)."""

    def __init__(self, inner: SelectionPolicy, num_layers: int):
        self.inner, self.num_layers = inner, num_layers
        self.granularity = inner.granularity
        self.observation_window = inner.observation_window
        self.calls = 0
        self._sums: torch.Tensor | None = None  # [L, 3]: recall, oracle recall, units

    def prepare(self, chunk_keys, recent_queries=None, scaling=None) -> dict[str, torch.Tensor]:
        extra = {"recent_queries": recent_queries, "scaling": scaling} if self.observation_window else {}
        return {**self.inner.prepare(chunk_keys, **extra), "exact_keys": chunk_keys}

    def score(self, query, state, selectable, scaling) -> torch.Tensor:
        return self.inner.score(query, state, selectable, scaling)

    def select(self, query, state, selectable, k, scaling, query_mask=None) -> torch.Tensor:
        extra = () if query_mask is None else (query_mask,)  # `[B, T]` real query tokens of a padded step
        chosen = self.inner.select(query, state, selectable, k, scaling, *extra)  # [B, Hkv, K]
        mass = exact_chunk_mass(query, state["exact_keys"], selectable, scaling)  # [B, Hkv, G, T, C]
        counted = selectable.any(dim=-1)[:, :, None, None].expand(*mass.shape[:4])  # rows that were compressed
        if query_mask is not None:
            counted = counted & query_mask[:, None, None, :]
        mass = mass * counted[..., None]
        best = mass.sum(dim=(2, 3)).masked_fill(~selectable, float("-inf")).topk(k, dim=-1).indices

        def held(index: torch.Tensor) -> torch.Tensor:  # [B, Hkv, G, T]
            return mass.gather(-1, index[:, :, None, None, :].expand(*mass.shape[:4], -1)).sum(dim=-1)

        sums = torch.stack(
            [held(chosen)[counted].sum(), held(best)[counted].sum(), counted.sum().to(mass.dtype)]
        ).double()
        if self._sums is None:
            self._sums = torch.zeros((self.num_layers, 3), dtype=torch.float64, device=mass.device)
        self._sums[self.calls % self.num_layers] += sums
        self.calls += 1
        return chosen

    @property
    def steps(self) -> int:
        return self.calls // self.num_layers

    def per_layer(self) -> list[tuple[float, float]]:
        """`(recall, oracle recall)` of each layer (NaN before any step)."""
        if self._sums is None:
            return [(float("nan"), float("nan"))] * self.num_layers
        sums = self._sums.cpu()
        return [(r / n, o / n) if n else (float("nan"), float("nan")) for r, o, n in sums.tolist()]

    def totals(self) -> tuple[float, float, float]:
        """Sums over layers: `(recall mass, oracle recall mass, units)`, for pooling several runs."""
        if self._sums is None:
            return 0.0, 0.0, 0.0
        r, o, n = self._sums.sum(dim=0).tolist()
        return r, o, n
