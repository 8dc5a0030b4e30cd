"""Joint low-rank factorisation of the pre-RoPE keys of all KV heads (ShadowKV §3.1).

Legend: T tokens, Hkv KV heads, D head dim, R rank.

Pre-RoPE keys are low rank while post-RoPE keys are not, so ShadowKV stores `K_pre ≈ A·B` with
`A = U·Σ` (`[T, R]`) and `B = Vᵀ` (`[R, Hkv*D]`), one factorisation across heads. The top right singular
vectors are the top eigenvectors of the Gram matrix `KᵀK` (`[Hkv*D, Hkv*D]`), which costs O(T·(Hkv·D)²)
instead of a full SVD of the tall `[T, Hkv*D]` matrix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .fp32_products import matmul_fp32, project_fp32

__all__ = ["RankProbe", "factorize_keys", "key_spectrum", "rank_for_logit_error", "reconstruct_keys"]

# Tokens the logit-error rule samples per row (evenly spaced): the error estimate then costs the same at any length.
_PROBE_TOKENS = 4096
_RANK_STEP = 8

_threads_lock = threading.Lock()
_single_threaded_users = 0
_saved_threads = 0


def key_spectrum(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues `[Hkv*D]` (descending, fp32, >= 0) and eigenvectors `[Hkv*D, Hkv*D]` (columns, same order) of the
    Gram matrix `KᵀK` of `keys` (`[T, Hkv*D]`): the squared singular values and right singular vectors of `keys`."""
    if keys.dim() != 2:
        raise ValueError(f"keys must be [T, Hkv*D], got shape {tuple(keys.shape)}")
    eigvals, eigvecs = _eigh(_gram(keys))
    # eigh sorts ascending; round-off can leave tiny negative eigenvalues of a positive semi-definite matrix.
    return eigvals.flip(-1).clamp(min=0), eigvecs.flip(-1)


