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
        logits = landmark_logits(q.to(landmarks.dtype), landmarks)
        # Unselectable chunks take no share of the softmax. The dtype's lowest value gives exp() = 0 as -inf does,
        # and a head with nothing selectable then gets a uniform softmax rather than NaN, so no pass over the
        # probabilities has to clear NaNs (the caller masks such heads' scores anyway, `masked_scores`).
        logits = torch.where(selectable[:, :, None, None, :], logits, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [B, Hkv, G, T, C]
        # A one-token step sums over one query token: a view, not a pass over the probabilities.
        summed = probs[:, :, :, 0] if probs.shape[3] == 1 else probs.sum(dim=3)
        return summed.amax(dim=2)  # [B, Hkv, C]


def landmark_logits(q: torch.Tensor, landmarks: torch.Tensor, pad_rows: bool | None = None) -> torch.Tensor:
    """`q` `[B, Hkv, G, T, D]` times `landmarks` `[B or 1, Hkv, C, D]`: logits `[B, Hkv, G, T, C]`.

    cuBLAS's fast GEMM kernels need every leading dimension 16-byte aligned. The `[..., C]` output of
    `q · landmarksᵀ` is not when C (the selectable chunks: a prompt's chunks less its outliers and local window) is
    not a multiple of 8, and the GEMM then falls back to a kernel 2.3x slower (an H200 at batch 32, 128K, in
    `profile_decode.py`: 0.62 against 0.26 ms per layer). So on CUDA such a product is taken the other way round,
    `landmarks · qᵀ` with the query rows padded with zeros to a multiple of 8, and its `[..., C, rows]` output
    transposed back. `pad_rows` forces either way (None: that choice).
    """
    batch, heads, group, steps, dim = q.shape
    chunks, shared = landmarks.shape[2], landmarks.shape[0] == 1 and batch > 1
    if pad_rows is None:
        pad_rows = landmarks.is_cuda and chunks % 8 != 0
    if not pad_rows:
        return torch.einsum("bhgtd,bhcd->bhgtc", q, landmarks)
    rows = q.reshape(batch, heads, group * steps, dim)
    if shared:  # one document for every row: the rows' queries share one product per head
        rows = rows.transpose(0, 1).reshape(1, heads, batch * group * steps, dim)
    count = rows.shape[2]
    padded = rows.new_zeros((*rows.shape[:2], -(-count // 8) * 8, dim))
    padded[:, :, :count] = rows
    logits = torch.matmul(landmarks, padded.transpose(-1, -2))[..., :count].transpose(-1, -2)
    if shared:
        logits = logits.reshape(heads, batch, group * steps, chunks).transpose(0, 1)
    return logits.contiguous().view(batch, heads, group, steps, chunks)
