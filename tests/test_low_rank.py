"""Low-rank factorisation of the pre-RoPE keys (ShadowKV §3.1) and outlier chunks (§3.2), against references.

Legend: T tokens, K = Hkv*D key dim, R rank, Hkv KV heads, C chunks, c chunk size, D head dim.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import NUM_KV_HEADS

from shadowkv_cache.core.fp32_products import matmul_fp32, project_fp32
from shadowkv_cache.core.landmarks import chunk_landmarks, outlier_chunks
from shadowkv_cache.core.low_rank import factorize_keys, reconstruct_keys


def low_rank_plus_noise(tokens: int, dim: int, true_rank: int, noise: float, seed: int = 0) -> torch.Tensor:
    """`[T, K]`: a rank-`true_rank` matrix with decaying singular values plus Gaussian noise, like real keys."""
    gen = torch.Generator().manual_seed(seed)
    left = torch.randn(tokens, true_rank, generator=gen)
    scales = torch.logspace(1, 0, true_rank)  # 10 .. 1
    right = torch.randn(true_rank, dim, generator=gen) / dim**0.5
    return (left * scales) @ right + noise * torch.randn(tokens, dim, generator=gen)


def optimal_error(keys: torch.Tensor, rank: int) -> float:
    """Eckart–Young: the best rank-`rank` Frobenius error, from the singular values (in fp64)."""
    s = torch.linalg.svdvals(keys.double())
    return float(s[rank:].square().sum().sqrt())


@pytest.mark.parametrize("tokens, dim", [(311, 64), (512, 128), (77, 32)])
@pytest.mark.parametrize("rank", [1, 8, 20])
def test_rank_r_error_is_the_svd_optimum(tokens, dim, rank):
    keys = low_rank_plus_noise(tokens, dim, true_rank=24, noise=0.05)
    a, b = factorize_keys(keys, rank)
    assert a.shape == (tokens, rank) and b.shape == (rank, dim)
    assert a.dtype == b.dtype == torch.float32
    error = float((keys.double() - reconstruct_keys(a, b).double()).norm())
    best = optimal_error(keys, rank)
    assert error == pytest.approx(best, rel=1e-4)
    # B's rows are orthonormal (B = Vᵀ) and A = K·Bᵀ = U·Σ, strongest direction first.
    torch.testing.assert_close(b @ b.T, torch.eye(rank), rtol=0, atol=1e-5)
    torch.testing.assert_close(a, keys @ b.T, rtol=1e-5, atol=1e-5)
    norms = a.norm(dim=0)
    assert (norms[:-1] >= norms[1:] * (1 - 1e-5)).all()
    reference = torch.linalg.svdvals(keys.double())[:rank].float()
    torch.testing.assert_close(norms, reference, rtol=1e-4, atol=1e-4)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Frobenius-norm relative error (fp32 round-off of a whole reconstruction, not per element)."""
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("tokens, dim", [(300, 32), (20, 32), (1, 16)])  # tall, wide (T < K), a single token
def test_full_rank_reconstructs_exactly(tokens, dim):
    keys = low_rank_plus_noise(tokens, dim, true_rank=min(tokens, dim), noise=0.5, seed=1)
    # rank K, and min(T, K): what the cache resolves to when fewer tokens than dimensions are compressed.
    for rank in (dim, min(tokens, dim)):
        a, b = factorize_keys(keys, rank)
        assert relative_error(reconstruct_keys(a, b), keys) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keys_are_factorized_in_fp32(dtype):
    keys = low_rank_plus_noise(200, 32, true_rank=8, noise=0.01).to(dtype)
    a, b = factorize_keys(keys, 8)
    assert a.dtype == b.dtype == torch.float32
    error = float((keys.double() - reconstruct_keys(a, b).double()).norm())
    assert error == pytest.approx(optimal_error(keys.float(), 8), rel=1e-3)


@pytest.mark.parametrize("shape, rank", [((10, 8), 0), ((10, 8), 9), ((4, 2, 8), 2)])
def test_bad_arguments_raise(shape, rank):
    with pytest.raises(ValueError):
        factorize_keys(torch.randn(shape), rank)


