"""Joint low-rank factorisation of the pre-RoPE keys of all KV heads (ShadowKV §3.1).

Legend: T tokens, Hkv KV heads, D head dim, R rank.

Pre-RoPE keys are low rank while post-RoPE keys are not, so ShadowKV stores `K_pre ≈ A·B` with
`A = U·Σ` (`[T, R]`) and `B = Vᵀ` (`[R, Hkv*D]`), one factorisation across heads. The top right singular
vectors are the top eigenvectors of the Gram matrix `KᵀK` (`[Hkv*D, Hkv*D]`), which costs O(T·(Hkv·D)²)
instead of a full SVD of the tall `[T, Hkv*D]` matrix.
"""

from __future__ import annotations

import torch

__all__ = ["factorize_keys", "reconstruct_keys"]


def factorize_keys(keys: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-`rank` factors of `keys` (`[T, Hkv*D]`), computed in fp32.

    Returns `(A, B)` with `A` `[T, rank]` and `B` `[rank, Hkv*D]` in fp32, such that `A @ B` is the best
    rank-`rank` approximation of `keys` in the Frobenius norm (equal to `keys` when `rank >= min(T, Hkv*D)`).
    """
    if keys.dim() != 2:
        raise ValueError(f"keys must be [T, Hkv*D], got shape {tuple(keys.shape)}")
    t, key_dim = keys.shape
    if not 1 <= rank <= key_dim:
        raise ValueError(f"rank must be in [1, {key_dim}], got {rank}")
    k32 = keys.float()
    gram = k32.T @ k32
    # eigh sorts eigenvalues ascending: the last `rank` eigenvectors span the top singular directions.
    _, eigvecs = _eigh(gram)
    v = eigvecs[:, -rank:].flip(-1)  # [Hkv*D, R], strongest direction first
    return k32 @ v, v.T.contiguous()


def reconstruct_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`A @ B` (`[T, R] @ [R, Hkv*D]`), the pre-RoPE keys the factors stand for."""
    return a @ b


def _eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if gram.device.type != "cpu":
        return torch.linalg.eigh(gram)
    # On the CPU, MKL's threaded eigh of these small matrices stalled for ~1.5 s a call inside a forward pass on
    # a 2-core machine (39 s of a 59 s 2K-token SmolLM2 prefill); single-threaded it takes a few milliseconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.linalg.eigh(gram)
    finally:
        torch.set_num_threads(threads)
