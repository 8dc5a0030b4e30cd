"""YAKV's CUDA kernels against their PyTorch twins, and the YAKV decode step without host synchronisation.

Run on a CUDA machine with cuda-python: `python -m pytest -m gpu -q tests/test_yakv_kernels.py`.
Legend: R stored rows, B cache rows, Hkv KV heads, G query heads per KV head, N stored tokens, K selected
tokens per head, D head dim, p grid dim.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from helpers import forward_with, generate_with, make_tiny_model, random_prompt

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.ops.gather_dequant import (
    gather_dequant,
    gather_dequant_missed,
    gather_dequant_missed_reference,
    gather_dequant_reference,
)
from shadowkv_cache.ops.loader import kernels_available, load_kernels
from shadowkv_cache.ops.quantize_higgs import quantize_vectors, quantize_vectors_reference
from shadowkv_cache.ops.score_codes import _SOFTMAX_TILE, _THREADS, attention_scores, code_scores, code_scores_reference
from shadowkv_cache.policies import QuantizedKeyTopK
from shadowkv_cache.policies.shared_budget import SharedBudgetTopK
from shadowkv_cache.quant import HiggsQuantizer, QuantizedVectors
from shadowkv_cache.stores.quantized_store import QuantizedKVStore, pack_records

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def needs_kernels():
    if not kernels_available(CUDA):
        pytest.fail('cuda-python is missing: pip install "shadowkv-cache[cuda]" (cuda-bindings) to test the kernels')


def random_vectors(*shape: int) -> torch.Tensor:
    """Gaussian vectors `[..., D]` with norms spread over a few orders of magnitude, the first one zero."""
    x = torch.randn(*shape, device=CUDA) * torch.exp(torch.randn(*shape[:-1], 1, device=CUDA) * 2)
    x.view(-1, shape[-1])[0] = 0
    return x


def pinned_store(rows: int, heads: int, num: int, quantizer: HiggsQuantizer) -> QuantizedKVStore:
    keys = random_vectors(rows, heads, num, quantizer.head_dim)
    values = random_vectors(rows, heads, num, quantizer.head_dim)
    records = pack_records(quantizer.quantize(keys), quantizer.quantize(values))
    store = QuantizedKVStore.offload(records, pin=True)
    assert store.data.is_pinned()
    return store


def assert_dequantised_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Per vector: float32 round-off of a D-term sum (the kernel's Walsh-Hadamard transform against the twin's
    matmul), then at most one step of the output dtype."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().amax(-1, keepdim=True)
    eps = max(torch.finfo(want.dtype).eps, 1e-5)
    assert bool(((got.float() - want.float()).abs() <= eps * scale).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows, heads, num, k, dim, grid_dim",
    [
        (3, 8, 311, 256, 128, 2),
        (2, 3, 77, 13, 64, 2),
        (4, 2, 51, 50, 64, 4),
        (2, 1, 9, 9, 128, 8),
        (2, 3, 40, 7, 16, 2),  # fewer coordinates than lanes
        (2, 2, 33, 5, 256, 2),  # the largest record the kernel takes
        (1, 5, 20, 3, 8, 8),  # one sub-vector: a 6-byte record, byte loads
    ],
)
def test_gather_dequant_kernel_matches_twin(dtype, rows, heads, num, k, dim, grid_dim):
    torch.manual_seed(0)
    quantizer = HiggsQuantizer(dim, grid_dim)
    store = pinned_store(rows, heads, num, quantizer).select_rows(torch.tensor([rows - 1, 0, rows - 1]))
    ids = torch.randint(0, num, (3, heads, k), device=CUDA)
    ids[1, 0, 0] = 0  # the zero vector of stored row 0
    got_keys, got_values = gather_dequant(store, ids, quantizer, dtype)
    want_keys, want_values = gather_dequant_reference(store, ids, quantizer, dtype)
    assert_dequantised_close(got_keys, want_keys)
    assert_dequantised_close(got_values, want_values)
    assert got_keys[1, 0, 0].eq(0).all()


def test_gather_dequant_kernel_reads_a_shared_document_in_place():
    """Rows that share one stored document (row map all zeros) read the same records as the document alone."""
    torch.manual_seed(1)
    quantizer = HiggsQuantizer(128, 2)
    store = pinned_store(1, 8, 500, quantizer)
    shared = store.select_rows(torch.zeros(4, dtype=torch.int64))
    ids = torch.randint(0, 500, (4, 8, 61), device=CUDA)
    got = gather_dequant(shared, ids, quantizer, torch.bfloat16)
    for row in range(4):
        alone = gather_dequant(store, ids[row : row + 1], quantizer, torch.bfloat16)
        assert torch.equal(got[0][row], alone[0][0]) and torch.equal(got[1][row], alone[1][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, heads, num, k, dim", [(3, 8, 311, 256, 128), (2, 3, 40, 7, 16), (2, 2, 33, 5, 256)])
def test_gather_dequant_missed_kernel_matches_twin(dtype, rows, heads, num, k, dim):
    """The held-token refresh: missed slots as the twin writes them, every other slot (empty ones included, id -1)
    neither read nor written."""
    torch.manual_seed(2)
    quantizer = HiggsQuantizer(dim, 2)
    store = pinned_store(rows, heads, num, quantizer).select_rows(torch.tensor([rows - 1, 0, rows - 1]))
    ids = torch.randint(0, num, (3, heads, k), device=CUDA)
    missed = torch.rand(3, heads, k, device=CUDA) < 0.4
    ids[~missed & (torch.rand(3, heads, k, device=CUDA) < 0.3)] = -1
    keys = torch.full((3, heads, k, dim), 5.0, dtype=dtype, device=CUDA)
    values = torch.full_like(keys, -5.0)
    want_keys, want_values = keys.clone(), values.clone()
    gather_dequant_missed(store, ids, missed, quantizer, keys, values)
    gather_dequant_missed_reference(store, ids, missed, quantizer, want_keys, want_values)
    assert_dequantised_close(keys, want_keys)
    assert_dequantised_close(values, want_values)
    assert keys[~missed].eq(5.0).all() and values[~missed].eq(-5.0).all()


@pytest.mark.parametrize("records_per_warp", [1, 3, 4])
@pytest.mark.parametrize("mirrored", [0, 1, 150, 311])
def test_gather_dequant_kernel_reads_mirrored_tokens_from_the_mirror(monkeypatch, mirrored, records_per_warp):
    """Tokens below N' come from the device mirror, the others from the host: a mirror of other records (never the
    case in a cache, where it is a copy) shows which one each slot read, for every slot and for the refresh, however
    many slots a warp takes."""
    monkeypatch.setattr("shadowkv_cache.ops.gather_dequant.RECORDS_PER_WARP", records_per_warp)
    torch.manual_seed(3)
    quantizer = HiggsQuantizer(128, 2)
    store, other = pinned_store(3, 8, 311, quantizer), pinned_store(3, 8, 311, quantizer)
    mirror = other.data[:, :, :mirrored].to(CUDA) if mirrored else None
    mixed = QuantizedKVStore(store.data, store.stored_rows, mirror).select_rows(torch.tensor([2, 0, 2]))
    ids = torch.randint(0, 311, (3, 8, 256), device=CUDA)
    got_keys, got_values = gather_dequant(mixed, ids, quantizer, torch.bfloat16)
    want_keys, want_values = gather_dequant_reference(mixed, ids, quantizer, torch.bfloat16)
    assert_dequantised_close(got_keys, want_keys)
    assert_dequantised_close(got_values, want_values)
    near = (ids < mirrored)[..., None]
    host_keys, _ = gather_dequant(store.select_rows(torch.tensor([2, 0, 2])), ids, quantizer, torch.bfloat16)
    from_other, _ = gather_dequant(other.select_rows(torch.tensor([2, 0, 2])), ids, quantizer, torch.bfloat16)
    assert torch.equal(got_keys, torch.where(near, from_other, host_keys))
    missed = torch.rand(3, 8, 256, device=CUDA) < 0.5
    keys, values = torch.zeros_like(got_keys), torch.zeros_like(got_values)
    gather_dequant_missed(mixed, ids, missed, quantizer, keys, values)
    assert torch.equal(keys[missed], got_keys[missed]) and not keys[~missed].any()


def test_a_mirrored_yakv_cache_decodes_as_an_unmirrored_one():
    """`device_record_share` changes where records are read, not what is read: the same tokens and logits."""
    model = make_tiny_model("llama").to(CUDA, torch.bfloat16)
    prompt = random_prompt(300, batch=2).to(CUDA)
    options = dict(mode="yakv", min_compress_len=64, sparse_budget=24)
    plain_cache = ShadowKVCache(model, **options)
    plain = generate_with(model, prompt, plain_cache, max_new_tokens=12)
    cache = ShadowKVCache(model, **options, device_record_share=0.5)
    mirrored = generate_with(model, prompt, cache, max_new_tokens=12)
    assert torch.equal(plain.sequences, mirrored.sequences)
    torch.testing.assert_close(torch.stack(plain.logits), torch.stack(mirrored.logits), rtol=0, atol=0)
    store = cache.layers[0].prompt.store
    assert store.mirrored_tokens == store.data.shape[2] // 2 and store.mirror.device.type == "cuda"
    # The same tokens were fetched; only those past the mirror count as read from host memory.
    host_bytes = [sum(layer.mode.fetched_bytes for layer in c.layers) for c in (plain_cache, cache)]
    assert 0 < host_bytes[1] < host_bytes[0]
    # A new turn (a multi-token step) reads every quantised token: the mirrored ones from the device.
    turn = torch.cat([plain.sequences[:, -1:], random_prompt(5, batch=2, seed=1).to(CUDA)], dim=1)
    logits = [forward_with(model, turn, c).logits for c in (plain_cache, cache)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_gather_dequant_kernel_handles_an_empty_selection():
    quantizer = HiggsQuantizer(64, 2)
    store = pinned_store(2, 2, 10, quantizer)
    keys, values = gather_dequant(store, torch.zeros(2, 2, 0, dtype=torch.int64, device=CUDA), quantizer, torch.float16)
    assert keys.shape == values.shape == (2, 2, 0, 64)


def assert_quantized_close(quantizer: HiggsQuantizer, x: torch.Tensor, got: QuantizedVectors, want: QuantizedVectors):
    """Norms within one fp16 step (float32 round-off before the rounding); codes equal on >= 99.9% of sub-vectors,
    and where they differ the two grid points equidistant, to round-off, from the twin's scaled sub-vector (the
    kernel's transform and distances round in another order than the twin's matmuls)."""
    assert got.codes.shape == want.codes.shape and got.norms.shape == want.norms.shape
    assert got.codes.dtype == torch.uint8 and got.norms.dtype == torch.float16
    torch.testing.assert_close(got.norms.float(), want.norms.float(), rtol=1e-3, atol=0)
    same = got.codes == want.codes
    assert same.float().mean().item() >= 0.999
    if same.all():
        return
    rotated = quantizer.rotate(x.float())
    norms = rotated.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    sub = (rotated * (math.sqrt(quantizer.head_dim) / norms)).unflatten(-1, (quantizer.num_subvectors, -1))
    sub, grid = sub[~same].double(), quantizer.grid.to(x.device, torch.float64)  # [F, p], [256, p]
    dist_got = (sub - grid[got.codes[~same].long()]).square().sum(-1)
    dist_want = (sub - grid[want.codes[~same].long()]).square().sum(-1)
    assert bool(((dist_got - dist_want).abs() <= 1e-4 * (1 + dist_want)).all())


def spread_vectors(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian vectors `[..., D]` in `dtype`, norms over a few orders of magnitude, every 97th one zero."""
    x = torch.randn(*shape, device=CUDA) * torch.exp(torch.randn(*shape[:-1], 1, device=CUDA))
    x.view(-1, shape[-1])[::97] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim, grid_dim", [(64, 2), (64, 4), (64, 8), (128, 2), (128, 4), (128, 8)])