def test_landmarks_are_the_centroids_of_their_own_chunks():
    """A chunk's keys deviate from its landmark by zero in sum; a chunk of one repeated key has that key; the
    order of a chunk's keys does not matter, and neither do the other chunks' keys."""
    gen = torch.Generator().manual_seed(0)
    chunk_keys = torch.randn(NUM_KV_HEADS, 6, 8, 16, generator=gen)
    chunk_keys[:, 2] = chunk_keys[:, 2, :1]  # chunk 2: one key eight times
    landmarks = chunk_landmarks(chunk_keys)
    assert landmarks.shape == (NUM_KV_HEADS, 6, 16) and landmarks.dtype == chunk_keys.dtype
    deviation = (chunk_keys - landmarks[..., None, :]).sum(dim=-2)
    torch.testing.assert_close(deviation, torch.zeros_like(deviation), rtol=0, atol=1e-5)
    torch.testing.assert_close(landmarks[:, 2], chunk_keys[:, 2, 0])
    shuffled = chunk_keys[:, :, torch.randperm(8, generator=gen)]
    torch.testing.assert_close(chunk_landmarks(shuffled), landmarks)
    changed = chunk_keys.clone()
    changed[:, 4] = torch.randn(NUM_KV_HEADS, 8, 16, generator=gen)
    kept = [0, 1, 2, 3, 5]
    assert torch.equal(chunk_landmarks(changed)[:, kept], landmarks[:, kept])
    assert not torch.equal(chunk_landmarks(changed)[:, 4], landmarks[:, 4])