@dataclass(frozen=True)
class RankProbe:
    """What the logit-error rule measures a rank against: the prompt's last queries and the exact keys.

    Args:
        queries (`torch.Tensor`): `[Hq, W, D]` the last prompt queries (post-RoPE).
        keys (`torch.Tensor`): `[Hkv, T, D]` the exact post-RoPE keys of the factorised tokens.
        positions (`torch.Tensor`): `[T]` int64 their RoPE positions.
        rope (`Callable`): the model's RoPE, `(keys [M, T, D], positions [M, T]) -> [M, T, D]`.
        scaling (`float`, *optional*): the attention's logit scale (`D**-0.5` unless the model sets another).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    positions: torch.Tensor
    rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scaling: float | None = None


def rank_for_logit_error(
    keys: torch.Tensor,
    eigvecs: torch.Tensor,
    probe: RankProbe,
    max_error: float,
    min_rank: int,
    max_rank: int,
    max_shift: float | None = None,
) -> int:
    """The smallest rank (a multiple of 8, in `[min_rank, max_rank]`) whose rebuilt keys keep the attention logits of
    the probe's queries close to the exact ones, over up to 4096 evenly spaced tokens, by two measures:

    - relative: `‖Q(K_r − K)ᵀ‖ / ‖QKᵀ − mean‖ <= max_error` (Frobenius, logits centred over keys, since a constant
      shift does not change attention);
    - absolute, where attention looks (with `max_shift`): the logit errors (scaled as attention scales them,
      centred under the exact attention `p`) averaged under `p`, `mean_q Σ_j p_j |Δl_j − Σ_i p_i Δl_i| <= max_shift`
      (nats; to first order the mean relative change of the attended keys' weights).

    The key energy alone misjudges models whose logits hang on weak directions (Gemma 3 270M needs twice the rank
    its energy suggests); the logits are what attention reads. The relative measure alone misjudges prompts whose
    logits spread widely over repetitive text (a needle in a haystack): the rare keys attention picks carry a few
    nats of error while the whole stays within a few percent (docs/design.md §2).

    Args:
        keys (`torch.Tensor`): `[T, Hkv*D]` the pre-RoPE keys being factorised.
        eigvecs (`torch.Tensor`): `[Hkv*D, Hkv*D]` their right singular vectors, strongest first (`key_spectrum`).
    """
    tokens, key_dim = keys.shape
    heads, _, dim = probe.keys.shape
    index = torch.linspace(0, tokens - 1, min(tokens, _PROBE_TOKENS), device=keys.device).round().long().unique()
    x = keys[index].float()
    exact = probe.keys[:, index].float()  # [Hkv, n, D]
    positions = probe.positions[index].expand(heads, -1)
    queries = probe.queries.float().reshape(heads, -1, dim)  # [Hkv, G*W, D]: a KV head's query heads together
    logits = queries @ exact.transpose(1, 2)
    scale = float((logits - logits.mean(dim=-1, keepdim=True)).norm())
    scaling = probe.scaling if probe.scaling is not None else dim**-0.5
    attention = (logits * scaling).softmax(dim=-1) if max_shift is not None else None  # [Hkv, G*W, n]

    def close_enough(rank: int) -> bool:
        v = eigvecs[:, :rank]
        rebuilt = ((x @ v) @ v.T).view(-1, heads, dim).transpose(0, 1)  # [Hkv, n, D] pre-RoPE
        rebuilt = probe.rope(rebuilt.contiguous(), positions).float()
        delta = queries @ (rebuilt - exact).transpose(1, 2)
        if float(delta.norm()) > max_error * max(scale, 1e-30):
            return False
        if max_shift is None:
            return True
        delta = delta * scaling
        delta = delta - (attention * delta).sum(dim=-1, keepdim=True)
        return float((attention * delta.abs()).sum(dim=-1).mean()) <= max_shift

    # Both errors shrink as the rank grows (the residual is a projection of the keys): bisect over multiples of 8.
    candidates = sorted({min_rank, max_rank, *range(-(-min_rank // _RANK_STEP) * _RANK_STEP, max_rank, _RANK_STEP)})
    low, high = 0, len(candidates) - 1
    if not close_enough(candidates[high]):
        return candidates[high]
    while low < high:
        middle = (low + high) // 2
        if close_enough(candidates[middle]):
            high = middle
        else:
            low = middle + 1
    return candidates[low]


def factorize_keys(
    keys: torch.Tensor,
    rank: int,
    max_logit_error: float | None = None,
    min_rank: int = 1,
    probe: RankProbe | None = None,
    max_logit_shift: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors of `keys` (`[T, Hkv*D]`), computed in fp32: rank `rank`, or, when `max_logit_error` is given, the
    smallest rank in `[min_rank, rank]` that keeps the probe's attention logits within that relative error and,
    with `max_logit_shift`, within that attention-weighted error in nats (`rank_for_logit_error`); without a probe,
    `rank`.

    Returns `(A, B)` with `A` `[T, R]` and `B` `[R, Hkv*D]` in fp32, such that `A @ B` is the best rank-`R`
    approximation of `keys` in the Frobenius norm (equal to `keys` when `R >= min(T, Hkv*D)`).
    """
    key_dim = keys.shape[-1]
    if not 1 <= rank <= key_dim:
        raise ValueError(f"rank must be in [1, {key_dim}], got {rank}")
    _, eigvecs = key_spectrum(keys)
    if max_logit_error is not None and probe is not None:
        low = min(max(min_rank, 1), rank)
        rank = rank_for_logit_error(keys, eigvecs, probe, max_logit_error, low, rank, max_logit_shift)
    v = eigvecs[:, :rank]  # [Hkv*D, R], strongest direction first
    return project_fp32(keys, v), v.T.contiguous()


def reconstruct_keys(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`A @ B` (`[T, R] @ [R, Hkv*D]`), the pre-RoPE keys the factors stand for."""
    return a @ b


def _gram(keys: torch.Tensor) -> torch.Tensor:
    """`KᵀK` in fp32 of `keys` `[T, Hkv*D]`: 16-bit keys on CUDA multiply on tensor cores (`matmul_fp32`); the fp32
    GEMM of the upcast keys took 218 ms of a 128K prefill on the Llama-3.1-8B shape (an H100 machine,
    `prefill_profile_128k`), ~20x the bf16 GEMM's time."""
    return matmul_fp32(keys.T, keys)


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
