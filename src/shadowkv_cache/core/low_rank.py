"""Joint low-rank factorisation of the pre-RoPE keys of all KV heads (ShadowKV §3.1).

Legend: T tokens, Hkv KV heads, D head dim, R rank.

Pre-RoPE keys are low rank while post-RoPE keys are not, so ShadowKV stores `K_pre ≈ A·B` with
`A = U·Σ` (`[T, R]`) and `B = Vᵀ` (`[R, Hkv*D]`), one factorisation across heads. The top right singular
vectors are the top eigenvectors of the Gram matrix `KᵀK` (`[Hkv*D, Hkv*D]`), which costs O(T·(Hkv·D)²)
instead of a full SVD of the tall `[T, Hkv*D]` matrix.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["factorize_keys", "key_spectrum", "rank_for_energy", "reconstruct_keys"]

_threads_lock = threading.Lock()
_single_threaded_users = 0
_saved_threads = 0


def key_spectrum(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues `[Hkv*D]` (descending, fp32, >= 0) and eigenvectors `[Hkv*D, Hkv*D]` (columns, same order) of the
    Gram matrix `KᵀK` of `keys` (`[T, Hkv*D]`): the squared singular values and right singular vectors of `keys`."""
    if keys.dim() != 2:
        raise ValueError(f"keys must be [T, Hkv*D], got shape {tuple(keys.shape)}")
    k32 = keys.float()
    eigvals, eigvecs = _eigh(k32.T @ k32)
    # eigh sorts ascending; round-off can leave tiny negative eigenvalues of a positive semi-definite matrix.
    return eigvals.flip(-1).clamp(min=0), eigvecs.flip(-1)


def rank_for_energy(eigvals: torch.Tensor, energy: float, min_rank: int, max_rank: int) -> int:
    """The smallest rank whose factors keep `energy` of the total energy (`eigvals` descending), in
    `[min_rank, max_rank]`."""
    total = float(eigvals.sum())
    if total <= 0:
        return min_rank
    kept = eigvals.double().cumsum(0) / total
    needed = int((kept < energy).sum()) + 1  # the first rank whose cumulative share reaches `energy`
    return max(min_rank, min(needed, max_rank))


def factorize_keys(
    keys: torch.Tensor, rank: int, energy: float | None = None, min_rank: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors of `keys` (`[T, Hkv*D]`), computed in fp32: rank `rank`, or, when `energy` is given, the smallest rank
    in `[min_rank, rank]` that keeps `energy` of the keys' energy (`rank_for_energy`).

    Returns `(A, B)` with `A` `[T, R]` and `B` `[R, Hkv*D]` in fp32, such that `A @ B` is the best rank-`R`
    approximation of `keys` in the Frobenius norm (equal to `keys` when `R >= min(T, Hkv*D)`).
    """
    key_dim = keys.shape[-1]
    if not 1 <= rank <= key_dim:
        raise ValueError(f"rank must be in [1, {key_dim}], got {rank}")
    eigvals, eigvecs = key_spectrum(keys)
    if energy is not None:
        rank = rank_for_energy(eigvals, energy, min(max(min_rank, 1), rank), rank)
    v = eigvecs[:, :rank]  # [Hkv*D, R], strongest direction first
    return keys.float() @ v, v.T.contiguous()


def reconstruct_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`A @ B` (`[T, R] @ [R, Hkv*D]`), the pre-RoPE keys the factors stand for."""
    return a @ b


def _eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gram.device.type != "cpu":
        return torch.linalg.eigh(gram)
    # On the CPU, the threaded LAPACK eigh of these small matrices stalls inside a forward pass on a loaded 2-core
    # machine (1.5 s to 14 s a call measured for 192..1024 dims, against 2-150 ms on one thread). PyTorch's thread
    # count is process-wide, so concurrent factorisations share one single-threaded section: the first to enter
    # saves the count, the last to leave restores it.
    global _single_threaded_users, _saved_threads
    with _threads_lock:
        if _single_threaded_users == 0:
            _saved_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        _single_threaded_users += 1
    try:
        return torch.linalg.eigh(gram)
    finally:
        with _threads_lock:
            _single_threaded_users -= 1
            if _single_threaded_users == 0:
                torch.set_num_threads(_saved_threads)
