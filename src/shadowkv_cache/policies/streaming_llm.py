"""StreamingLLM: attention sinks (the first tokens) plus the most recent tokens; everything else is evicted.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
https://arxiv.org/abs/2309.17453 (§3.2, rolling KV cache with attention sinks).
"""

from __future__ import annotations

import torch

from .base import SelectionPolicy

__all__ = ["StreamingLLM"]


class StreamingLLM(SelectionPolicy):
    """Keeps the first `sink_chunks` chunks and the most recent chunks, whatever the query (an evicting method).

    The selection depends only on positions, so it is the same at every step: what falls outside it is never
    seen again, as with an evicting cache. The cache's outliers and local window come on top, as for every policy.

    Args:
        sink_chunks (`int`, *optional*, defaults to 1): leading chunks kept as attention sinks (StreamingLLM keeps
            4 sink tokens; one chunk of 8 holds them).
    """

    granularity = "chunk"

    def __init__(self, sink_chunks: int = 1):
        if sink_chunks < 0:
            raise ValueError(f"sink_chunks must be >= 0, got {sink_chunks}")
        self.sink_chunks = sink_chunks

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        batch, heads, num_chunks = chunk_keys.shape[:3]
        # Later chunks score higher; sinks score above all. Chunks start at each row's first real token.
        order = torch.arange(num_chunks, dtype=torch.float32, device=chunk_keys.device)
        order[: self.sink_chunks] += num_chunks
        return {"recency": order.expand(batch, heads, num_chunks).contiguous()}  # [B, Hkv, C]

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return state["recency"]
