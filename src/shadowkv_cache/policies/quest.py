"""Quest's page bound: per-chunk, per-channel min and max of the keys bound each chunk's attention logit.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
https://arxiv.org/abs/2406.10774 (§3.2, criticality estimation per page).
"""

from __future__ import annotations

import torch

from .base import SelectionPolicy, grouped_query

__all__ = ["Quest"]


class Quest(SelectionPolicy):
    """Scores a chunk (Quest's page) by the upper bound `sum_d max(q_d * min_d, q_d * max_d)` of `q·k` over its keys.

    The bounds are aggregated like ShadowKV's landmark scores (softmax over chunks, summed over query tokens,
    max over each GQA group), so the two differ only in how a chunk's logit is estimated.
    """

    granularity = "chunk"

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"key_min": chunk_keys.amin(dim=-2), "key_max": chunk_keys.amax(dim=-2)}  # [B, Hkv, C, D] each

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        key_min, key_max = state["key_min"].float(), state["key_max"].float()
        q = grouped_query(query, key_min.shape[1]).float()  # [B, Hkv, G, T, D]
        # max(q*min, q*max) is q*max where q >= 0 and q*min where q < 0.
        bound = torch.einsum("bhgtd,bhcd->bhgtc", q.clamp(min=0), key_max)
        bound = bound + torch.einsum("bhgtd,bhcd->bhgtc", q.clamp(max=0), key_min)
        logits = (bound * scaling).masked_fill(~selectable[:, :, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with nothing selectable selects nothing
        return probs.sum(dim=3).amax(dim=2)  # [B, Hkv, C]