def test_quantize_kernel_matches_twin(dtype, dim, grid_dim):
    """As at prefill: the keys of one row and a span of tokens, a strided view read in place."""
    torch.manual_seed(0)
    quantizer = HiggsQuantizer(dim, grid_dim)
    keys = spread_vectors(2, 8, 1100, dim, dtype=dtype)[1, :, 37:1060]  # [Hkv, n, D], strides (S*D, D, 1)
    got = quantize_vectors(quantizer, keys)
    want = quantize_vectors_reference(quantizer, keys)
    assert_quantized_close(quantizer, keys, got, want)
    zero = keys.eq(0).all(-1)
    assert zero.any() and got.norms[zero].eq(0).all()


@pytest.mark.parametrize("dim, grid_dim", [(16, 2), (16, 8), (32, 8), (256, 2), (256, 4), (8, 8)])
def test_quantize_kernel_matches_twin_at_other_head_dims(dim, grid_dim):
    """Fewer coordinates than lanes (several lanes per sub-vector, down to a single sub-vector) and the largest."""
    torch.manual_seed(1)
    quantizer = HiggsQuantizer(dim, grid_dim)
    x = spread_vectors(3, 5, 301, dim, dtype=torch.bfloat16)
    assert_quantized_close(quantizer, x, quantize_vectors(quantizer, x), quantize_vectors_reference(quantizer, x))


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.transpose(1, 2)[0, :, 3:250],  # keys kept [B, S, Hkv, D]: heads x tokens, token stride Hkv*D
        lambda x: x[:, 10:200:3, :3],  # three strided levels: copied first
        lambda x: x[0, 7, 1:2],  # one vector
        lambda x: x[1, :, 2, None, :],  # [S, 1, D] with the policy's chunk dim, token stride Hkv*D
    ],
)
def test_quantize_kernel_gives_the_same_bits_for_any_layout(make):
    """The kernel's arithmetic does not depend on where the vectors sit: a view quantises as its contiguous copy."""
    torch.manual_seed(2)
    quantizer = HiggsQuantizer(128, 2)
    view = make(spread_vectors(2, 256, 4, 128, dtype=torch.bfloat16))  # [B, S, Hkv, D]
    got, copy = quantize_vectors(quantizer, view), quantize_vectors(quantizer, view.contiguous())
    assert torch.equal(got.codes, copy.codes) and torch.equal(got.norms, copy.norms)
    assert_quantized_close(quantizer, view, got, quantize_vectors_reference(quantizer, view))


