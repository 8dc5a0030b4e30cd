"""Top-k of a decode step's scores: the `k` best units of each (row, head), best first (`policies/base.py`).

Legend: R rows (every leading index of the scores), N scores per row, k selected.

`select_topk_reference` is the definition: a stable descending sort, first `k` (equal scores by ascending index, NaN
first, -0.0 equal to +0.0). Rows of up to 16K scores (ShadowKV's chunks) take `kernels/select_topk.cu`, one kernel
per layer (a radix select in each row's block, then each candidate's rank); longer rows (YAKV's tokens) or `k` above
2048 take `kernels/select_topk_split.cu`: a histogram of each row's top bits by many blocks per row, a filter of the
keys above and in the k-th key's bin, and a block per row that selects within the bin and sorts the `k`. torch.topk
took two or more kernels and a sort for either (see the kernels).
"""

from __future__ import annotations

import ctypes

import torch

from .library import define_op
from .loader import kernels_available, load_kernels, max_shared_bytes, multiprocessors

__all__ = ["BIN_KEYS", "MAX_K", "REGISTER_ROW", "SPLIT_MAX_K", "kernel_fits", "select_topk", "select_topk_op",
           "select_topk_reference"]  # fmt: skip

MAX_K = 2048  # TOPK_MAX_K in select_topk.cu: larger k take the split kernels
_THREADS = 1024  # TOPK_THREADS in select_topk.cu
# TOPK_REG_ITEMS * TOPK_THREADS: rows up to this long are read once, into one block's registers.
REGISTER_ROW = 16 * _THREADS
# The split kernels sort each row's k keys in shared memory (8 bytes each, k rounded up to a power of two).
SPLIT_MAX_K = 16384
# SPLIT_THREADS, SPLIT_THREADS * SPLIT_ITEMS (topk_histogram's largest part) and SPLIT_THREADS * FILTER_ITEMS
# (topk_filter's part) in select_topk_split.cu.
_SPLIT_THREADS, _SPLIT_PART, _FILTER_PART = 512, 512 * 32, 512 * 8
_SPLIT_WORDS = 8 + 4096  # WORK_WORDS: a row's state and histogram of top digits, int32 words
_FINISH_THREADS = 1024
# The bin buffer's keys per row (C in select_topk_split.cu): a bin of more keys (heavy ties) is read from the row.
BIN_KEYS = 8192
_FINISH_STATIC = 2048 * 4 + 32 * 4 + 16  # topk_finish's static shared memory: its histogram, warp sums, results
_BLOCKS_PER_SM = 4  # the split kernels' grid: enough parts per row for about this many blocks per multiprocessor
_MAX_ROWS = 2**31 - 1  # the grid's x dimension (select_topk.cu)
_MAX_SPLIT_ROWS = 65535  # the grid's y dimension (select_topk_split.cu)


def select_topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The PyTorch twin: indices `[..., k]` int64 of the `k` largest of `scores` `[..., N]`, best first, equal scores
    by ascending index."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`select_topk_reference`'s indices: the kernels for fp32 scores on a CUDA device with kernels and
    `1 <= k <= min(N, 16384)`, otherwise the twin.

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


def _split(n: int, k: int) -> bool:
    """Whether rows of `n` scores and this `k` take the split kernels."""
    return n > REGISTER_ROW or k > MAX_K


def kernel_fits(scores: torch.Tensor, k: int) -> bool:
    """fp32 scores on a CUDA device with kernels and sm_70+ (the kernels' warp votes), `1 <= k <= min(N, 16384)`,
    rows of fewer than 2^31 - 1024 scores (the kernels count them in int), at most the grid's rows, and for the split
    kernels the shared memory of their sort."""
    n = scores.shape[-1]
    rows = scores.numel() // max(n, 1)
    if not (
        kernels_available(scores.device)
        and scores.dtype == torch.float32
        and 0 < k <= min(n, SPLIT_MAX_K)
        and 0 < rows
        and n < 2**31 - _THREADS
        and torch.cuda.get_device_capability(scores.device) >= (7, 0)
    ):
        return False
    if not _split(n, k):
        return rows <= _MAX_ROWS
    return rows <= _MAX_SPLIT_ROWS and _finish_shared(k) + _FINISH_STATIC <= max_shared_bytes(scores.device)


