"""Chunk scores from landmark logits: a softmax over each query head's selectable chunks, summed over the query
tokens, then the max over each GQA group (ShadowKV §3.2, `policies/landmark_topk.py`).

Legend: B batch, Hkv KV heads, G query heads per KV head, T query tokens, C chunks.

`softmax_group_max` is the definition (PyTorch). `landmark_scores` is what selection ranks by: the same, with -inf
where a chunk is not selectable. On CUDA a one-token step runs `kernels/landmark_scores.cu`, which reads the logits
in the layout the landmark GEMM wrote them (any strides) twice, instead of the twin's passes (a mask, which also
copies the strided view, a conversion to fp32, a softmax, a max and a second mask); otherwise the twin runs. The
kernel splits each (row, KV head)'s chunks over `_splits` blocks, one kernel writing each split's softmax states and
a second the scores, so a batch-1 step fills the GPU too.

The two differ only on logits that are not finite (fp16 overflow), in one case: a NaN logit spreads over its KV
head's scores in both, and a query head whose selectable logits are all -inf weighs 0 in both, except where every
chunk is selectable, where the twin's softmax gives NaN.
"""

from __future__ import annotations

import ctypes

import torch

from .library import define_op
from .loader import kernels_available, load_kernels, multiprocessors

__all__ = ["landmark_scores", "landmark_scores_op", "landmark_scores_reference", "softmax_group_max"]

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_MAX_GROUP = 16  # LS_MAX_G in the kernel
_THREADS = 256  # LS_THREADS in the kernel, which strides and merges warps by it
_UNROLL = 2  # the fewest chunks a kernel thread reads per round (ChunkLogits::UNROLL)
# Blocks of (split, row, KV head) per SM to aim for: enough resident 256-thread blocks that each SM keeps many loads
# in flight. A (row, head) is split only while the grid is short of this, down to one round of chunks per thread.
BLOCKS_PER_SM = 4


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
    """`torch.ops.shadowkv.landmark_scores`: the kernels on what `landmark_scores` checked (one query token)."""
    _one_token(logits)
    refusal = _refusal(logits, selectable)
    torch._check(refusal is None, lambda: f"the landmark_scores operator: {refusal}")
    batch, heads, group, _, chunks = logits.shape
    selectable = selectable.expand(batch, heads, chunks)  # a broadcast mask's rows read with stride 0
    scores = torch.empty((batch, heads, chunks), dtype=torch.float32, device=logits.device)
    splits = _splits(batch, heads, chunks, multiprocessors(logits.device))
    states = torch.empty((batch, heads, splits, group, 2), dtype=torch.float32, device=logits.device)
    lb, lh, lg, _, lc = logits.stride()
    sb, sh, _ = selectable.stride()
    i64, i32 = ctypes.c_longlong, ctypes.c_int
    kernels = load_kernels("landmark_scores", logits.device)
    suffix = _KERNEL_DTYPES[logits.dtype] + {0: "", 8: "_v8", 16: "_v16"}[_vector_bytes(logits)]
    strides = [(lb, i64), (lh, i64), (lg, i64), (lc, i64), (sb, i64), (sh, i64)]
    sizes = [(heads, i32), (group, i32), (chunks, i32), (splits, i32)]
    grid, block = (splits, heads, batch), (_THREADS, 1, 1)
    kernels.launch(f"landmark_states_{suffix}", grid=grid, block=block,
                   args=[states, logits, selectable, *strides, *sizes])  # fmt: skip
    kernels.launch(f"landmark_scores_{suffix}", grid=grid, block=block,
                   args=[scores, states, logits, selectable, *strides, *sizes])  # fmt: skip
    return scores


def _vector_bytes(logits: torch.Tensor) -> int:
    """16 or 8 where each chunk's G logits lie side by side in one aligned load of that many bytes (the GEMM's
    `[B, Hkv, C, G or padded]` output), else 0 (a load per logit)."""
    batch, heads, group, _, chunks = logits.shape
    size = logits.element_size()
    lb, lh, lg, _, lc = logits.stride()
    if (group > 1 and lg != 1) or lc <= 0 or min(lb, lh) < 0:
        return 0
    # The last chunk's load must stay inside the storage (a view may end at its last logit).
    last = logits.storage_offset() + (batch - 1) * lb + (heads - 1) * lh + (chunks - 1) * lc
    room = logits.untyped_storage().nbytes() - last * size
    strides = [lc] + [stride for stride, n in ((lb, batch), (lh, heads)) if n > 1]
    for vector in (16, 8):
        if group * size <= vector <= room and all(stride * size % vector == 0 for stride in strides):
            if logits.data_ptr() % vector == 0:
                return vector
    return 0


def _splits(batch: int, heads: int, chunks: int, sms: int) -> int:
    """Blocks per (row, KV head): up to `BLOCKS_PER_SM` blocks per SM over the grid, at least one round of chunks
    (`_UNROLL` per thread) per block."""
    most = max(1, -(-chunks // (_THREADS * _UNROLL)))
    return max(1, min(most, -(-BLOCKS_PER_SM * sms // (batch * heads))))


def _kernel_fits(logits: torch.Tensor, selectable: torch.Tensor) -> bool:
    """A one-token step on a CUDA device with kernels, of logits and a mask the kernels read (`_refusal`)."""
    if not kernels_available(logits.device):
        return False
    return logits.shape[3] == 1 and _refusal(logits, selectable) is None


def _refusal(logits: torch.Tensor, selectable: torch.Tensor) -> str | None:
    """Why the kernels cannot read these logits and mask, or None: a known dtype, at most 16 query heads per KV head,
    the chunks of `selectable` contiguous, and grid dimensions (and chunk indices with a round to spare) the device
    takes."""
    batch, heads, group, _, chunks = logits.shape
    if logits.dtype not in _KERNEL_DTYPES:
        return f"logits of dtype {logits.dtype} (it reads {', '.join(map(str, _KERNEL_DTYPES))})"
    if not 0 < group <= _MAX_GROUP:
        return f"{group} query heads per KV head (it takes 1 to {_MAX_GROUP})"
    if selectable.dtype != torch.bool or selectable.stride(-1) != 1:
        return "a mask that is not bool with contiguous chunks"
    if not (0 < chunks <= 2**31 - 2**16 and 0 < batch <= 65535 and 0 < heads <= 65535):
        return f"{batch} rows, {heads} KV heads and {chunks} chunks (at most 65535, 65535 and 2**31 - 2**16)"
    return None