def test_quantize_kernel_matches_twin_on_many_vectors_without_synchronising():
    """2^20 vectors (each warp loops over ~124 of them), float64 input (through float32, as the twin), an empty
    input; none of it waits for the host."""
    torch.manual_seed(3)
    quantizer = HiggsQuantizer(128, 4)
    x = spread_vectors(1 << 20, 128, dtype=torch.bfloat16)
    quantize_vectors(quantizer, x[:1])  # loads the kernel and the device tables
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = quantize_vectors(quantizer, x)
        empty = quantize_vectors(quantizer, torch.empty(0, 3, 128, dtype=torch.bfloat16, device=CUDA))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_quantized_close(quantizer, x, got, quantize_vectors_reference(quantizer, x))
    assert empty.codes.shape == (0, 3, 32) and empty.norms.shape == (0, 3)
    small = x[:999].double()
    assert_quantized_close(quantizer, small, quantize_vectors(quantizer, small), quantizer.quantize(small))


def scoring_state(rows: int, heads: int, num: int, quantizer: HiggsQuantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes `[R, Hkv, N, M]` and norms `[R, Hkv, N]` of keys with a few large ones (peaked softmaxes)."""
    keys = torch.randn(rows, heads, num, quantizer.head_dim, device=CUDA)
    keys[..., ::37, :] *= 6
    packed = quantizer.quantize(keys)
    return packed.codes, packed.norms


SCORE_CASES = [  # (batch, kv_heads, group, num, dim, grid_dim)
    (2, 8, 4, 16381, 128, 4),
    (3, 3, 3, 700, 64, 4),
    (1, 2, 8, 5000, 256, 4),
    (2, 2, 1, 37, 128, 4),
    (1, 1, 7, 4100, 128, 4),
    (1, 2, 8, 5000, 128, 2),
    (2, 2, 5, 513, 128, 8),
    (4, 2, 1, 37, 64, 2),
    (1, 1, 4, 3000, 256, 2),
    (2, 4, 2, 1031, 64, 8),
    (2, 2, 5, 3001, 128, 4),  # odd and even groups above 4 on tensor cores too
    (1, 3, 6, 2050, 64, 4),
]


@pytest.mark.parametrize(
    "batch, kv_heads, group, num, dim, grid_dim, tensor_cores",
    # The tensor-core kernels take grid dim 4 only; the fp32 kernel takes every case.
    [(*case, cores) for case in SCORE_CASES for cores in (True, False) if not cores or case[-1] == 4],
)
def test_code_scores_kernel_matches_twin(batch, kv_heads, group, num, dim, grid_dim, tensor_cores, monkeypatch):
    """Softmax over tokens of the code logits, max over the group, from the tensor-core kernels (grid dim 4, sm_80+:
    checked to be the path that ran) and the fp32 kernel. They sum the dot products in another order than the twin's
    table and use `__expf` (~1e-5 relative); the tensor-core path also keeps fp16 exponentials (2^-11 = 4.9e-4
    relative), inside 1e-3."""
    mma = tensor_cores and torch.cuda.get_device_capability(CUDA) >= (8, 0)
    if tensor_cores and not mma:
        pytest.skip("the tensor-core kernels need sm_80 or later")
    calls = spy_on_tensor_cores(monkeypatch)
    torch.manual_seed(0)
    quantizer = HiggsQuantizer(dim, grid_dim)
    codes, norms = scoring_state(batch, kv_heads, num, quantizer)
    query = torch.randn(batch, kv_heads * group, 1, dim, device=CUDA, dtype=torch.bfloat16)
    real = torch.rand(batch, num, device=CUDA) < 0.9
    real[0] = False  # a row with nothing selectable scores 0 everywhere
    selectable = real[:, None, :].expand(-1, kv_heads, -1)  # the layer's own view: head stride 0
    scaling = dim**-0.5
    got = code_scores(query, codes, norms, selectable, quantizer, scaling, tensor_cores=tensor_cores)
    want = code_scores_reference(query, codes, norms, selectable, quantizer, scaling)
    assert calls == ([1] if mma else [])
    assert got.shape == want.shape == (batch, kv_heads, num)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6 * want.amax().item())
    assert got[0].eq(0).all()
    assert got[~selectable].eq(0).all()
    # The ranking the policy takes from it: every token the kernel's top-k picks is, by the twin's scores, as
    # good as the twin's own k-th best up to the tolerance above (only near-ties may swap).
    k = max(1, num // 50)
    picked = want[1:].gather(-1, got[1:].topk(k, dim=-1).indices)
    kth = want[1:].topk(k, dim=-1).values[..., -1:]
    assert bool((picked >= kth * (1 - 1e-3) - 1e-6 * want.amax()).all())


@pytest.mark.parametrize("grid", [(4, 3, 4), (5, 2, 4), (3, 2, 8), (2, 2, 8)])
@pytest.mark.parametrize("group", [3, 4, 6])
def test_every_d128_tensor_core_grid_gives_the_same_scores(grid, group, monkeypatch):
    """D = 128's tensor-core kernel compiled at each grid the benchmarks compare (blocks per SM, code-ring stages,
    warps per block): the warps of a block split its tile differently, so the tile's softmax sums add in another
    order (float32 round-off); the scores are otherwise the same."""
    import shadowkv_cache.ops.score_codes as score_codes

    if torch.cuda.get_device_capability(CUDA) < (8, 0):
        pytest.skip("the tensor-core kernels need sm_80 or later")
    torch.manual_seed(0)
    quantizer = HiggsQuantizer(128, 4)
    codes, norms = scoring_state(2, 2, 5003, quantizer)
    query = torch.randn(2, 2 * group, 1, 128, device=CUDA, dtype=torch.bfloat16)
    selectable = (torch.rand(2, 5003, device=CUDA) < 0.9)[:, None, :].expand(-1, 2, -1)
    want = code_scores(query, codes, norms, selectable, quantizer, 0.088, tensor_cores=True)
    monkeypatch.setattr(score_codes, "MMA_K8_GRID", grid)
    got = code_scores(query, codes, norms, selectable, quantizer, 0.088, tensor_cores=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7 * want.amax().item())
    torch.testing.assert_close(got, code_scores_reference(query, codes, norms, selectable, quantizer, 0.088),
                               rtol=1e-3, atol=1e-6 * want.amax().item())  # fmt: skip


@pytest.mark.parametrize("group, dim", [(3, 128), (4, 64), (6, 128), (8, 256)])
def test_masked_code_scores_are_minus_infinity_where_not_selectable(group, dim, monkeypatch):
    """`masked=True`, what `QuantizedKeyTopK`'s top-k reads: the tensor-core kernels write -inf for tokens that are not
    selectable as they write the scores (no pass over them), and the twin's scores elsewhere; the policy's masked scores
    are these."""
    calls = spy_on_tensor_cores(monkeypatch)
    torch.manual_seed(6)
    batch, kv_heads, num = 2, 3, 2333
    quantizer = HiggsQuantizer(dim, 4)
    codes, norms = scoring_state(batch, kv_heads, num, quantizer)
    query = torch.randn(batch, kv_heads * group, 1, dim, device=CUDA, dtype=torch.bfloat16)
    selectable = torch.rand(batch, kv_heads, num, device=CUDA) < 0.6
    selectable[1, 2] = False  # a head with nothing selectable
    got = code_scores(query, codes, norms, selectable, quantizer, dim**-0.5, masked=True)
    assert calls == [1]
    want = code_scores_reference(query, codes, norms, selectable, quantizer, dim**-0.5)
    assert bool(got[~selectable].eq(float("-inf")).all())
    torch.testing.assert_close(got[selectable], want[selectable], rtol=1e-3, atol=1e-6 * want.amax().item())
    policy = QuantizedKeyTopK()
    state = {"codes": codes, "norms": norms}
    assert torch.equal(policy.masked_scores(query, state, selectable, dim**-0.5), got)


def tile_states(logits: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile softmax states `[..., NT]` of `logits` `[..., N]` (-inf where not selectable), as a first pass
    writes them: each tile's max (-inf for a tile with nothing selectable) and sum of exp(logit - max)."""
    tiles = -(-logits.shape[-1] // tile)
    padded = torch.nn.functional.pad(logits, (0, tiles * tile - logits.shape[-1]), value=float("-inf"))
    padded = padded.view(*logits.shape[:-1], tiles, tile)
    part_max = padded.amax(-1)
    part_sum = (padded - part_max.nan_to_num(neginf=0.0)[..., None]).exp().sum(-1)
    return part_max.contiguous(), part_sum.contiguous()


@pytest.mark.parametrize(
    "batch, kv_heads, group, num, tile",
    [
        (2, 3, 4, 2500, 1024),  # the first pass's tiles
        (1, 2, 1, 1024, 1024),
        (3, 1, 8, 37, 1024),
        (2, 2, 3, 5000, 300),  # other tiles: the merge does not depend on where they cut
    ],
)
def test_softmax_group_max_kernel_matches_twin(batch, kv_heads, group, num, tile):
    """The second pass alone: `attention_scores` (one query token) from logits and per-tile states made here.
    The kernel exponentiates with `__expf` and merges the tiles' sums in its own order: ~1e-6 relative."""
    torch.manual_seed(2)
    logits = torch.randn(batch, kv_heads, group, num, device=CUDA) * 4
    selectable = torch.rand(batch, kv_heads, num, device=CUDA) < 0.8
    selectable[0, 0] = False  # a head with nothing selectable scores 0
    selectable[-1, -1, : min(num, 2 * tile)] = False  # whole tiles with nothing selectable
    selectable[-1, -1, -1] = True
    masked = logits.masked_fill(~selectable[:, :, None, :], float("-inf")).contiguous()
    part_max, part_sum = tile_states(masked, tile)
    scores = torch.full((batch, kv_heads, num), float("nan"), device=CUDA)
    i32 = ctypes.c_int
    load_kernels("softmax_group_max", CUDA).launch(
        "softmax_group_max",
        grid=(-(-num // _SOFTMAX_TILE), kv_heads, batch),
        block=(_THREADS, 1, 1),
        args=[scores, masked, part_max, part_sum, (kv_heads, i32), (group, i32), (num, i32), (part_max.shape[-1], i32)],
    )
    want = attention_scores(logits, selectable, group)
    torch.testing.assert_close(scores, want, rtol=1e-4, atol=1e-7)
    assert scores[0, 0].eq(0).all() and scores[~selectable].eq(0).all()


def spy_on_tensor_cores(monkeypatch) -> list[int]:
    """A list that gets one entry per call of the tensor-core scoring path."""
    import shadowkv_cache.ops.score_codes as score_codes

    calls: list[int] = []
    real = score_codes._code_scores_mma
    monkeypatch.setattr(score_codes, "_code_scores_mma", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 3e4])
def test_tensor_core_scores_hold_any_query_magnitude(magnitude, monkeypatch):
    """The tensor-core kernels scale each query head by a power of two into fp16's range and split it into two fp16
    parts: queries far below or above fp16's comfortable range still score as the twin does (fp32), with tokens
    selectable per head; and the tensor-core path is the one that ran."""
    if torch.cuda.get_device_capability(CUDA) < (8, 0):
        pytest.skip("tensor-core scoring needs sm_80 or later")
    calls = spy_on_tensor_cores(monkeypatch)
    torch.manual_seed(3)
    batch, kv_heads, group, num, dim = 2, 4, 4, 3000, 128
    quantizer = HiggsQuantizer(dim, 4)
    codes, norms = scoring_state(batch, kv_heads, num, quantizer)
    query = torch.randn(batch, kv_heads * group, 1, dim, device=CUDA) * magnitude
    query[:, 1] *= 4  # heads of one group apart in scale
    selectable = torch.rand(batch, kv_heads, num, device=CUDA) < 0.8  # each head its own tokens
    scaling = 0.05 / magnitude  # logits of a usual size whatever the query's scale
    got = code_scores(query, codes, norms, selectable, quantizer, scaling)
    want = code_scores_reference(query, codes, norms, selectable, quantizer, scaling)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6 * want.amax().item())
    assert got[~selectable].eq(0).all()


@pytest.mark.parametrize("group", [3, 4])
def test_tensor_core_scores_keep_a_wide_logit_range(group, monkeypatch):
    """Logits spread over ~100 within each 16-token group (peaked softmaxes, sharp heads): the tensor-core path keeps
    each logit as an fp16 exponential relative to its group's max (times 2^15), so scores hold 2^-11 relative down to
    2^-29 of the group's max and are within 2^-39 absolute below; the ranking of the tokens that carry the mass is
    the twin's."""
    if torch.cuda.get_device_capability(CUDA) < (8, 0):
        pytest.skip("tensor-core scoring needs sm_80 or later")
    calls = spy_on_tensor_cores(monkeypatch)
    torch.manual_seed(4)
    batch, kv_heads, num, dim = 2, 2, 4099, 128
    quantizer = HiggsQuantizer(dim, 4)
    codes, norms = scoring_state(batch, kv_heads, num, quantizer)
    query = torch.randn(batch, kv_heads * group, 1, dim, device=CUDA)
    selectable = torch.rand(batch, kv_heads, num, device=CUDA) < 0.7
    scaling = 1.5  # logits of std ~15: exponentials from 1 down to far below fp16's range within a group
    got = code_scores(query, codes, norms, selectable, quantizer, scaling)
    want = code_scores_reference(query, codes, norms, selectable, quantizer, scaling)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=2.0**-39)
    assert got[~selectable].eq(0).all()
    assert bool((want < 2.0**-39).any())  # the range below fp16's was reached
    # Every token the kernel's top-k picks is, by the twin's scores, as good as the twin's own k-th best up to the
    # bounds above. Not the same set: two tokens within 2^-11 of each other may swap places at the k-th (an H200 run
    # of an exact-set check failed so), and below 2^-39 the order is not kept (such tokens carry no mass).
    k = 64
    picked = want.gather(-1, got.topk(k, dim=-1).indices)
    kth = want.topk(k, dim=-1).values[..., -1:]
    assert bool((picked >= kth * (1 - 1e-3) - 2.0**-39).all())


