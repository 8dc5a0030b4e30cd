"""YAKV's selected tokens attended in place from a device mirror of every record (`ops/attend_records.py`,
`kernels/attend_records.cu`): the kernel against its twin, and a fully mirrored cache against a fetching one."""

from __future__ import annotations

import pytest
import torch
from helpers import generate_with, make_tiny_model, random_prompt

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.core.attention import LogitTerms
from shadowkv_cache.ops.attend_records import attend_records, attend_records_reference, records_kernel_fits
from shadowkv_cache.quant import HiggsQuantizer
from shadowkv_cache.stores.quantized_store import QuantizedKVStore, pack_records

CUDA = torch.device("cuda")


def mirrored_store(rows: int, heads: int, num: int, quantizer: HiggsQuantizer, seed: int) -> QuantizedKVStore:
    """Records of random keys and values, pinned, with every token mirrored on the GPU."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(rows, heads, num, quantizer.head_dim, generator=g) for _ in range(2))
    records = pack_records(quantizer.quantize(keys), quantizer.quantize(values))
    return QuantizedKVStore.offload(records.to(CUDA), pin=True, mirror_share=1.0)


def test_a_store_without_a_full_mirror_runs_the_twin():
    quantizer = HiggsQuantizer(64, 2)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 40, 64, generator=g)
    store = QuantizedKVStore.offload(pack_records(quantizer.quantize(keys), quantizer.quantize(keys)), pin=False)
    query = torch.randn(2, 4, 1, 64, generator=g)
    ids = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(4)]).view(2, 2, 8)
    valid = torch.rand(2, 2, 8, generator=g) < 0.7
    parts = [(keys[:, :, :5], keys[:, :, :5], torch.ones(2, 1, 1, 5, dtype=torch.bool))]
    assert not records_kernel_fits(query, store, ids, valid, quantizer, parts)  # no mirror (and no GPU)
    got = attend_records(query, store, ids, valid, quantizer, parts, 0.125)
    assert torch.equal(got, attend_records_reference(query, store, ids, valid, quantizer, parts, 0.125))


def butterflies(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform of `x` `[..., D]` by the kernel's butterflies (pairs a, a + h)."""
    x = x.clone()
    dim, h = x.shape[-1], 1
    while h < dim:
        blocks = x.unflatten(-1, (dim // (2 * h), 2, h))
        a, b = blocks[..., 0, :].clone(), blocks[..., 1, :].clone()
        blocks[..., 0, :], blocks[..., 1, :] = a + b, a - b
        h *= 2
    return x


@pytest.mark.parametrize("grid_dim", [2, 4])
def test_the_kernels_rotated_domain_attention_is_the_definition(grid_dim):
    """What `kernels/attend_records.cu` computes, step by step in PyTorch (float64): the query signed, rotated by the
    butterflies and scaled by scaling / D; each logit the key's norm times the rotated query's dot with the grid
    points of its codes (code c, coordinate j at c*p + j); the weights' sum of value norms times grid points,
    rotated back and signed, over D. It gives the definition's attention over the dequantised records."""
    dim, heads, group, slots, scaling = 64, 2, 3, 20, 0.125
    quantizer = HiggsQuantizer(dim, grid_dim)
    g = torch.Generator().manual_seed(grid_dim)
    keys, values = (torch.randn(1, heads, slots, dim, generator=g) for _ in range(2))
    k_codes, v_codes = quantizer.quantize(keys), quantizer.quantize(values)
    query = torch.randn(1, heads * group, 1, dim, generator=g, dtype=torch.float64)
    grid, signs = (t.double() for t in quantizer.device_tables(torch.device("cpu")))

    rotated = butterflies(query.view(heads, group, dim) * signs) * scaling / dim  # [Hkv, G, D]
    points = grid[k_codes.codes[0].long()].flatten(-2)  # [Hkv, N, D]: code c's point at c*p .. c*p + p - 1
    logits = (rotated @ points.transpose(-1, -2)) * k_codes.norms[0].double()[:, None, :]  # [Hkv, G, N]
    weights = logits.softmax(-1)
    value_points = grid[v_codes.codes[0].long()].flatten(-2) * v_codes.norms[0].double()[..., None]
    got = butterflies(weights @ value_points) * signs / dim  # [Hkv, G, D]

    want_k, want_v = (quantizer.dequantize(c, torch.float64) for c in (k_codes, v_codes))
    want = ((query.view(heads, group, dim) @ want_k[0].transpose(-1, -2)) * scaling).softmax(-1) @ want_v[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "dtype, batch, heads, group, dim, grid_dim, slots, sizes, terms",
    [
        (torch.bfloat16, 3, 8, 4, 128, 2, 256, (64, 5), False),  # Llama-3.1-8B at YAKV's defaults
        (torch.float16, 2, 3, 3, 64, 2, 100, (32, 3), False),  # SmolLM2: 3 query heads per KV head
        (torch.float32, 2, 2, 8, 64, 2, 70, (10, 1), False),  # 8 query heads per KV head
        (torch.bfloat16, 1, 4, 4, 128, 4, 300, (5,), False),  # a 4-D grid
        (torch.bfloat16, 2, 2, 2, 256, 2, 130, (20, 2), False),  # the largest head size
        (torch.bfloat16, 1, 2, 8, 256, 2, 200, (7, 1), False),  # the most shared memory
        (torch.float16, 2, 2, 2, 128, 8, 90, (3,), False),  # an 8-D grid
        (torch.bfloat16, 1, 1, 4, 128, 2, 5000, (64, 1), False),  # many splits
        (torch.bfloat16, 2, 2, 4, 64, 2, 80, (16, 2), True),  # soft-capping and sinks
    ],
)
def test_attend_records_kernel_matches_twin(dtype, batch, heads, group, dim, grid_dim, slots, sizes, terms):
    quantizer = HiggsQuantizer(dim, grid_dim)
    num = slots + 37
    store = mirrored_store(batch + 1, heads, num, quantizer, seed=dim + slots)
    store = store.select_rows(torch.arange(batch).flip(0) + 1)  # cache rows read other stored rows
    g = torch.Generator().manual_seed(slots)
    query = torch.randn(batch, heads * group, 1, dim, generator=g).to(CUDA, dtype)
    ids = torch.stack([torch.randperm(num, generator=g)[:slots] for _ in range(batch * heads)])
    ids = ids.view(batch, heads, slots).to(CUDA)
    valid = (torch.rand(batch, heads, slots, generator=g) < 0.8).to(CUDA)
    valid[0, 0] = False  # a head with nothing selected
    ids[~valid] = -1  # what an empty slot holds: never read
    parts = []
    for n in sizes:
        k, v = (torch.randn(batch, heads, n, dim, generator=g).to(CUDA, dtype) for _ in range(2))
        parts.append((k, v, (torch.rand(batch, 1, 1, n, generator=g) < 0.8).to(CUDA)))
    parts[-1][2][..., -1] = True  # every row holds its own token
    softcap, sinks = (20.0, torch.randn(heads * group, generator=g).to(CUDA)) if terms else (None, None)
    scaling = dim**-0.5
    assert records_kernel_fits(query, store, ids, valid, quantizer, parts, LogitTerms(softcap, sinks))
    got = attend_records(query, store, ids, valid, quantizer, parts, scaling, LogitTerms(softcap, sinks))
    # The definition in float32 on the same inputs: the kernel never rounds the dequantised keys and values.
    floats = [(k.float(), v.float(), m) for k, v, m in parts]
    terms = LogitTerms(softcap, sinks)
    ref = attend_records_reference(query.float(), store, ids, valid, quantizer, floats, scaling, terms)
    assert got.shape == ref.shape == (batch, 1, heads * group, dim) and got.dtype == dtype
    tol = 5e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_fully_mirrored_yakv_cache_attends_in_place_as_a_fetching_one():
    """`device_record_share=1`: no token is fetched or held, and the step attends over the same selection (the records'
    keys and values unrounded: float32 round-off here)."""
    model = make_tiny_model("llama").to(CUDA)
    prompt = random_prompt(300, batch=2).to(CUDA)
    options = dict(mode="yakv", min_compress_len=64, sparse_budget=24)
    fetching_cache = ShadowKVCache(model, **options, device_record_share=0.5)
    fetching = generate_with(model, prompt, fetching_cache, max_new_tokens=12)
    cache = ShadowKVCache(model, **options, device_record_share=1.0)
    in_place = generate_with(model, prompt, cache, max_new_tokens=12)
    assert torch.equal(fetching.sequences, in_place.sequences)
    torch.testing.assert_close(torch.stack(fetching.logits), torch.stack(in_place.logits), rtol=1e-4, atol=1e-4)
    for layer, other in zip(cache.layers, fetching_cache.layers):
        assert layer.mode.attends_in_place and layer.mode.held is None and not other.mode.attends_in_place
        assert layer.mode.sparse_steps == other.mode.sparse_steps > 0
        assert layer.mode.fetched_bytes == 0 and layer.hit_counts() is None
    assert cache.memory_report().hit_rate is None
