"""Chunk landmarks and outlier chunks (ShadowKV §3.2).

Legend: Hkv KV heads, C chunks, c chunk size, D head dim, O outlier chunks.

A landmark is the mean post-RoPE key of a chunk, stored in the KV dtype or as int8 codes with one fp32 scale per
landmark (`quantize_landmarks`: half the bytes, which every decode step's scoring reads). Chunks whose keys are
poorly summarised by their mean (lowest minimum cosine similarity between the landmark and the chunk's keys) are
"outliers": they stay exact on the accelerator and are removed from selection.
"""

from __future__ import annotations

import torch

from .fp32_products import matmul_fp32

__all__ = ["chunk_landmarks", "outlier_chunks", "quantize_landmarks"]

_EPS = 1e-8  # F.cosine_similarity's


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """fp32 sums for 16- and 32-bit keys; a float64 model keeps its own precision (torch refuses to narrow it)."""
    return torch.promote_types(dtype, torch.float32)


def chunk_landmarks(chunk_keys: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean key of each chunk: `[..., C, c, D]` -> `[..., C, D]`, summed in fp32 (without an fp32 copy of the keys)
    and returned in `dtype` (default: the keys')."""
    return chunk_keys.mean(dim=-2, dtype=_accumulation(chunk_keys.dtype)).to(dtype or chunk_keys.dtype)


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

    `chunk_keys` is `[Hkv, C, c, D]`, `landmarks` `[Hkv, C, D]`. The similarity is `F.cosine_similarity`'s (each norm
    clamped to 1e-8) up to fp32 rounding order, from fp32 sums of the keys as stored: no fp32 copy of them.
    """
    heads, chunks, c, dim = chunk_keys.shape
    landmarks = landmarks.to(chunk_keys.dtype)
    dots = matmul_fp32(chunk_keys.reshape(heads * chunks, c, dim), landmarks.reshape(heads * chunks, dim, 1))
    acc = _accumulation(chunk_keys.dtype)
    key_norms = torch.linalg.vector_norm(chunk_keys, dim=-1, dtype=acc).clamp_min_(_EPS)  # [Hkv, C, c]
    mark_norms = torch.linalg.vector_norm(landmarks, dim=-1, dtype=acc).clamp_min_(_EPS)  # [Hkv, C]
    sim = dots.view(heads, chunks, c) / (key_norms * mark_norms[..., None])
    worst = sim.min(dim=-1).values  # [Hkv, C]
    return worst.topk(num_outliers, dim=-1, largest=False).indices
