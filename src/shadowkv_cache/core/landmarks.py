"""Chunk landmarks and outlier chunks (ShadowKV §3.2).

Legend: Hkv KV heads, C chunks, c chunk size, D head dim, O outlier chunks.

A landmark is the mean post-RoPE key of a chunk. Chunks whose keys are poorly summarised by their mean
(lowest minimum cosine similarity between the landmark and the chunk's keys) are "outliers": they stay
exact on the accelerator and are removed from selection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_landmarks", "outlier_chunks"]


def chunk_landmarks(chunk_keys: torch.Tensor) -> torch.Tensor:
    """Mean key of each chunk: `[Hkv, C, c, D]` -> `[Hkv, C, D]` (computed in fp32, returned in the input dtype)."""
    return chunk_keys.float().mean(dim=-2).to(chunk_keys.dtype)


def outlier_chunks(chunk_keys: torch.Tensor, landmarks: torch.Tensor, num_outliers: int) -> torch.Tensor:
    """Indices `[Hkv, O]` of the `num_outliers` chunks per head with the lowest min cosine similarity.

    `chunk_keys` is `[Hkv, C, c, D]`, `landmarks` `[Hkv, C, D]`.
    """
    sim = F.cosine_similarity(chunk_keys.float(), landmarks.float().unsqueeze(-2), dim=-1)  # [Hkv, C, c]
    worst = sim.min(dim=-1).values  # [Hkv, C]
    return worst.topk(num_outliers, dim=-1, largest=False).indices