def test_code_scores_kernel_reads_a_shared_document_in_place():
    torch.manual_seed(1)
    batch, kv_heads, group, num, dim = 3, 8, 4, 2000, 128
    quantizer = HiggsQuantizer(dim, 4)
    codes, norms = scoring_state(1, kv_heads, num, quantizer)
    query = torch.randn(batch, kv_heads * group, 1, dim, device=CUDA, dtype=torch.bfloat16)
    selectable = (torch.rand(1, num, device=CUDA) < 0.9)[:, None, :].expand(batch, kv_heads, -1)
    expand = lambda t: t.expand(batch, *t.shape[1:])  # noqa: E731
    shared = code_scores(query, expand(codes), expand(norms), selectable, quantizer, 0.1)
    private = code_scores(
        query, expand(codes).contiguous(), expand(norms).contiguous(), selectable.contiguous(), quantizer, 0.1
    )
    assert torch.equal(shared, private)


@pytest.mark.parametrize(
    "arch, prompt, budget",
    [
        ("llama", 301, 24),
        ("qwen3", 301, 24),
        ("llama", 1500, 1100),  # more slots than the scan kernel compares pairwise: the sorted scan on the GPU
    ],
)
def test_yakv_kernel_path_matches_twin_path_end_to_end(arch, prompt, budget, monkeypatch):
    """A real selection through `generate`, with the held tokens refreshed from step to step, kernels against
    twins."""
    ids = random_prompt(prompt).to(CUDA)
    model = make_tiny_model(arch).to(CUDA)
    config = {"mode": "yakv", "sparse_budget": budget, "min_compress_len": 64}
    with_kernels = generate_with(model, ids, ShadowKVCache(model, **config))
    monkeypatch.setenv("SHADOWKV_KERNELS", "0")
    twins = generate_with(model, ids, ShadowKVCache(model, **config))
    assert torch.equal(with_kernels.sequences, twins.sequences)
    torch.testing.assert_close(torch.stack(with_kernels.logits), torch.stack(twins.logits), rtol=1e-4, atol=1e-4)


