"""Chunk scores from landmark logits: a softmax over each query head's selectable chunks, summed over the query
tokens, then the max over each GQA group (ShadowKV §3.2, `policies/landmark_topk.py`).

Legend: B batch, Hkv KV heads, G query heads per KV head, T query tokens, C chunks.

`softmax_group_max` is the definition (PyTorch). `landmark_scores` is what selection ranks by: the same, with -inf
where a chunk is not selectable. On CUDA a one-token step of enough rows runs `kernels/landmark_scores.cu`, which
reads the logits in the layout the landmark GEMM wrote them (any strides) twice, instead of the twin's passes (a
mask, which also copies the strided view, a conversion to fp32, a softmax, a max and a second mask; with the
transposed copy the GEMM's output took before, ~8 ms of a 52 ms step at batch 32 and 128K on an H200 machine, 3.1 ms
with the kernel; `benchmarks/profile_decode.py`); otherwise the twin runs.

The two differ only on logits that are not finite (fp16 overflow): NaN spreads over a head's scores in both, but a
head whose selectable logits are all -inf scores -inf in the kernel and 0 in the twin.
"""

from __future__ import annotations

import ctypes

import torch

from .library import define_op
from .loader import kernels_available, load_kernels, multiprocessors

__all__ = ["landmark_scores", "landmark_scores_op", "landmark_scores_reference", "softmax_group_max"]

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_MAX_GROUP = 16  # LS_MAX_G in the kernel
_THREADS = 512  # LS_THREADS in the kernel, which strides and merges warps by it
# The kernel runs one block per (row, KV head). With fewer of them than this share of the SMs it leaves most of the
# GPU idle, and PyTorch's kernels, which split each row over many blocks, are faster: on an H200 machine at 128K
# the kernel took 2.05 ms of a batch-1 step (8 blocks; the twin's kernels ~1 ms) and 3.1 ms of a batch-32 step (256
# blocks; the twin's ~8 ms), and the steps at batch 8 were within 1% (`decode_profile_128k_batch*`, `throughput.py`).
MIN_BLOCKS_PER_SM = 0.5


def softmax_group_max(logits: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    """Scores `[B, Hkv, C]` float32 from logits `[B, Hkv, G, T, C]` (any dtype and strides): the softmax over the
    chunks where `selectable` (`[B, Hkv, C]` bool; 0 elsewhere), summed over the T tokens, max over the G heads.
    A head with nothing selectable gets a uniform softmax (its scores mean nothing; `landmark_scores` masks them)."""
    # The dtype's lowest value gives exp() = 0 as -inf does, and no NaN where a head has nothing selectable, so no
    # pass over the probabilities has to clear NaNs.
    logits = torch.where(selectable[:, :, None, None, :], logits, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [B, Hkv, G, T, C]
    # A one-token step sums over one query token: a view, not a pass over the probabilities.
    summed = probs[:, :, :, 0] if probs.shape[3] == 1 else probs.sum(dim=3)
    return summed.amax(dim=2)


def landmark_scores_reference(logits: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    """The PyTorch twin of `landmark_scores`: `softmax_group_max` with -inf where not selectable."""
    return torch.where(selectable, softmax_group_max(logits, selectable), float("-inf"))


def landmark_scores(logits: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    """Selection scores `[B, Hkv, C]` float32, -inf where not selectable.

    Args:
        logits (`torch.Tensor`): `[B, Hkv, G, T, C]` landmark logits, any strides (a view of the GEMM's output).
        selectable (`torch.Tensor`): `[B, Hkv, C]` bool (rows may be stride-0 views of one document's).
    """
    if not _kernel_fits(logits, selectable):
        return landmark_scores_reference(logits, selectable)
    return landmark_scores_op(logits, selectable)


def _one_token(logits: torch.Tensor) -> None:
    torch._check(logits.shape[3] == 1, lambda: "the landmark_scores operator takes one query token")


def _scores_twin(logits: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    _one_token(logits)
    return landmark_scores_reference(logits, selectable)


def _scores_like(logits: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    _one_token(logits)
    batch, heads, _, _, chunks = logits.shape
    return torch.empty((batch, heads, chunks), dtype=torch.float32, device=logits.device)


@define_op("landmark_scores(Tensor logits, Tensor selectable) -> Tensor", cpu=_scores_twin, fake=_scores_like)
def landmark_scores_op(logits: torch.Tensor, selectable: torch.Tensor) -> torch.Tensor:
    """`torch.ops.shadowkv.landmark_scores`: the kernel on what `landmark_scores` checked (one query token)."""
    _one_token(logits)
    batch, heads, group, _, chunks = logits.shape
    selectable = selectable.expand(batch, heads, chunks)  # a broadcast mask's rows read with stride 0
    scores = torch.empty((batch, heads, chunks), dtype=torch.float32, device=logits.device)
    lb, lh, lg, _, lc = logits.stride()
    sb, sh, _ = selectable.stride()
    i64 = ctypes.c_longlong
    load_kernels("landmark_scores", logits.device).launch(
        f"landmark_scores_{_KERNEL_DTYPES[logits.dtype]}",
        grid=(heads, batch, 1),
        block=(_THREADS, 1, 1),
        args=[scores, logits, selectable, (lb, i64), (lh, i64), (lg, i64), (lc, i64), (sb, i64), (sh, i64),
              (heads, ctypes.c_int), (group, ctypes.c_int), (chunks, ctypes.c_int)],
    )  # fmt: skip
    return scores


def _kernel_fits(logits: torch.Tensor, selectable: torch.Tensor) -> bool:
    """A one-token step of a known dtype on a CUDA device with kernels, at most 16 query heads per KV head, the
    chunks of `selectable` contiguous, grid dimensions the device takes, and blocks for `MIN_BLOCKS_PER_SM`."""
    batch, heads, group, steps, chunks = logits.shape
    if not kernels_available(logits.device):
        return False
    return (
        batch * heads >= MIN_BLOCKS_PER_SM * multiprocessors(logits.device)
        and steps == 1
        and 0 < group <= _MAX_GROUP
        and logits.dtype in _KERNEL_DTYPES
        and selectable.dtype == torch.bool
        and selectable.stride(-1) == 1
        and chunks > 0
        and 0 < batch <= 65535
        and heads <= 2**31 - 1
    )