def _sort_width(k: int) -> int:
    """topk_finish's sort: k rounded up to a power of two, at least a warp's 64 keys."""
    return max(64, 1 << max(k - 1, 0).bit_length())


def _finish_shared(k: int) -> int:
    """topk_finish's dynamic shared memory: the sort's keys and the bin buffer's."""
    return (_sort_width(k) + BIN_KEYS) * 8


def _check_k(scores: torch.Tensor, k: int) -> None:
    n = scores.shape[-1]
    torch._check(
        0 < k <= min(n, SPLIT_MAX_K),
        lambda: f"the select_topk operator takes 1 <= k <= min(N, {SPLIT_MAX_K}), got k={k} of N={n}",
    )


def _twin(scores: torch.Tensor, k: int) -> torch.Tensor:
    _check_k(scores, k)
    return select_topk_reference(scores, k).contiguous()


def _indices_like(scores: torch.Tensor, k: int) -> torch.Tensor:
    _check_k(scores, k)
    return torch.empty((*scores.shape[:-1], k), dtype=torch.int64, device=scores.device)


@define_op("select_topk(Tensor scores, int k) -> Tensor", cpu=_twin, fake=_indices_like)
def select_topk_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`torch.ops.shadowkv.select_topk`: the kernels on fp32 `scores` `[..., N]`, `1 <= k <= min(N, 16384)`."""
    n = scores.shape[-1]
    rows = scores.reshape(-1, n)  # a view for the usual contiguous scores; a copy otherwise
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = _indices_like(scores, k)  # checks k
    if not rows.shape[0]:
        return out
    if not _split(n, k):
        load_kernels("select_topk", scores.device).launch(
            "select_topk_regs",
            grid=(rows.shape[0], 1, 1),
            block=(_THREADS, 1, 1),
            args=[rows, (rows.stride(0), ctypes.c_longlong), out, (n, ctypes.c_int), (k, ctypes.c_int)],
        )
        return out
    _select_split(rows, k, out)
    return out


def _select_split(rows: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """The split kernels on `rows` `[R, N]` (unit stride within a row) into `out` (`R * k` int64)."""
    r, n = rows.shape
    device = rows.device
    kernels = load_kernels("select_topk_split", device)
    # Enough parts per row to give the grid about _BLOCKS_PER_SM blocks per multiprocessor, each a whole number of
    # the block's threads and at most what its registers hold.
    parts = -(-_BLOCKS_PER_SM * multiprocessors(device) // r)
    part = min(_SPLIT_PART, max(_SPLIT_THREADS, -(-n // parts // _SPLIT_THREADS) * _SPLIT_THREADS))
    grid = (-(-n // part), r, 1)
    work = torch.zeros(r, _SPLIT_WORDS, dtype=torch.int32, device=device)
    candidates = torch.empty(r, k, dtype=torch.int64, device=device)
    bin_keys = torch.empty(r, BIN_KEYS, dtype=torch.int64, device=device)
    head = [rows, (rows.stride(0), ctypes.c_longlong), work]
    n_k = [(n, ctypes.c_int), (k, ctypes.c_int)]
    block = (_SPLIT_THREADS, 1, 1)
    kernels.launch("topk_histogram", grid=grid, block=block, args=[*head, *n_k, (part, ctypes.c_int)])
    args = [*head, candidates, bin_keys, *n_k, (BIN_KEYS, ctypes.c_int)]
    kernels.launch("topk_filter", grid=(-(-n // _FILTER_PART), r, 1), block=block, args=args)
    shared = _finish_shared(k)
    kernels.set_max_dynamic_shared("topk_finish", shared)
    kernels.launch(
        "topk_finish",
        grid=(r, 1, 1),
        block=(_FINISH_THREADS, 1, 1),
        args=[*head, candidates, bin_keys, out, *n_k, (BIN_KEYS, ctypes.c_int), (_sort_width(k), ctypes.c_int)],
        shared_bytes=shared,
    )
