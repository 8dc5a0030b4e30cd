"""SnapKV: at prefill, the last prompt tokens (the observation window) vote for the context they attend to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024,
https://arxiv.org/abs/2404.14469 (§4, observation window voting).
"""

from __future__ import annotations

import torch

from .base import SelectionPolicy, grouped_query

__all__ = ["SnapKV"]


class SnapKV(SelectionPolicy):
    """Keeps the chunks that the last `window` prefill queries attend to most; fixed after prefill (evicting).

    A chunk's vote is the attention mass (softmax over the compressed prompt) it gets from the window's queries,
    summed over those queries and over the query heads of each GQA group. The decode query is ignored, so a
    later question that needs other chunks cannot get them back. Chunks play the part of SnapKV's pooling
    kernel (neighbouring tokens are kept together).

    Args:
        window (`int`, *optional*, defaults to 32): observation window, in prompt tokens (SnapKV uses 32).
    """

    granularity = "chunk"
    observation_window = 32

    def __init__(self, window: int = 32):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.observation_window = window

    def prepare(
        self, chunk_keys: torch.Tensor, recent_queries: torch.Tensor | None = None, scaling: float | None = None
    ) -> dict[str, torch.Tensor]:
        if recent_queries is None:
            raise ValueError("SnapKV needs the observation window's queries; the cache passes them at prefill.")
        batch, heads, num_chunks, c, dim = chunk_keys.shape
        scaling = dim**-0.5 if scaling is None else scaling
        keys = chunk_keys.flatten(2, 3).float()  # [B, Hkv, C*c, D]
        q = grouped_query(recent_queries, heads).float()  # [B, Hkv, G, W, D]
        logits = torch.einsum("bhgwd,bhnd->bhgwn", q, keys) * scaling
        real = chunk_keys.ne(0).any(dim=-1).flatten(2)  # [B, Hkv, C*c]; padding chunks hold zeros
        probs = torch.softmax(logits.masked_fill(~real[:, :, None, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
        votes = probs.sum(dim=(2, 3)).view(batch, heads, num_chunks, c).sum(dim=-1)
        return {"votes": votes}  # [B, Hkv, C]

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return state["votes"]
