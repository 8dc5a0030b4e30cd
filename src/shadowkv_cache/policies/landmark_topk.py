"""ShadowKV's chunk selection: softmax over landmarks, summed over query tokens, max over each GQA group.

Sun et al., "ShadowKV: KV Cache in Shadows for High-Throughput Long-Context LLM Inference", ICML 2025,
https://arxiv.org/abs/2410.21465 (§3.2, accurate KV selection).
"""

from __future__ import annotations

import torch

from ..core.landmarks import chunk_landmarks, quantize_landmarks
from ..ops.landmark_logits import landmark_logits_int8, landmark_logits_native_op, native_kernel_fits
from ..ops.landmark_scores import landmark_scores, softmax_group_max
from .base import SelectionPolicy, grouped_query

__all__ = ["LANDMARK_FORMATS", "LandmarkTopK"]

LANDMARK_FORMATS = ("native", "int8")


class LandmarkTopK(SelectionPolicy):
    """Scores each chunk by the attention its landmark (mean post-RoPE key) would get.

    Args:
        landmark_format (`str`, *optional*, defaults to `"native"`): how the landmarks are kept on the device.
            `"native"` in the KV dtype; `"int8"` as int8 codes with one fp32 scale per landmark (`8 + 32/D` bits per
            value: half of bf16's bytes, which a decode step reads at every step and which at long context are
            most of its HBM traffic). On SmolLM2 at 4K-8K tokens int8 landmarks select 99% of the chunks the
            model's own do (docs/results.md, "Landmark precision").

    >>> policy = LandmarkTopK(landmark_format="int8")  # ShadowKVCache(model, policy=policy)
    """

    granularity = "chunk"
    settings_before = {"landmark_format": "native"}  # files from before the setting hold model-dtype landmarks
    landmark_format = "native"  # also for subclasses whose own __init__ does not call this one

    def __init__(self, landmark_format: str = "native"):
        if landmark_format not in LANDMARK_FORMATS:
            raise ValueError(
                f"LandmarkTopK(landmark_format={landmark_format!r}) is invalid: use one of "
                f"{', '.join(map(repr, LANDMARK_FORMATS))}."
            )
        self.landmark_format = landmark_format

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """The landmarks of post-RoPE keys `[B, Hkv, C, c, D]`, in this policy's format (`state_of`)."""
        return self.state_of(chunk_landmarks(chunk_keys, torch.float32), chunk_keys.dtype)

    def state_of(self, landmarks: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The policy state of `landmarks` `[B, Hkv, C, D]` (any float dtype, converted from): `{"landmarks"}` in
        `dtype` (native), or `{"landmark_codes"}` int8 `[B, Hkv, C, D]` and `{"landmark_scales"}` fp32 `[B, Hkv, C]`."""
        if self.landmark_format == "native":
            return {"landmarks": landmarks.to(dtype)}
        codes, scales = quantize_landmarks(landmarks)
        return {"landmark_codes": codes, "landmark_scales": scales}

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return softmax_group_max(self._logits(query, state, scaling), selectable)  # [B, Hkv, C]

    def masked_scores(
        self,
        query: torch.Tensor,
        state: dict[str, torch.Tensor],
        selectable: torch.Tensor,
        scaling: float,
        query_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # A subclass that scores otherwise keeps the base class's masking of its own `score`.
        if query_mask is not None or type(self).score is not LandmarkTopK.score:
            return super().masked_scores(query, state, selectable, scaling, query_mask)
        # The masked scores in one op: on CUDA one kernel over the GEMM's output as it lies (ops/landmark_scores.py).
        return landmark_scores(self._logits(query, state, scaling), selectable)

    def _logits(self, query: torch.Tensor, state: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """`[B, Hkv, G, T, C]` logits of `query` `[B, Hq, T, D]` against the landmarks, possibly a strided view."""
        if self.landmark_format == "int8":
            codes, scales = _one_copy(state["landmark_codes"]), _one_copy(state["landmark_scales"])
            return landmark_logits_int8(grouped_query(query * scaling, codes.shape[1]), codes, scales)
        landmarks = _one_copy(state["landmarks"])
        q = grouped_query(query * scaling, landmarks.shape[1])  # [B, Hkv, G, T, D]
        q = q.to(landmarks.dtype)
        # One-token steps: the tensor-core kernel, which reads the landmarks once with no padding of the query rows
        # (ops/landmark_logits.py). Otherwise a GEMM in the KV dtype (fp32 accumulation), since the landmarks are the
        # largest tensor a step reads and converting them to fp32 first would triple those bytes. On an H200 that
        # GEMM beat a fused CUDA kernel that streamed the landmarks once and did the softmax as well (1.0-1.1 ms
        # against 0.60 ms per layer at batch 32, 128K, with the softmax), so only what follows the logits is a kernel.
        if native_kernel_fits(q, landmarks):
            return landmark_logits_native_op(q, landmarks).transpose(2, 3).unsqueeze(3)
        return landmark_logits(q, landmarks)


def _one_copy(t: torch.Tensor) -> torch.Tensor:
    """Rows sharing one document hold stride-0 views of its state: score against the one copy, which the products
    broadcast, rather than materialising a copy per row."""
    return t[:1] if t.shape[0] > 1 and t.stride(0) == 0 else t


def landmark_logits(q: torch.Tensor, landmarks: torch.Tensor, pad_rows: bool | None = None) -> torch.Tensor:
    """`q` `[B, Hkv, G, T, D]` times `landmarks` `[B or 1, Hkv, C, D]`: logits `[B, Hkv, G, T, C]`.

    cuBLAS's fast GEMM kernels need every leading dimension 16-byte aligned. The `[..., C]` output of
    `q · landmarksᵀ` is not when C (the selectable chunks: a prompt's chunks less its outliers and local window) is
    not a multiple of 8, and the GEMM then falls back to a kernel 2.3x slower (an H200 at batch 32, 128K, in
    `profile_decode.py`: 0.62 against 0.26 ms per layer). So on CUDA such a product is taken the other way round,
    `landmarks · qᵀ` with the query rows padded with zeros to a multiple of 8, and its `[..., C, rows]` output
    returned as a transposed view (not contiguous). `pad_rows` forces either way (None: that choice).
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
    # In the captured step a memset node precedes this GEMM, after which the device idles ~14 us at every layer on an
    # H200 machine (0.43 ms of the batch-1 step at 128K). It is not the padding's: padding with copies of the rows (no
    # fill at all) left it (`decode_profile_128k_batch1_cat`), so likely cuBLAS's own. Not yet removed.
    padded = rows.new_zeros((*rows.shape[:2], -(-count // 8) * 8, dim))
    padded[:, :, :count] = rows
    logits = torch.matmul(landmarks, padded.transpose(-1, -2))[..., :count].transpose(-1, -2)
    if shared:
        logits = logits.reshape(heads, batch, group * steps, chunks).transpose(0, 1)
    # A view of the GEMM's output: the scores read it where it lies (ops/landmark_scores.py).
    return logits.reshape(batch, heads, group, steps, chunks)
