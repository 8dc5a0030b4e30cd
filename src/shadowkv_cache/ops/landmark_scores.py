"""Landmark scores of a one-token decode step (ShadowKV §3.2): softmax over chunks, max over each GQA group.

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, C chunks, D head dim, N tiles of chunks.

`landmark_scores_reference` is the definition (the PyTorch twin, `LandmarkTopK`'s own arithmetic).
`landmark_scores` runs `kernels/landmark_scores.cu` on CUDA for one query token: it reads the landmarks once and
keeps the logits in fp32, where the twin's GEMM rounds them to the KV dtype.
"""

from __future__ import annotations

import ctypes

import torch

from ..kernel_loader import kernels_available, load_kernels

__all__ = ["landmark_scores", "landmark_scores_reference"]

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_THREADS, _PER_THREAD = 256, 8
_MAX_GROUP = 8


def landmark_scores_reference(
    query: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, scaling: float
) -> torch.Tensor:
    """`[B, Hkv, C]` fp32: `max_g sum_t softmax_c(scaling * q_{g,t} . L_c)` over selectable chunks (0 elsewhere).

    Args:
        query (`torch.Tensor`): `[B, Hq, T, D]`.
        landmarks (`torch.Tensor`): `[B, Hkv, C, D]` (rows sharing one document may be stride-0 views).
        selectable (`torch.Tensor`): `[B, Hkv, C]` bool.
    """
    if landmarks.shape[0] > 1 and landmarks.stride(0) == 0:
        landmarks = landmarks[:1]  # score against the one copy, which einsum broadcasts
    b, hq, t, d = query.shape
    q = (query * scaling).view(b, landmarks.shape[1], hq // landmarks.shape[1], t, d)  # [B, Hkv, G, T, D]
    # In the KV dtype (fp32 accumulation inside the GEMM): converting the landmarks to fp32 first would triple
    # the bytes of the largest tensor a step reads.
    logits = torch.einsum("bhgtd,bhcd->bhgtc", q.to(landmarks.dtype), landmarks)
    logits = logits.masked_fill(~selectable[:, :, None, None, :], float("-inf"))
    # A row with nothing selectable has an all -inf softmax (NaN); it selects nothing anyway.
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).nan_to_num(0.0)
    return probs.sum(dim=3).amax(dim=2)


def landmark_scores(
    query: torch.Tensor, landmarks: torch.Tensor, selectable: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Same as `landmark_scores_reference`; the kernel for one query token on CUDA, the twin otherwise."""
    b, hq, t, d = query.shape
    hkv, chunks = landmarks.shape[1], landmarks.shape[2]
    group = hq // hkv
    if not (
        kernels_available(query.device)
        and t == 1
        and landmarks.dtype in _KERNEL_DTYPES
        and query.dtype == landmarks.dtype
        and 1 <= group <= _MAX_GROUP
        and d % _PER_THREAD == 0
        and 32 % (d // _PER_THREAD) == 0
        and landmarks.stride()[1:] == (chunks * d, d, 1)
        and selectable.stride()[1:] == (chunks, 1)
        and chunks > 0
    ):
        return landmark_scores_reference(query, landmarks, selectable, scaling)
    query = query.reshape(b, hq, d).contiguous()
    tile = 512
    tiles = -(-chunks // tile)
    logits = torch.empty((b, hkv, group, chunks), dtype=torch.float32, device=query.device)
    part_max = torch.empty((b, hkv, group, tiles), dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    scores = torch.empty((b, hkv, chunks), dtype=torch.float32, device=query.device)
    kernels = load_kernels("landmark_scores", query.device)
    i32 = ctypes.c_int
    kernels.launch(
        f"landmark_logits_{_KERNEL_DTYPES[landmarks.dtype]}_g{group}",
        grid=(tiles, hkv, b),
        block=(_THREADS, 1, 1),
        args=[
            logits,
            part_max,
            part_sum,
            query,
            landmarks,
            (landmarks.stride(0), ctypes.c_longlong),
            selectable,
            (selectable.stride(0), ctypes.c_longlong),
            (float(scaling), ctypes.c_float),
            (hkv, i32),
            (chunks, i32),
            (d, i32),
            (tile, i32),
        ],
    )
    kernels.launch(
        "landmark_softmax_max",
        grid=(-(-chunks // 1024), hkv, b),
        block=(_THREADS, 1, 1),
        args=[scores, logits, part_max, part_sum, (hkv, i32), (group, i32), (chunks, i32), (tiles, i32)],
    )
    return scores
