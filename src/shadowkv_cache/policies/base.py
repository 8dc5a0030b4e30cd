"""The selection-policy interface: a policy scores chunks (or tokens); the base class does budget and top-k.

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, D head dim, N scored units (chunks or tokens),
c tokens per unit, K selected units.

A policy only sees tensors: it never touches host memory, model classes or the cache's layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch

__all__ = ["SelectionPolicy", "grouped_query"]


def grouped_query(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[B, Hq, T, D]` -> `[B, Hkv, G, T, D]` with `G = Hq // Hkv` query heads per KV head (GQA)."""
    b, hq, t, d = query.shape
    return query.view(b, num_kv_heads, hq // num_kv_heads, t, d)


class SelectionPolicy(ABC):
    """Chooses which units of the offloaded prompt a decode step attends to.

    `prepare` runs once at prefill on the post-RoPE keys and returns the policy's state (landmarks, digests,
    quantised keys ...), a dict of tensors whose first dim is the batch row so the cache can reorder and
    select rows without knowing what they hold. `score` returns `[B, Hkv, N]`, higher is more relevant;
    the base class masks what may not be selected and takes the top-k.
    """

    granularity: ClassVar[Literal["chunk", "token"]] = "chunk"
    # How many of the last prefill queries `prepare` wants (SnapKV's observation window); 0 = none. When
    # positive, `prepare` also gets `recent_queries` `[B, Hq, W, D]` and the model's attention `scaling`.
    observation_window: ClassVar[int] = 0
    # True when the heads of a layer share one budget and so get different counts (`select_valid`).
    shares_budget: ClassVar[bool] = False

    @abstractmethod
    def prepare(
        self, chunk_keys: torch.Tensor, recent_queries: torch.Tensor | None = None, scaling: float | None = None
    ) -> dict[str, torch.Tensor]:
        """State from post-RoPE keys `[B, Hkv, N, c, D]` (padding chunks hold zeros).

        `recent_queries` (the last `observation_window` prefill queries, real tokens of every row since pads are
        on the left) and `scaling` are passed only to policies whose `observation_window` is positive.
        """

    @abstractmethod
    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Relevance `[B, Hkv, N]` of each unit for `query` `[B, Hq, T, D]`; `selectable` is `[B, Hkv, N]` bool."""

    def select(
        self,
        query: torch.Tensor,
        state: dict[str, torch.Tensor],
        selectable: torch.Tensor,
        k: int,
        scaling: float,
        query_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Indices `[B, Hkv, k]` of the `k` best selectable units, best first (no host synchronisation).

        `query_mask` (`[B, T]` bool, *optional*) marks the real query tokens of a multi-token step whose rows
        hold pads (questions left-padded after a shared document): each row is then scored on its real tokens
        alone, as it would be without the batch (one host synchronisation per row, on such steps only).
        """
        return self.masked_scores(query, state, selectable, scaling, query_mask).topk(k, dim=-1).indices

    def masked_scores(
        self,
        query: torch.Tensor,
        state: dict[str, torch.Tensor],
        selectable: torch.Tensor,
        scaling: float,
        query_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`score` as float32 `[B, Hkv, N]`, `-inf` where not selectable (`query_mask` as in `select`)."""
        if query_mask is None:
            scores = self.score(query, state, selectable, scaling).float()
        else:
            scores = torch.cat(
                [
                    self.score(
                        query[row : row + 1, :, query_mask[row]],
                        {name: t[row : row + 1] for name, t in state.items()},
                        selectable[row : row + 1],
                        scaling,
                    ).float()
                    for row in range(query.shape[0])
                ]
            )
        return torch.where(selectable, scores, float("-inf"))

    def select_valid(
        self,
        query: torch.Tensor,
        state: dict[str, torch.Tensor],
        selectable: torch.Tensor,
        k: int,
        scaling: float,
        query_mask: torch.Tensor | None = None,
        budget: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices `[B, Hkv, K']` and their validity `[B, Hkv, K']` bool, for layers that let heads differ.

        `budget` (`[B]` int64, *optional*, each `<= k`) is each row's units per KV head. By default this is
        `select` with `K' = k` and the first `budget[row]` entries of every head valid (all, without `budget`).
        A policy that shares the budget across heads (`SharedBudgetTopK`) overrides it: its heads get
        different counts, so `K'` may exceed `k` and the unused entries are marked invalid.
        """
        ids = self.select(query, state, selectable, k, scaling, query_mask)
        if budget is None:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        valid = torch.arange(k, device=ids.device) < budget.to(ids.device)[:, None, None]
        return ids, valid.expand_as(ids)