def fetched_bytes(cache: ShadowKVCache) -> int:
    return sum(layer.mode.fetched_bytes for layer in cache.layers if layer.is_compressed)


@pytest.mark.parametrize(
    "arch, prompt, budget, beams, shared",
    [
        ("llama", 301, 24, 1, False),
        ("qwen3", 301, 24, 1, False),
        ("llama", 1500, 1100, 1, False),
        ("llama", 301, 24, 2, False),
        ("llama", 301, 24, 1, True),  # SharedBudgetTopK: no held tokens, each step's selection fetched afresh
    ],
)
def test_yakv_steps_are_captured_and_replay_the_eager_steps(arch, prompt, budget, beams, shared):
    """One-token YAKV steps run as CUDA graphs (every compressed layer captured) and give the eager steps' tokens,
    logits, hit counts and fetched bytes: the held tokens, the scan and the counters are replayed, not frozen at
    capture, also after `reset()` and a second document (whose first step the layers capture at once). Beam search
    reorders rows between steps, so its layers capture again."""
    ids = random_prompt(prompt).to(CUDA)
    model = make_tiny_model(arch).to(CUDA)
    config = {"mode": "yakv", "sparse_budget": budget, "min_compress_len": 64}
    if shared:
        config["policy"] = SharedBudgetTopK()
    graphed = ShadowKVCache(model, **config)
    eager = ShadowKVCache(model, cuda_graphs=False, **config)
    for document in (ids, random_prompt(prompt, seed=5).to(CUDA)):
        graphed.reset()
        eager.reset()
        replays = graphed.step_graphs.replays
        got = generate_with(model, document, graphed, max_new_tokens=24, num_beams=beams)
        want = generate_with(model, document, eager, max_new_tokens=24, num_beams=beams)
        if beams == 1:  # beam search reorders rows at every step, which moves the tensors: those steps run eagerly
            assert graphed.step_graphs.replays - replays >= 20
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5)
        assert graphed.memory_report().hit_rate == eager.memory_report().hit_rate
        assert fetched_bytes(graphed) == fetched_bytes(eager) > 0


def test_a_prefix_file_loads_mirrored_and_decodes_as_unmirrored(tmp_path):
    """`device_record_share` may change at `load_prefix`: the loaded store mirrors its first records on the device and
    the question decodes as from the same file loaded without a mirror."""
    model = make_tiny_model("llama").to(CUDA)
    options = dict(mode="yakv", min_compress_len=64, sparse_budget=24)
    document, question = random_prompt(300, seed=5)[0], random_prompt(6, seed=6)[0]
    ShadowKVCache.prefill(model, document, **options).save_prefix(tmp_path / "doc.safetensors")
    ids = torch.cat([document, question])[None].to(CUDA)
    out = []
    for share in (0.0, 0.7):
        cache = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors", device_record_share=share)
        store = cache.layers[0].prompt.store
        assert store.mirrored_tokens == int(share * store.data.shape[2])
        out.append(generate_with(model, ids, cache, max_new_tokens=8))
    assert torch.equal(out[0].sequences, out[1].sequences)
    torch.testing.assert_close(torch.stack(out[0].logits), torch.stack(out[1].logits), rtol=0, atol=0)
