"""ShadowKV's chunk selection: softmax over landmarks, summed over query tokens, max over each GQA group.

Sun et al., "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference", ICML 2025,
https://arxiv.org/abs/2410.21465 (§3.2, accurate KV selection).
"""

from __future__ import annotations

import torch

from ..landmarks import chunk_landmarks
from ..ops.landmark_scores import landmark_scores
from .base import SelectionPolicy

__all__ = ["LandmarkTopK"]


class LandmarkTopK(SelectionPolicy):
    """Scores each chunk by the attention its landmark (mean post-RoPE key) would get."""

    granularity = "chunk"

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"landmarks": chunk_landmarks(chunk_keys)}  # [B, Hkv, C, D]

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return landmark_scores(query, state["landmarks"], selectable, scaling)  # [B, Hkv, C]
