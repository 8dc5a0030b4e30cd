"""Top-k of a decode step's scores: the `k` best units of each (row, head), best first (`policies/base.py`).

Legend: R rows (every leading index of the scores), N scores per row, k selected.

`select_topk_reference` is the definition: a stable descending sort, first `k` (equal scores by ascending index, NaN
first, -0.0 equal to +0.0). `kernels/select_topk.cu` computes it in one kernel per layer (a radix select in each
row's block, then each candidate's rank); torch.topk took two or more kernels and a sort (see the kernel).
"""

from __future__ import annotations

import ctypes

import torch

from .library import define_op
from .loader import kernels_available, load_kernels

__all__ = ["MAX_K", "REGISTER_ROW", "kernel_fits", "select_topk", "select_topk_op", "select_topk_reference"]

MAX_K = 2048  # TOPK_MAX_K in the kernel
_THREADS = 1024  # TOPK_THREADS in the kernel
# TOPK_REG_ITEMS * TOPK_THREADS: rows up to this long are read once, into registers. Longer rows (YAKV's tokens) take
# the kernel that reads the row again at each pass, one block per row; it is tested but not yet measured against
# torch.topk's multi-block kernels, so `policies/base.py` sends only rows up to this long here.
REGISTER_ROW = 16 * _THREADS
_MAX_ROWS = 2**31 - 1  # the grid's x dimension


def select_topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The PyTorch twin: indices `[..., k]` int64 of the `k` largest of `scores` `[..., N]`, best first, equal scores
    by ascending index."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`select_topk_reference`'s indices: the kernel for fp32 scores on a CUDA device with kernels and
    `1 <= k <= min(N, 2048)`, otherwise the twin.

    Args:
        scores (`torch.Tensor`): `[..., N]` float scores (any strides; the kernel reads rows of unit stride).
        k (`int`): how many to select, `0 <= k <= N`.
    """
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"select_topk: k={k} must be between 0 and the {n} scores per row.")
    if not kernel_fits(scores, k):
        return select_topk_reference(scores, k)
    return select_topk_op(scores, k)


def kernel_fits(scores: torch.Tensor, k: int) -> bool:
    """fp32 scores on a CUDA device with kernels and sm_70+ (the kernel's `__match_any_sync`), `1 <= k <= 2048`, rows
    of fewer than 2^31 - 1024 scores (the kernel counts them in int), at most the grid's rows."""
    rows = scores.numel() // max(scores.shape[-1], 1)
    return (
        kernels_available(scores.device)
        and scores.dtype == torch.float32
        and 0 < k <= min(scores.shape[-1], MAX_K)
        and 0 < rows <= _MAX_ROWS
        and scores.shape[-1] < 2**31 - _THREADS
        and torch.cuda.get_device_capability(scores.device) >= (7, 0)
    )


def _check_k(scores: torch.Tensor, k: int) -> None:
    torch._check(
        0 < k <= min(scores.shape[-1], MAX_K),
        lambda: f"the select_topk operator takes 1 <= k <= min(N, {MAX_K}), got k={k} of N={scores.shape[-1]}",
    )


def _twin(scores: torch.Tensor, k: int) -> torch.Tensor:
    _check_k(scores, k)
    return select_topk_reference(scores, k).contiguous()


def _indices_like(scores: torch.Tensor, k: int) -> torch.Tensor:
    _check_k(scores, k)
    return torch.empty((*scores.shape[:-1], k), dtype=torch.int64, device=scores.device)


@define_op("select_topk(Tensor scores, int k) -> Tensor", cpu=_twin, fake=_indices_like)
def select_topk_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`torch.ops.shadowkv.select_topk`: the kernel on fp32 `scores` `[..., N]`, `1 <= k <= min(N, 2048)`."""
    n = scores.shape[-1]
    rows = scores.reshape(-1, n)  # a view for the usual contiguous scores; a copy otherwise
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = _indices_like(scores, k)  # checks k
    if rows.shape[0]:
        load_kernels("select_topk", scores.device).launch(
            "select_topk_regs" if n <= REGISTER_ROW else "select_topk",
            grid=(rows.shape[0], 1, 1),
            block=(_THREADS, 1, 1),
            args=[rows, (rows.stride(0), ctypes.c_longlong), out, (n, ctypes.c_int), (k, ctypes.c_int)],
        )
    return out
