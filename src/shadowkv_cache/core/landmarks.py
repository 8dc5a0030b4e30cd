"""Chunk landmarks and outlier chunks (ShadowKV §3.2).

Legend: Hkv KV heads, C chunks, c chunk size, D head dim, O outlier chunks.

A landmark is the mean post-RoPE key of a chunk, stored in the KV dtype or as int8 codes with one fp32 scale per
landmark (`quantize_landmarks`: half the bytes, which every decode step's scoring reads). Chunks whose keys are
poorly summarised by their mean (lowest minimum cosine similarity between the landmark and the chunk's keys) are
"outliers": they stay exact on the accelerator and are removed from selection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunk_landmarks", "outlier_chunks", "quantize_landmarks"]


def chunk_landmarks(chunk_keys: torch.Tensor) -> torch.Tensor:
    """Mean key of each chunk: `[Hkv, C, c, D]` -> `[Hkv, C, D]` (computed in fp32, returned in the input dtype)."""
    return chunk_keys.float().mean(dim=-2).to(chunk_keys.dtype)


def quantize_landmarks(landmarks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes `[..., C, D]` and fp32 scales `[..., C]` of `landmarks` `[..., C, D]`: each landmark's largest
    coordinate maps to ±127 (symmetric, round to nearest), so `codes * scales` is the landmark within half a step.
    An all-zero landmark (a padding chunk) gets scale 0 and zero codes."""
    x = landmarks.float()
    scales = x.abs().amax(dim=-1) / 127
    safe = torch.where(scales > 0, scales, 1.0)
    codes = torch.round(x / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def outlier_chunks(chunk_keys: torch.Tensor, landmarks: torch.Tensor, num_outliers: int) -> torch.Tensor:
    """Indices `[Hkv, O]` of the `num_outliers` chunks per head with the lowest min cosine similarity.

    `chunk_keys` is `[Hkv, C, c, D]`, `landmarks` `[Hkv, C, D]`.
    """
    sim = F.cosine_similarity(chunk_keys.float(), landmarks.float().unsqueeze(-2), dim=-1)  # [Hkv, C, c]
    worst = sim.min(dim=-1).values  # [Hkv, C]
    return worst.topk(num_outliers, dim=-1, largest=False).indices