@pytest.mark.parametrize("planted", [[5], [0, 11], [3, 7, 12]])
def test_outlier_chunks_find_planted_outliers(planted):
    """Chunks whose keys point in opposite directions (poorly summarised by their mean) are the outliers."""
    gen = torch.Generator().manual_seed(0)
    heads, chunks, c, d = NUM_KV_HEADS, 16, 8, 16
    # Ordinary chunks: keys close to a shared per-chunk direction.
    direction = torch.randn(heads, chunks, 1, d, generator=gen)
    chunk_keys = direction + 0.1 * torch.randn(heads, chunks, c, d, generator=gen)
    for head in range(heads):
        for chunk in planted:
            shifted = [(chunk + head) % chunks]  # different outliers per head
            base = torch.randn(d, generator=gen)
            signs = torch.tensor([1.0, -1.0] * (c // 2))[:, None]
            chunk_keys[head, shifted] = signs * base + 0.05 * torch.randn(c, d, generator=gen)
    found = outlier_chunks(chunk_keys, chunk_landmarks(chunk_keys), len(planted))
    assert found.shape == (heads, len(planted))
    for head in range(heads):
        assert sorted(found[head].tolist()) == sorted((p + head) % chunks for p in planted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outlier_chunks_rank_by_cosine_similarity(dtype):
    """On random keys (no planted structure, so every choice is a close call), the chunks chosen are those whose
    least similar key has the lowest `F.cosine_similarity` to the chunk's landmark, computed on fp32 copies."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(NUM_KV_HEADS, 64, 8, 32, generator=gen).to(dtype)
    landmarks = chunk_landmarks(keys)
    sim = F.cosine_similarity(keys.float(), landmarks.float().unsqueeze(-2), dim=-1).amin(-1)
    want = sim.topk(6, dim=-1, largest=False).indices
    assert torch.equal(outlier_chunks(keys, landmarks, 6).sort(-1).values, want.sort(-1).values)


def test_landmarks_sum_16_bit_keys_in_fp32():
    keys = torch.randn(2, 5, 8, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    torch.testing.assert_close(chunk_landmarks(keys, torch.float32), keys.double().mean(-2).float())
    assert chunk_landmarks(keys).dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_products_of_16_bit_operands(device, dtype):
    """`matmul_fp32` and `project_fp32` agree with the fp64 products of the same numbers to fp32 round-off (on CUDA
    through tensor cores, with the basis split into two 16-bit parts), and return fp32."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3000, 256, generator=gen).to(dtype).to(device)
    basis = torch.linalg.qr(torch.randn(256, 40, generator=gen, dtype=torch.float64))[0].float().to(device)
    got, want = project_fp32(x, basis), x.double() @ basis.double()
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    groups = torch.randn(6, 40, 256, generator=gen).to(dtype).to(device)
    other = torch.randn(6, 256, 3, generator=gen).to(dtype).to(device)
    for a, b in ((x.T, x), (groups, other)):
        got, want = matmul_fp32(a, b), a.double() @ b.double()
        assert got.dtype == torch.float32
        assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_no_outliers_requested():
    chunk_keys = torch.randn(NUM_KV_HEADS, 4, 8, 16)
    assert outlier_chunks(chunk_keys, chunk_landmarks(chunk_keys), 0).shape == (NUM_KV_HEADS, 0)


# -- rank="auto": the smallest rank whose rebuilt keys keep the probe's attention logits close -------------------


def _identity_rope(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return keys


def _probe_errors(keys: torch.Tensor, queries: torch.Tensor, rank: int, heads: int) -> tuple[float, float]:
    """(relative centred-logit error, attention-weighted error in nats) of rank-`rank` keys, computed directly."""
    dim = keys.shape[1] // heads
    a, b = factorize_keys(keys, rank)
    exact = keys.view(-1, heads, dim).transpose(0, 1)
    rebuilt = reconstruct_keys(a, b).view(-1, heads, dim).transpose(0, 1)
    q = queries.reshape(heads, -1, dim)
    logits, approx = q @ exact.transpose(1, 2), q @ rebuilt.transpose(1, 2)
    relative = float((approx - logits).norm() / (logits - logits.mean(-1, keepdim=True)).norm())
    p = (logits * dim**-0.5).softmax(-1)
    delta = (approx - logits) * dim**-0.5
    delta = delta - (p * delta).sum(-1, keepdim=True)
    return relative, float((p * delta.abs()).sum(-1).mean())


def _haystack_with_needle(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, K]` keys of a repetitive text (rank 8, a wide logit spread) with one needle key along a direction the
    haystack lacks, and `[H, W, D]` queries that look for it (and along the haystack): the needle is 1 key in 2000,
    so the logits as a whole change little when a low rank drops it, but attention loses what it looks for."""
    gen = torch.Generator().manual_seed(seed)
    heads, dim, tokens = NUM_KV_HEADS, 32, 2000
    key_dim = heads * dim
    basis = torch.linalg.qr(torch.randn(key_dim, key_dim, generator=gen))[0]
    keys = (torch.randn(tokens, 8, generator=gen) * 4) @ basis[:, :8].T
    keys += 0.01 * torch.randn(tokens, key_dim, generator=gen)
    keys[1234] = basis[:, 40] * 8
    queries = (20 * basis[:, 40] + 10 * basis[:, 0]).view(heads, 1, dim).expand(heads, 8, dim)
    return keys, queries + 0.1 * torch.randn(heads, 8, dim, generator=gen)


def _auto_rank(keys, queries, max_error, max_shift, low=8, high=None):
    from shadowkv_cache.core.low_rank import RankProbe, key_spectrum, rank_for_logit_error

    heads, _, dim = queries.shape
    exact = keys.view(-1, heads, dim).transpose(0, 1)
    probe = RankProbe(queries, exact, torch.arange(keys.shape[0]), _identity_rope)
    _, eigvecs = key_spectrum(keys)
    return rank_for_logit_error(keys, eigvecs, probe, max_error, low, high or keys.shape[1] - 8, max_shift)


@pytest.mark.parametrize("max_error, max_shift", [(0.2, None), (0.05, None), (0.2, 0.5), (0.05, 0.1), (0.3, 0.05)])
@pytest.mark.parametrize("seed", [0, 1])
def test_auto_rank_is_the_smallest_multiple_of_8_within_both_bounds(max_error, max_shift, seed):
    """Against the errors computed directly: the chosen rank keeps both, the multiple of 8 below it does not."""
    keys = low_rank_plus_noise(600, NUM_KV_HEADS * 32, true_rank=40, noise=0.05, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    queries = torch.randn(NUM_KV_HEADS, 16, 32, generator=gen) * 2

    def within(rank):
        relative, shift = _probe_errors(keys, queries, rank, NUM_KV_HEADS)
        return relative <= max_error and (max_shift is None or shift <= max_shift)

    rank = _auto_rank(keys, queries, max_error, max_shift)
    assert rank % 8 == 0 and within(rank)
    if rank > 8:
        assert not within(rank - 8)


def test_a_needle_that_attention_looks_for_keeps_the_rank_it_needs():
    """The relative bound alone keeps the haystack's rank and drops the needle (its logits barely move as a whole);
    the attention-weighted bound keeps the needle's direction, so the rebuilt needle scores as the exact one."""
    keys, queries = _haystack_with_needle()
    relative_only = _auto_rank(keys, queries, max_error=0.075, max_shift=None)
    both = _auto_rank(keys, queries, max_error=0.075, max_shift=0.2)
    assert relative_only <= 16, relative_only
    assert _probe_errors(keys, queries, relative_only, NUM_KV_HEADS)[1] > 0.2
    assert both > relative_only
    assert _probe_errors(keys, queries, both, NUM_KV_HEADS)[1] <= 0.2
