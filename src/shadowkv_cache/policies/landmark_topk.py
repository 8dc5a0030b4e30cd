"""ShadowKV's chunk selection: softmax over landmarks, summed over query tokens, max over each GQA group.

Sun et al., "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference", ICML 2025,
https://arxiv.org/abs/2410.21465 (§3.2, accurate KV selection).
"""

from __future__ import annotations

import torch

from ..core.landmarks import chunk_landmarks
from .base import SelectionPolicy, grouped_query

__all__ = ["LandmarkTopK"]


class LandmarkTopK(SelectionPolicy):
    """Scores each chunk by the attention its landmark (mean post-RoPE key) would get."""

    granularity = "chunk"

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"landmarks": chunk_landmarks(chunk_keys)}  # [B, Hkv, C, D]

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        landmarks = state["landmarks"]
        # Rows sharing one document hold stride-0 views: score against the one copy, which einsum broadcasts,
        # rather than materialising a copy per row.
        if landmarks.shape[0] > 1 and landmarks.stride(0) == 0:
            landmarks = landmarks[:1]
        q = grouped_query(query * scaling, landmarks.shape[1])  # [B, Hkv, G, T, D]
        # A GEMM in the KV dtype (fp32 accumulation): the landmarks are the largest tensor a step reads, and
        # converting them to fp32 first would triple those bytes. On an H200 this GEMM and the softmax below
        # (0.60 ms per layer at batch 32, 128K) beat a fused CUDA kernel that streamed the landmarks once
        # (1.0-1.1 ms), so there is no kernel here.
        logits = torch.einsum("bhgtd,bhcd->bhgtc", q.to(landmarks.dtype), landmarks)
        logits = logits.masked_fill(~selectable[:, :, None, None, :], float("-inf"))
        # A row with nothing selectable has an all -inf softmax (NaN); it selects nothing anyway.
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).nan_to_num(0.0)
        return probs.sum(dim=3).amax(dim=2)  # [B, Hkv, C]
