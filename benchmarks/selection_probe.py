"""Selection quality measured directly: how much of the exact attention mass the selected chunks hold.

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, C chunks, K selected chunks, L layers.

`SelectionProbe` wraps any `SelectionPolicy` and changes nothing it selects. It keeps the exact post-RoPE keys
of the prompt's chunks (saved at prefill), and at every decode step and layer it computes each query head's exact
softmax attention over the selectable chunks' tokens (the prompt minus outliers and local window, which every
method keeps anyway) and records

- recall: the share of that mass on the chunks the policy selected;
- oracle recall: the same for the best `K` chunks of that KV head (top-K by mass summed over the group's heads).

Both are averaged over layers, query heads, query tokens and steps (per layer in `per_layer()`). They do not
depend on whether the model can do the task, which matters for a 135M model .

With `count_kept=True` the denominator is every real unit the policy was given, the ones that may not be selected
(ShadowKV's outlier chunks, kept exact on the device) included, and those count as covered by the selection and by
the oracle alike: the share of the mass over the offloaded prompt that the attended tokens hold, comparable across
methods that keep different units exact (real units are told from padding by their nonzero keys).

A policy that shares the budget across the heads of a layer (`SharedBudgetTopK`, selecting through
`select_valid`) is measured on its valid entries, and its oracle shares the budget too: the best `Hkv*K` (head,
unit) pairs of the row by mass summed over each group's heads.
"""

from __future__ import annotations

import torch

from shadowkv_cache.policies import SelectionPolicy
from shadowkv_cache.policies.oracle import exact_chunk_mass

__all__ = ["SelectionProbe"]


class SelectionProbe(SelectionPolicy):
    """Wraps `inner`; the cache calls `select` once per layer per step, layers in order (`num_layers` of them)."""

    def __init__(self, inner: SelectionPolicy, num_layers: int, count_kept: bool = False):
        self.inner, self.num_layers, self.count_kept = inner, num_layers, count_kept
        self.granularity = inner.granularity
        self.observation_window = inner.observation_window
        self.shares_budget = inner.shares_budget
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
        self._record(query, state, selectable, k, scaling, query_mask, chosen, torch.ones_like(chosen, dtype=bool))
        return chosen

    def select_valid(self, query, state, selectable, k, scaling, query_mask=None, budget=None):
        chosen, valid = self.inner.select_valid(query, state, selectable, k, scaling, query_mask, budget)
        self._record(query, state, selectable, k, scaling, query_mask, chosen, valid)
        return chosen, valid

    def _record(self, query, state, selectable, k, scaling, query_mask, chosen, valid) -> None:
        """Adds this layer's recall and oracle recall of `chosen` `[B, Hkv, K']` (entries where `valid`)."""
        keys = state["exact_keys"]
        real = keys.flatten(-2).ne(0).any(dim=-1) if self.count_kept else selectable  # [B, Hkv, C]
        kept = real & ~selectable  # exact on the device whatever the selection
        mass = exact_chunk_mass(query, keys, real, scaling)  # [B, Hkv, G, T, C]
        counted = real.any(dim=-1)[:, :, None, None].expand(*mass.shape[:4])  # rows that were compressed
        if query_mask is not None:
            counted = counted & query_mask[:, None, None, :]
        mass = mass * counted[..., None]
        by_unit = mass.sum(dim=(2, 3)).masked_fill(~selectable, float("-inf"))  # [B, Hkv, C]
        if self.inner.shares_budget:
            best = torch.zeros_like(selectable).flatten(1)
            best.scatter_(1, by_unit.flatten(1).topk(k * selectable.shape[1], dim=-1).indices, True)
            best = best.view_as(selectable)
        else:
            best = torch.zeros_like(selectable).scatter_(-1, by_unit.topk(k, dim=-1).indices, True)
        # Invalid slots may repeat an id: count valid hits, so their order cannot matter.
        picked = torch.zeros(selectable.shape, dtype=torch.int32, device=chosen.device)
        picked = picked.scatter_add_(-1, chosen, valid.to(torch.int32)) > 0  # [B, Hkv, C]

        def held(units: torch.Tensor) -> torch.Tensor:  # [B, Hkv, G, T]
            return (mass * units[:, :, None, None, :]).sum(dim=-1)

        sums = torch.stack(
            [
                held(picked | kept)[counted].sum(),
                held((best & selectable) | kept)[counted].sum(),
                counted.sum().to(mass.dtype),
            ]
        ).double()
        if self._sums is None:
            self._sums = torch.zeros((self.num_layers, 3), dtype=torch.float64, device=mass.device)
        self._sums[self.calls % self.num_layers] += sums
        self.calls += 1

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
