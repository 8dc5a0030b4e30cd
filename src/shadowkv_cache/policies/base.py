"""The selection-policy interface: a policy scores chunks (or tokens); the base class does budget and top-k.

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, D head dim, N scored units (chunks or tokens),
c tokens per unit, K selected units.

A policy only sees tensors: it never touches host memory, model classes or the cache's layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch

from ..ops.select_topk import kernel_fits, select_topk_op

__all__ = ["SelectionPolicy", "best_indices", "grouped_query"]

# Without the top-k kernel (`SHADOWKV_KERNELS=0`, no cuda-python): torch.topk gives each row one thread block while
# rows are few and shorter than 20,000 (its multi-block kernel starts there: `should_use_multiblock` in ATen's
# TensorTopK.cu). At batch 1 and 128K that is 8 blocks for 8 rows of 16K chunks: 2.96 ms of a 16 ms step on an H200
# machine (decode_profile_128k_batch1), so such rows go through `two_stage_topk`.
_FEW_ROWS, _SHORT_ROW = 20, 20_000


def grouped_query(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[B, Hq, T, D]` -> `[B, Hkv, G, T, D]` with `G = Hq // Hkv` query heads per KV head (GQA)."""
    b, hq, t, d = query.shape
    return query.view(b, num_kv_heads, hq // num_kv_heads, t, d)


def best_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices `[..., k]` of the `k` largest of `scores` `[..., N]`, best first: `torch.topk`'s, up to which of equally
    scored units are taken and their order. On CUDA with the kernels, `k` up to 16384 takes the top-k kernels
    (`ops/select_topk.py`: ShadowKV's chunk rows and YAKV's token rows alike, equal scores by ascending index);
    otherwise few rows shorter than torch.topk's multi-block size go through `two_stage_topk`."""
    n = scores.shape[-1]
    if kernel_fits(scores, k):
        return select_topk_op(scores, k)  # `select_topk` would ask `kernel_fits` again
    rows = scores.numel() // max(n, 1)
    part = 4 * k
    if scores.is_cuda and k > 0 and 0 < rows <= _FEW_ROWS and 2 * part <= n < _SHORT_ROW:
        return two_stage_topk(scores, k, part)
    return scores.topk(k, dim=-1).indices


def two_stage_topk(scores: torch.Tensor, k: int, part: int) -> torch.Tensor:
    """`best_indices` in two passes: the top `k` of every `part` consecutive scores of a row (many short rows, so
    many blocks), then the top `k` of those candidates and the scores past the last whole part. The top `k` of a row
    are among its parts' top `k`, so the result is exact. Needs `k <= part <= N`."""
    n = scores.shape[-1]
    parts = n // part
    whole = parts * part
    top = scores[..., :whole].unflatten(-1, (parts, part)).topk(k, dim=-1, sorted=False)  # [..., P, k]
    starts = torch.arange(0, whole, part, device=scores.device)[:, None]
    rest = scores[..., whole:]
    values = torch.cat((top.values.flatten(-2), rest), dim=-1)  # [..., P*k + N - whole]
    tail = torch.arange(whole, n, device=scores.device).expand(rest.shape)
    indices = torch.cat(((top.indices + starts).flatten(-2), tail), dim=-1)
    return indices.gather(-1, values.topk(k, dim=-1).indices)


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
    # Settings added after prefix files first recorded this policy, each with the value that a file written before
    # it was made with (prefix/format.py `settings_as_saved`), whatever the default is now.
    settings_before: ClassVar[dict[str, object]] = {}

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
        return best_indices(self.masked_scores(query, state, selectable, scaling, query_mask), k)

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
