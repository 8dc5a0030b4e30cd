"""CUDA kernels against their PyTorch twins, and the decode step without host synchronisation.

Run on a CUDA machine with cuda-python: `python -m pytest -m gpu -q tests/test_kernels.py`.
Legend: B batch, Hkv KV heads, K slots, C chunks, c chunk size, D head dim, Tc compressed tokens, R rank.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import forward_with, make_tiny_model, random_prompt, small_budget_overrides
from test_kernel_twins import ROPE_LAYOUTS, random_scan_case

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.core.attention import NO_TERMS, LogitTerms
from shadowkv_cache.core.landmarks import quantize_landmarks
from shadowkv_cache.hf.adapters import ModelRope, patch_model
from shadowkv_cache.ops import landmark_logits as landmark_logits_module
from shadowkv_cache.ops.gather_values import gather_values, gather_values_reference
from shadowkv_cache.ops.key_rope import slot_products
from shadowkv_cache.ops.landmark_logits import (
    landmark_logits_int8,
    landmark_logits_int8_reference,
    landmark_logits_native,
    landmark_logits_native_reference,
    native_kernel_fits,
)
from shadowkv_cache.ops.landmark_scores import landmark_scores, landmark_scores_reference
from shadowkv_cache.ops.loader import kernels_available
from shadowkv_cache.ops.rebuild_keys import rebuild_keys, rebuild_missed_keys
from shadowkv_cache.ops.select_topk import select_topk, select_topk_reference
from shadowkv_cache.ops.temporal_scan import temporal_scan, temporal_scan_reference
from shadowkv_cache.policies import LandmarkTopK
from shadowkv_cache.stores.value_store import HostValueStore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

CUDA = torch.device("cuda")
rebuild_keys_op = importlib.import_module("shadowkv_cache.ops.rebuild_keys")  # `ops.rebuild_keys` is the twin
rebuild_missed_op = importlib.import_module("shadowkv_cache.ops.rebuild_missed")
landmark_scores_op = importlib.import_module("shadowkv_cache.ops.landmark_scores")
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


@pytest.fixture(autouse=True)
def needs_kernels():
    if not kernels_available(CUDA):
        pytest.fail('cuda-python is missing: pip install "shadowkv-cache[cuda]" (cuda-bindings) to test the kernels')


@pytest.mark.parametrize(
    "batch, heads, slots, chunks",
    [(1, 1, 13, 13), (3, 2, 51, 77), (2, 8, 77, 311), (2, 8, 256, 16376), (1, 3, 2048, 5000), (5, 1, 1, 3)],
)
def test_temporal_scan_kernel_matches_twin(batch, heads, slots, chunks):
    for seed in range(3):
        ids, wanted, valid = random_scan_case(batch, heads, slots, chunks, seed)
        ref_ids, ref_miss = temporal_scan_reference(ids, wanted, valid)
        got_ids, got_miss = temporal_scan(ids.cuda(), wanted.cuda(), valid.cuda())
        assert torch.equal(got_ids.cpu(), ref_ids)
        assert torch.equal(got_miss.cpu(), ref_miss)


@pytest.mark.parametrize(
    "batch, heads, slots, units",
    [
        (1, 1, 1025, 1025),
        (2, 3, 1100, 1500),
        (2, 8, 4096, 131072),
        (1, 2, 1031, 1000000),
        (3, 1, 3000, 40000),
        (2, 8, 256, 16376),  # ShadowKV's chunks at 128K
        (3, 2, 51, 77),
        (5, 1, 1, 3),
    ],
)
def test_temporal_scan_bitmap_kernel_matches_twin(batch, heads, slots, units, monkeypatch):
    """Rows whose units are known (ShadowKV's chunks, YAKV's tokens): the bitmap kernel, checked to be what ran, holds
    exactly what the twin holds, in the same slots, in place; where its bitmaps would not fit shared memory (a million
    units: 250 KB) the sorted scan runs above QUADRATIC_SLOTS slots, with the same result."""
    import shadowkv_cache.ops.temporal_scan as scan

    calls = []
    real = scan.temporal_scan_op
    monkeypatch.setattr(scan, "temporal_scan_op", lambda *a: calls.append(a[3:]) or real(*a))
    counts, misses = torch.zeros(2, dtype=torch.int64, device=CUDA), 0
    for seed in range(3):
        ids, wanted, valid = random_scan_case(batch, heads, slots, units, seed)
        ref_ids, ref_miss = temporal_scan_reference(ids, wanted, valid)
        held = ids.cuda()
        got_ids, got_miss = scan.temporal_scan(held, wanted.cuda(), valid.cuda(), units=units, counts=counts)
        assert got_ids is held
        assert torch.equal(got_ids.cpu(), ref_ids)
        assert torch.equal(got_miss.cpu(), ref_miss)
        misses += int(ref_miss.sum())
    assert counts.tolist() == [misses, 3]  # counted by the kernel (or after the sorted scan)
    assert [c[:1] for c in calls] == ([(units,)] * 3 if scan._bitmap_fits(units, CUDA) else [])
    assert scan._bitmap_fits(131072, CUDA) and not scan._bitmap_fits(1000000, CUDA)


def llama3_rope():
    """A real rotate-half RoPE with Llama-3 frequency scaling and a large theta, on the GPU."""
    model = make_tiny_model(
        "llama",
        head_dim=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size=256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ).cuda()
    return patch_model(model).rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch, heads, slots, chunks, c, dim, rank, miss_rate",
    [
        (2, 3, 13, 51, 8, 128, 77, 0.6),
        (1, 8, 311, 400, 8, 128, 160, 0.6),
        (2, 8, 256, 300, 8, 128, 160, 0.02),  # most groups of 32 slots all hit and return at once
        (3, 2, 7, 9, 5, 64, 13, 0.6),
    ],
)
def test_rebuild_keys_kernel_matches_twin(dtype, batch, heads, slots, chunks, c, dim, rank, miss_rate):
    torch.manual_seed(0)
    rope = llama3_rope()
    if dim != 128:  # another head dim: a plain RoPE of that size
        rope = patch_model(
            make_tiny_model(
                "qwen2", head_dim=dim, hidden_size=2 * dim, num_attention_heads=2, num_key_value_heads=1
            ).cuda()
        ).rope
    tc = chunks * c
    a = (torch.randn(batch, tc, rank, device=CUDA) / rank**0.5).to(dtype)
    b = torch.randn(batch, rank, heads, dim, device=CUDA).to(dtype)
    positions = (torch.arange(tc, device=CUDA) * 13 + 100_000)[None].expand(batch, tc).contiguous()
    ids = torch.stack([torch.randperm(chunks, device=CUDA)[:slots] for _ in range(batch * heads)]).view(
        batch, heads, slots
    )
    miss = torch.rand(batch, heads, slots, device=CUDA) < miss_rate
    before = torch.randn(batch, heads, slots, c, dim, device=CUDA).to(dtype)
    keys = before.clone()
    rebuild_missed_keys(keys, ids, miss, a, b, positions, rope)

    rows, hs, ss = miss.nonzero(as_tuple=True)
    expected = rebuild_keys(a, b, positions, rows, hs, ids[rows, hs, ss], c, rope)
    rtol, atol = TOLERANCE[dtype]
    scale = expected.float().abs().amax().item()
    torch.testing.assert_close(keys[rows, hs, ss].float(), expected.float(), rtol=rtol, atol=atol * scale)
    assert torch.equal(keys[~miss], before[~miss])  # hits untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", [*ROPE_LAYOUTS, "interleaved-partial-d128", "no-rope"])
def test_rebuild_keys_kernel_follows_the_rope_layout(dtype, name, monkeypatch):
    """Partial rotary (rotated dims first, the rest copied), interleaved pairs and layers without RoPE: the kernel
    against the twin, which applies the model's own `apply_rotary_pos_emb` (`ModelRope`)."""
    torch.manual_seed(0)
    if name == "no-rope":
        rope, dim = ModelRope.none(), 16
    elif name == "interleaved-partial-d128":  # GLM-4's real shape: 64 of 128 dims rotate, in adjacent pairs
        sizes = {"head_dim": 128, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
        model = make_tiny_model("glm", partial_rotary_factor=0.5, **sizes)
        rope, dim = patch_model(model.cuda()).rope, 128
    else:
        arch, overrides, _, _ = ROPE_LAYOUTS[name]
        rope, dim = patch_model(make_tiny_model(arch, **overrides).cuda()).rope, 16
    assert rope.layout is not None
    launches = []
    launch = rebuild_keys_op._launch
    monkeypatch.setattr(rebuild_keys_op, "_launch", lambda *args: launches.append(args[-1]) or launch(*args))

    batch, heads, slots, chunks, c, rank = 2, 3, 13, 51, 8, min(13, dim)
    tc = chunks * c
    a = (torch.randn(batch, tc, rank, device=CUDA) / rank**0.5).to(dtype)
    b = torch.randn(batch, rank, heads, dim, device=CUDA).to(dtype)
    positions = (torch.arange(tc, device=CUDA) * 13 + 100_000)[None].expand(batch, tc).contiguous()
    ids = torch.stack([torch.randperm(chunks, device=CUDA)[:slots] for _ in range(batch * heads)]).view(
        batch, heads, slots
    )
    miss = torch.rand(batch, heads, slots, device=CUDA) < 0.6
    before = torch.randn(batch, heads, slots, c, dim, device=CUDA).to(dtype)
    keys = before.clone()
    rebuild_missed_keys(keys, ids, miss, a, b, positions, rope)
    assert launches == [rope.layout]

    rows, hs, ss = miss.nonzero(as_tuple=True)
    expected = rebuild_keys(a, b, positions, rows, hs, ids[rows, hs, ss], c, rope)
    rtol, atol = TOLERANCE[dtype]
    scale = expected.float().abs().amax().item()
    torch.testing.assert_close(keys[rows, hs, ss].float(), expected.float(), rtol=rtol, atol=atol * scale)
    assert torch.equal(keys[~miss], before[~miss])  # hits untouched


def test_rebuild_keys_kernel_reads_a_shared_document_in_place():
    """Rows that share one document hold stride-0 factors and positions: the same keys as private copies."""
    torch.manual_seed(0)
    rope = llama3_rope()
    batch, heads, slots, chunks, c, dim, rank = 3, 8, 40, 64, 8, 128, 160
    a = (torch.randn(1, chunks * c, rank, device=CUDA) / rank**0.5).to(torch.bfloat16)
    b = torch.randn(1, rank, heads, dim, device=CUDA).to(torch.bfloat16)
    positions = torch.arange(chunks * c, device=CUDA)[None] + 7
    ids = torch.stack([torch.randperm(chunks, device=CUDA)[:slots] for _ in range(batch * heads)]).view(
        batch, heads, slots
    )
    miss = torch.rand(batch, heads, slots, device=CUDA) < 0.5
    shared = torch.zeros(batch, heads, slots, c, dim, device=CUDA, dtype=torch.bfloat16)
    private = shared.clone()
    expand = lambda t: t.expand(batch, *t.shape[1:])  # noqa: E731
    rebuild_missed_keys(shared, ids, miss, expand(a), expand(b), expand(positions), rope)
    rebuild_missed_keys(private, ids, miss, expand(a).contiguous(), expand(b).contiguous(),
                        expand(positions).contiguous(), rope)  # fmt: skip
    assert torch.equal(shared, private)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "dim, rank, c, rotary, interleaved",
    [(64, 20, 8, 48, False), (128, 160, 8, 128, False), (256, 33, 5, 256, False), (128, 96, 3, 64, True),
     (64, 16, 1, 0, False)],
)  # fmt: skip
# 48 x 8 = 384 (row, head)s: more than the grid's cap on a GPU of up to 192 SMs, so a block takes several.
@pytest.mark.parametrize("batch, heads, slots", [(1, 8, 256), (3, 2, 37), (48, 8, 16)])
def test_fused_rebuild_gives_the_gemm_paths_keys(dtype, dim, rank, c, rotary, interleaved, batch, heads, slots):
    """The fused kernel (A·B of the missed slots on tensor cores, RoPE from a shared tile) against the batched GEMM of
    every slot then `rope_missed`: the products differ only in the order of their fp32 sums before the one rounding,
    so nearly every element is equal and none is more than two units in the last place of the products apart."""
    gen = torch.Generator().manual_seed(dim + rank + c)
    chunks = slots + 5
    tc = chunks * c
    a = (torch.randn(batch, tc, rank, generator=gen) / rank**0.5).to(CUDA, dtype)
    b = torch.randn(batch, rank, heads, dim, generator=gen).to(CUDA, dtype)
    positions = (torch.arange(tc) * 7 + 50_000)[None].expand(batch, tc).contiguous().to(CUDA)
    ids = torch.stack([torch.randperm(chunks, generator=gen)[:slots] for _ in range(batch * heads)])
    ids = ids.view(batch, heads, slots).to(CUDA)
    ids[0, 0, 1] = -1  # an empty slot that misses reads chunk 0, as the twin does
    miss = (torch.rand(batch, heads, slots, generator=gen) < 0.4).to(CUDA)
    miss[0, 0, 1] = True
    inv_freq = (10000.0 ** -(torch.arange(0, rotary, 2) / max(rotary, 1))).float() if rotary else torch.zeros(1)
    inv_freq = inv_freq.to(CUDA)
    before = torch.randn(batch, heads, slots, c, dim, generator=gen).to(CUDA, dtype)
    fused, gemm = before.clone(), before.clone()
    rebuild_missed_op.rebuild_missed_op(fused, a, b, ids, miss, positions, inv_freq, 1.25, rotary, interleaved)
    pre = slot_products(ids, a, b, c)
    rebuild_keys_op.rope_missed_op(gemm, pre, ids, miss, positions, inv_freq, 1.25, rotary, interleaved)
    assert torch.equal(fused[~miss], before[~miss])  # hits untouched
    got, want = fused[miss].float(), gemm[miss].float()
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10) * pre.float().abs().amax().item()
    torch.testing.assert_close(got, want, rtol=0, atol=2 * ulp)
    assert got.eq(want).float().mean().item() > 0.9


def test_fused_rebuild_operator_refuses_what_its_kernel_cannot_read():
    """Mixed dtypes, a head size it is not compiled for, or a strided key buffer: an error naming the problem, not
    keys written from the wrong bytes or to the wrong places."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.zeros(2, 2, 4, 8, 64, device=CUDA, dtype=torch.bfloat16)
    a = torch.randn(2, 80, 16, generator=gen).to(CUDA, torch.bfloat16)
    b = torch.randn(2, 16, 2, 64, generator=gen).to(CUDA, torch.bfloat16)
    ids = torch.zeros(2, 2, 4, dtype=torch.int64, device=CUDA)
    miss = torch.ones(2, 2, 4, dtype=torch.bool, device=CUDA)
    positions = torch.arange(80, device=CUDA)[None].expand(2, -1)
    rest = (ids, miss, positions, torch.ones(32, device=CUDA), 1.0, 64, False)
    with pytest.raises(RuntimeError, match="share one dtype"):
        rebuild_missed_op.rebuild_missed_op(keys, a.half(), b, *rest)
    with pytest.raises(RuntimeError, match="head dims"):
        rebuild_missed_op.rebuild_missed_op(keys[..., :32], a, b[..., :32], *rest)
    with pytest.raises(RuntimeError, match="contiguous"):
        rebuild_missed_op.rebuild_missed_op(keys.transpose(0, 1), a, b, *rest)
    assert not keys.any()


def test_fused_rebuild_splits_a_heads_slots_over_blocks(monkeypatch):
    """At batch 1 a head's slots are split over several blocks (`_slots_per_block`): the same keys as one block per
    head."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, slots, chunks, c, dim, rank = 1, 8, 300, 900, 8, 128, 160
    a = (torch.randn(batch, chunks * c, rank, generator=gen) / rank**0.5).to(CUDA, torch.bfloat16)
    b = torch.randn(batch, rank, heads, dim, generator=gen).to(CUDA, torch.bfloat16)
    positions = torch.arange(chunks * c)[None].to(CUDA)
    ids = torch.stack([torch.randperm(chunks, generator=gen)[:slots] for _ in range(heads)]).view(1, heads, slots)
    ids, miss = ids.to(CUDA), (torch.rand(batch, heads, slots, generator=gen) < 0.5).to(CUDA)
    inv_freq = (10000.0 ** -(torch.arange(0, dim, 2) / dim)).float().to(CUDA)
    args = (a, b, ids, miss, positions, inv_freq, 1.0, dim, False)
    assert rebuild_missed_op._slots_per_block(CUDA, batch * heads, slots) < slots
    split = torch.zeros(batch, heads, slots, c, dim, device=CUDA, dtype=torch.bfloat16)
    rebuild_missed_op.rebuild_missed_op(split, *args)
    monkeypatch.setattr(rebuild_missed_op, "_FUSED_BLOCKS_PER_SM", 0)
    assert rebuild_missed_op._slots_per_block(CUDA, batch * heads, slots) == slots
    whole = torch.zeros_like(split)
    rebuild_missed_op.rebuild_missed_op(whole, *args)
    assert torch.equal(split, whole)
    # Factors that are not 16-byte aligned are read element by element: the same keys.
    a_odd = torch.empty(batch, chunks * c, rank + 1, device=CUDA, dtype=a.dtype)[..., 1:].copy_(a)
    b_odd = torch.empty(batch, rank, heads, dim + 1, device=CUDA, dtype=b.dtype)[..., 1:].copy_(b)
    assert not rebuild_missed_op._aligned_rows(a_odd, a_odd.stride()[:2], rank)
    scalar = torch.zeros_like(split)
    rebuild_missed_op.rebuild_missed_op(scalar, a_odd, b_odd, *args[2:])
    assert torch.equal(scalar, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rebuild_without_rope_writes_the_products_into_the_misses(dtype):
    """A layer without RoPE (`ModelRope.none()`, layout `rotary_dim = 0`): missed slots get `A·B` of their chunk, as
    the twin gives them, and hits keep what they held."""
    torch.manual_seed(0)
    batch, heads, slots, chunks, c, dim, rank = 2, 3, 13, 51, 8, 64, 24
    a = torch.randn(batch, chunks * c, rank, device=CUDA).to(dtype)
    b = torch.randn(batch, rank, heads, dim, device=CUDA).to(dtype)
    positions = torch.arange(chunks * c, device=CUDA)[None].expand(batch, -1).contiguous()
    ids = torch.stack([torch.randperm(chunks, device=CUDA)[:slots] for _ in range(batch * heads)])
    ids = ids.view(batch, heads, slots)
    miss = torch.rand(batch, heads, slots, device=CUDA) < 0.5
    before = torch.randn(batch, heads, slots, c, dim, device=CUDA).to(dtype)
    keys = before.clone()
    rebuild_missed_keys(keys, ids, miss, a, b, positions, ModelRope.none())
    rows, hs, ss = miss.nonzero(as_tuple=True)
    expected = rebuild_keys(a, b, positions, rows, hs, ids[rows, hs, ss], c, ModelRope.none())
    rtol, atol = TOLERANCE[dtype]
    scale = expected.float().abs().amax().item()
    torch.testing.assert_close(keys[rows, hs, ss].float(), expected.float(), rtol=rtol, atol=atol * scale)
    assert torch.equal(keys[~miss], before[~miss])


def gather_by_kernel_and_twin(store, heads, slots, chunks, c, dim, dtype, read_chunk_zero=False):
    """Random slots of 3 cache rows (`[3, heads, slots, c, dim]`, half of them missed) filled from `store` by the
    kernel and by the twin from the same start: `(got, ref, miss)`. `read_chunk_zero`: row 0, head 0, slot 0 misses
    and reads chunk 0."""
    ids = torch.randint(0, chunks, (3, heads, slots), device=CUDA)
    miss = torch.rand(3, heads, slots, device=CUDA) < 0.5
    if read_chunk_zero:
        ids[0, 0, 0], miss[0, 0, 0] = 0, True
    got = torch.randn(3, heads, slots, c, dim, device=CUDA).to(dtype)
    ref = got.clone()
    gather_values(got, ids, miss, store)
    gather_values_reference(ref, ids, miss, store)
    torch.cuda.synchronize()
    return got, ref, miss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "rows, heads, slots, chunks, c, dim", [(3, 8, 256, 311, 8, 128), (2, 3, 13, 51, 3, 5), (4, 2, 77, 77, 8, 64)]
)
def test_gather_values_kernel_matches_twin(dtype, rows, heads, slots, chunks, c, dim):
    data = torch.randn(rows, heads, chunks, c, dim).to(dtype)
    store = HostValueStore.offload(data.cuda(), pin=True).select_rows(torch.tensor([rows - 1, 0, rows - 1]))
    assert store.data.is_pinned()
    got, ref, _ = gather_by_kernel_and_twin(store, heads, slots, chunks, c, dim, dtype)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows, heads, slots, chunks, c, dim", [(3, 8, 256, 311, 8, 128), (2, 3, 13, 51, 3, 5), (4, 2, 77, 77, 8, 64)]
)
def test_gather_values_fp8_kernel_matches_twin(dtype, rows, heads, slots, chunks, c, dim):
    """The kernel decodes as `Fp8Codec.decode` (one fp32 product, one rounding): equal bit for bit."""
    data = torch.randn(rows, heads, chunks, c, dim) * torch.exp(torch.randn(rows, heads, chunks, c, 1) * 2)
    data[0, 0, 0] = 0
    store = HostValueStore.offload(data.to(dtype).cuda(), pin=True, value_format="fp8")
    store = store.select_rows(torch.tensor([rows - 1, 0, rows - 1]))
    assert store.data.is_pinned() and store.scales.is_pinned()
    got, ref, _ = gather_by_kernel_and_twin(store, heads, slots, chunks, c, dim, dtype, read_chunk_zero=True)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows, heads, slots, chunks, c, dim",
    # The warp kernel: (8, 128) one load per lane, (8, 64) half the lanes, (16, 128) and (8, 256) two loads per
    # lane, (3, 32) three lanes. The block kernel: (3, 16) (D < 32) and (16, 256) (c*D > 2048).
    [(3, 8, 256, 311, 8, 128), (2, 3, 13, 51, 3, 16), (4, 2, 77, 77, 8, 64), (2, 2, 40, 60, 16, 128),
     (2, 2, 40, 60, 8, 256), (2, 3, 21, 30, 3, 32), (2, 2, 9, 20, 16, 256)],
)  # fmt: skip
def test_gather_values_higgs4_kernel_matches_twin(dtype, rows, heads, slots, chunks, c, dim):
    """The kernel's Walsh-Hadamard transform sums in another order than the twin's matmul: equal to round-off."""
    data = torch.randn(rows, heads, chunks, c, dim) * torch.exp(torch.randn(rows, heads, chunks, c, 1) * 2)
    data[0, 0, 0] = 0
    store = HostValueStore.offload(data.to(dtype).cuda(), pin=True, value_format="higgs4")
    store = store.select_rows(torch.tensor([rows - 1, 0, rows - 1]))
    assert store.data.is_pinned() and store.scales.is_pinned()
    got, ref, miss = gather_by_kernel_and_twin(store, heads, slots, chunks, c, dim, dtype)
    assert torch.equal(got[~miss], ref[~miss])  # hits untouched
    # Per vector: off by float32 round-off of a D-term sum, then at most one step of the output dtype.
    scale = ref.float().abs().amax(-1, keepdim=True)
    eps = max(torch.finfo(dtype).eps, 1e-5)
    assert bool(((got.float() - ref.float()).abs() <= eps * scale).all())


@pytest.mark.parametrize("value_format", ["native", "higgs4"])
def test_gather_values_with_one_block_strides_over_every_slot(monkeypatch, value_format):
    """The native and higgs4 kernels stride over the slots: a grid of one block (forced) fetches them all."""
    import shadowkv_cache.ops.gather_values as module

    monkeypatch.setattr(module, "FETCH_BLOCKS_PER_SM", 1e-6)
    assert module._grid(CUDA, 10_000) == (1, 1, 1)
    data = torch.randn(2, 4, 50, 8, 128)
    store = HostValueStore.offload(data.to(torch.bfloat16).cuda(), pin=True, value_format=value_format)
    store = store.select_rows(torch.tensor([1, 0, 1]))
    got, ref, miss = gather_by_kernel_and_twin(store, 4, 64, 50, 8, 128, torch.bfloat16)
    assert miss.sum() > 100
    if value_format == "higgs4":
        scale = ref.float().abs().amax(-1, keepdim=True)
        assert bool(((got.float() - ref.float()).abs() <= torch.finfo(torch.bfloat16).eps * scale).all())
    else:
        assert torch.equal(got, ref)


def test_gather_values_higgs4_warp_kernel_finds_misses_after_long_runs_of_hits(monkeypatch):
    """With one block (4 warps), the warp kernel fetches a miss in the first slot, misses after long runs of hits and
    the last slot, and nothing else."""
    import shadowkv_cache.ops.gather_values as module

    monkeypatch.setattr(module, "FETCH_BLOCKS_PER_SM", 1e-6)
    data = torch.randn(2, 4, 50, 8, 128)
    store = HostValueStore.offload(data.to(torch.bfloat16).cuda(), pin=True, value_format="higgs4")
    store = store.select_rows(torch.tensor([1, 0, 1]))
    ids = torch.randint(0, 50, (3, 4, 64), device=CUDA)
    miss = torch.zeros(3, 4, 64, dtype=torch.bool, device=CUDA)
    miss.view(-1)[[0, 5, 700, 767]] = True  # of 768 slots
    got = torch.randn(3, 4, 64, 8, 128, device=CUDA).to(torch.bfloat16)
    ref = got.clone()
    gather_values(got, ids, miss, store)
    gather_values_reference(ref, ids, miss, store)
    assert torch.equal(got[~miss], ref[~miss])
    scale = ref.float().abs().amax(-1, keepdim=True)  # the missed slots hold the store's values, not their start
    assert bool(((got.float() - ref.float()).abs() <= torch.finfo(torch.bfloat16).eps * scale).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("c, dim", [(8, 128), (8, 64), (16, 128), (3, 32), (8, 256)])
def test_gather_values_higgs4_warp_kernel_gives_the_block_kernels_bits(monkeypatch, dtype, c, dim):
    """One warp per slot (registers and shuffles) and one block per slot (shared memory) pair the same butterflies in
    the same order and scale alike: the same bits."""
    import shadowkv_cache.ops.gather_values as module

    data = torch.randn(2, 3, 40, c, dim) * torch.exp(torch.randn(2, 3, 40, c, 1))
    store = HostValueStore.offload(data.to(dtype).cuda(), pin=True, value_format="higgs4")
    store = store.select_rows(torch.tensor([1, 0, 1]))
    torch.manual_seed(0)
    warp, _, miss = gather_by_kernel_and_twin(store, 3, 32, 40, c, dim, dtype)
    monkeypatch.setattr(module, "_warp_fits", lambda values, c, dim: False)
    torch.manual_seed(0)  # the same slots, misses and starting values
    block, _, miss_again = gather_by_kernel_and_twin(store, 3, 32, 40, c, dim, dtype)
    assert torch.equal(miss, miss_again) and miss.any()
    assert torch.equal(warp, block)


def landmark_logits_in(layout: str, batch: int, heads: int, group: int, chunks: int, dtype, gen) -> torch.Tensor:
    """`[B, Hkv, G, 1, C]` logits laid out as the landmark GEMMs leave them: `einsum` (contiguous), `padded` (the
    `[B, Hkv, C, 8k]` product of padded query rows, transposed), `shared` (one document's `[1, Hkv, C, 8k]` product
    for every row's queries), `chunk_major` (the int8 kernel's `[B, Hkv, C, G]`), or `strided` (every dim strided)."""
    data = lambda *shape: (torch.randn(*shape, generator=gen) * 4).to(dtype).to(CUDA)  # noqa: E731
    rows = -(-group // 8) * 8
    if layout == "einsum":
        return data(batch, heads, group, 1, chunks)
    if layout == "padded":
        return data(batch, heads, chunks, rows)[..., :group].transpose(-1, -2).reshape(batch, heads, group, 1, chunks)
    if layout == "shared":
        rows = -(-(batch * group) // 8) * 8
        product = data(1, heads, chunks, rows)[..., : batch * group].transpose(-1, -2)
        return product.reshape(heads, batch, group, chunks).transpose(0, 1).reshape(batch, heads, group, 1, chunks)
    if layout == "chunk_major":
        return data(batch, heads, chunks, group).transpose(-1, -2).unsqueeze(3)
    return data(chunks + 3, group + 1, heads, 2 * batch)[:chunks, :group, :, ::2].permute(3, 2, 1, 0)[:, :, :, None]


LANDMARK_LAYOUTS = ["einsum", "padded", "shared", "chunk_major", "strided"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", LANDMARK_LAYOUTS)
@pytest.mark.parametrize(
    "batch, heads, group, chunks", [(3, 8, 4, 5000), (2, 2, 1, 37), (1, 3, 7, 2049), (2, 1, 16, 300), (1, 8, 4, 16)]
)
@pytest.mark.parametrize("blocks_per_sm", [None, 0])
def test_landmark_scores_kernel_matches_twin(dtype, layout, batch, heads, group, chunks, blocks_per_sm, monkeypatch):
    """The softmax of each query head over the selectable chunks, max over the group, -inf elsewhere, read from the
    GEMM's output in place: equal to round-off (the sums run in another order), and the same top chunks; with each
    (row, head) split over as many blocks as the chunks allow (the default grid) and over one block (0)."""
    if blocks_per_sm is not None:
        monkeypatch.setattr(landmark_scores_op, "BLOCKS_PER_SM", blocks_per_sm)
    gen = torch.Generator().manual_seed(chunks + group)
    logits = landmark_logits_in(layout, batch, heads, group, chunks, dtype, gen)
    assert logits.shape == (batch, heads, group, 1, chunks)
    selectable = (torch.rand(batch, heads, chunks, generator=gen) < 0.7).to(CUDA)
    selectable[0, 0] = False  # a head with nothing selectable: every score -inf
    if layout == "shared":  # rows of one document share its mask
        selectable = selectable[:1].expand(batch, -1, -1)
    got = landmark_scores(logits, selectable)
    want = landmark_scores_reference(logits, selectable)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, chunks) and got.is_contiguous()
    assert torch.equal(got == float("-inf"), ~selectable)
    torch.testing.assert_close(got[selectable], want[selectable], rtol=1e-5, atol=1e-9)
    k = min(16, chunks)
    picked = got.topk(k, dim=-1).indices
    # The twin's scores of the kernel's picks are the twin's own top scores, up to the same round-off.
    torch.testing.assert_close(want.gather(-1, picked), want.topk(k, dim=-1).values, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("layout", ["einsum", "padded", "chunk_major"])
def test_landmark_scores_kernel_spreads_nan_and_skips_minus_infinity_as_the_twin(layout):
    """A NaN logit makes every selectable score of its KV head NaN, and -inf logits add nothing, in each load."""
    gen = torch.Generator().manual_seed(5)
    logits = landmark_logits_in(layout, 2, 4, 4, 3000, torch.bfloat16, gen)
    selectable = torch.ones(2, 4, 3000, dtype=torch.bool, device=CUDA)
    logits[0, 1, 2, 0, 1234] = float("nan")
    logits[1, :, :, 0, ::7] = float("-inf")
    logits[1, 3, 1, 0, :] = float("-inf")  # a query head whose logits are all -inf: its softmax is NaN in the twin
    logits[1, 3, 1, 0, 17] = 0.0  # ... unless one is finite
    got, want = landmark_scores(logits, selectable), landmark_scores_reference(logits, selectable)
    assert got[0, 1].isnan().all() and want[0, 1].isnan().all()
    finite = ~want.isnan()
    assert torch.equal(finite, ~got.isnan())
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("layout", ["einsum", "padded"])
def test_landmark_scores_kernel_keeps_a_nan_without_finite_neighbours_and_weighs_an_all_minus_inf_head_zero(layout):
    """A NaN that is the only logit its thread holds still spreads over the head (the state merges add sums whose max
    is -inf); a query head whose selectable logits are all -inf weighs 0, as in the twin where some chunk is not
    selectable, and NaN where one of them is NaN; +inf gives NaN in both."""
    gen = torch.Generator().manual_seed(7)
    logits = landmark_logits_in(layout, 4, 2, 2, 64, torch.float16, gen)
    selectable = torch.ones(4, 2, 64, dtype=torch.bool, device=CUDA)
    logits[0, 0, :, 0, :] = float("-inf")
    logits[0, 0, 1, 0, 5] = float("nan")  # row 0, head 0: one NaN among -inf
    logits[1, 1, 1, 0, :] = float("-inf")  # row 1, head 1: query head 1 all -inf ...
    selectable[1, 1, 0] = False  # ... with a chunk not selectable
    logits[2, 0, 0, 0, 40] = float("inf")
    small = torch.randn(4, 2, 1, 1, 16, generator=gen).to(CUDA)
    small[3, 1, 0, 0, 9] = float("nan")  # one NaN in 16 chunks: one chunk per thread
    for case in ((logits, selectable), (small, torch.ones(4, 2, 16, dtype=torch.bool, device=CUDA))):
        got, want = landmark_scores(*case), landmark_scores_reference(*case)
        finite = ~want.isnan()
        assert torch.equal(finite, ~got.isnan())
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-9)
        assert want.isnan().any()
    assert landmark_scores(small, torch.ones(4, 2, 16, dtype=torch.bool, device=CUDA))[3, 1].isnan().all()


def test_landmark_scores_operator_refuses_what_its_kernels_cannot_read():
    """More than 16 query heads per KV head, a strided mask or an integer dtype: an error naming the problem, not
    reads past the kernels' shared memory."""
    logits = torch.zeros(2, 2, 17, 1, 50, device=CUDA, dtype=torch.bfloat16)
    selectable = torch.ones(2, 2, 100, dtype=torch.bool, device=CUDA)
    with pytest.raises(RuntimeError, match="17 query heads"):
        landmark_scores_op.landmark_scores_op(logits, selectable[..., :50])
    with pytest.raises(RuntimeError, match="contiguous chunks"):
        landmark_scores_op.landmark_scores_op(logits[:, :, :4], selectable[..., ::2])
    with pytest.raises(RuntimeError, match="dtype"):
        landmark_scores_op.landmark_scores_op(logits[:, :, :4].int(), selectable[..., :50])


def test_landmark_scores_cases_cover_every_load_and_grid():
    """The cases above reach each of the kernel's loads (16- and 8-byte vectors of a chunk's logits, one load per
    logit) and both grids (one block per (row, head), several)."""
    gen = torch.Generator().manual_seed(0)
    modes = {
        landmark_scores_op._vector_bytes(landmark_logits_in(layout, 2, 2, group, 64, dtype, gen))
        for layout in LANDMARK_LAYOUTS
        for group in (1, 4, 7, 16)
        for dtype in (torch.bfloat16, torch.float32)
    }
    assert modes == {0, 8, 16}
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    assert landmark_scores_op._splits(3, 8, 5000, sms) > 1 and landmark_scores_op._splits(1, 8, 16, sms) == 1


def test_landmark_scores_kernel_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(0)
    logits = landmark_logits_in("padded", 4, 8, 4, 1000, torch.bfloat16, gen)
    selectable = (torch.rand(4, 8, 1000, generator=gen) < 0.5).to(CUDA)
    landmark_scores(logits, selectable)  # compiled and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = landmark_scores(logits, selectable)
    logits.copy_(landmark_logits_in("padded", 4, 8, 4, 1000, torch.bfloat16, gen))
    graph.replay()
    torch.cuda.synchronize()
    want = landmark_scores_reference(logits, selectable)
    torch.testing.assert_close(out[selectable], want[selectable], rtol=1e-5, atol=1e-9)


def topk_scores(rows, n, kind, gen):
    """`[rows, n]` fp32 scores: softmax-like probabilities (clustered top bits), heavy ties, or mostly -inf with a NaN
    and signed zeros."""
    if kind == "probs":
        return torch.softmax(torch.randn(rows, n, generator=gen) * 3, dim=-1)
    if kind == "ties":
        return (torch.randn(rows, n, generator=gen) * 2).round() / 2
    scores = torch.randn(rows, n, generator=gen)
    scores[torch.rand(rows, n, generator=gen) < 0.9] = float("-inf")
    scores[0, n // 2] = float("nan")
    if n > 1:
        scores[-1, :2] = torch.tensor([-0.0, 0.0])
    return scores


@pytest.mark.parametrize(
    "rows, n, k",
    [
        (8, 16376, 256),
        (352, 16376, 256),
        (3, 5, 5),
        (2, 3000, 2048),
        (5, 1, 1),
        (40, 1024, 1),
        # The split kernels: rows past one block's registers (YAKV's tokens at 128K, at batch 1 and 8), k past 2048,
        # k == N (a bin past the buffer: the row read again), more rows than the grid needs parts for (one part per
        # row), a row of 2^20 scores over many parts, and k below the sort's least width (64 keys, a warp's).
        (1, 70001, 777),
        (4, 70001, 5),
        (8, 131072, 4096),
        (64, 131072, 4096),
        (3, 40000, 5000),
        (2, 3000, 2049),
        (1, 16384, 16384),
        (600, 20000, 100),
        (1, 1 << 20, 64),
    ],
)
@pytest.mark.parametrize("kind", ["probs", "ties", "masked"])
def test_select_topk_kernel_matches_twin(rows, n, k, kind):
    """The same indices in the same order as the stable descending sort, ties by index included."""
    scores = topk_scores(rows, n, kind, torch.Generator().manual_seed(rows + n + k)).to(CUDA)
    got = select_topk(scores, k)
    assert torch.equal(got.cpu(), select_topk_reference(scores.cpu(), k))


def test_select_topk_kernel_reads_rows_of_a_strided_view_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(1)
    scores = topk_scores(4 * 8, 1001, "ties", gen).view(4, 8, 1001).to(CUDA)
    view = scores.transpose(0, 1)  # rows no longer in memory order
    assert torch.equal(select_topk(view, 100).cpu(), select_topk_reference(view.cpu(), 100))
    padded = torch.zeros(4, 8, 1100, device=CUDA)[..., :1001].copy_(scores)  # row stride 1100
    assert torch.equal(select_topk(padded, 100), select_topk(scores, 100))


def test_select_topk_kernel_replays_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(2)
    scores = topk_scores(16, 4000, "probs", gen).to(CUDA)
    select_topk(scores, 300)  # compiled and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_topk(scores, 300)
    scores.copy_(topk_scores(16, 4000, "ties", gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), select_topk_reference(scores.cpu(), 300))


def test_select_topk_split_kernels_replay_in_a_cuda_graph():
    """Long rows: the histogram, filter and finish launches, their zeroed workspace and buffers replay with new
    scores."""
    gen = torch.Generator().manual_seed(3)
    scores = topk_scores(16, 50000, "probs", gen).to(CUDA)
    select_topk(scores, 3000)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_topk(scores, 3000)
    for kind in ("ties", "masked"):
        scores.copy_(topk_scores(16, 50000, kind, gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), select_topk_reference(scores.cpu(), 3000))


def int8_landmark_case(batch, heads, group, chunks, dim, dtype, shared, seed):
    """int8 landmarks of varied sizes (a zero landmark first: a padding chunk) and a strided query `[B, Hkv, G, 1, D]`
    whose heads span many orders of magnitude (bf16: 1e-6 to 1e6, beyond fp16's range; fp16: 1e-3 to 1e2)."""
    gen = torch.Generator().manual_seed(seed)
    landmarks = torch.randn(1 if shared else batch, heads, chunks, dim, generator=gen)
    landmarks = landmarks * torch.exp(2 * torch.randn(*landmarks.shape[:-1], 1, generator=gen))
    landmarks[:, :, 0] = 0
    codes, scales = quantize_landmarks(landmarks)
    query = torch.randn(batch, heads, group + 1, 1, dim, generator=gen)[:, :, :group]  # strided over the group
    wide = (-6.0, 6.0) if dtype == torch.bfloat16 else (-3.0, 2.0)
    exponent = torch.empty(batch, heads, group, 1, 1).uniform_(*wide, generator=gen)
    query = (query * 10**exponent).to(dtype)
    return query.to(CUDA), codes.to(CUDA), scales.to(CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize(
    "batch, heads, group, chunks, shared",
    [(3, 8, 4, 5000, False), (2, 2, 1, 37, False), (1, 3, 7, 2049, False), (4, 2, 8, 300, True), (2, 1, 4, 5, False)],
)
def test_landmark_logits_int8_kernel_matches_twin(dtype, dim, batch, heads, group, chunks, shared):
    """Exact products, fp32 sums in another order, then the query dtype's rounding: within one rounding of the
    exact logits (fp64) plus fp32's summation error, and as close to the twin."""
    query, codes, scales = int8_landmark_case(batch, heads, group, chunks, dim, dtype, shared, chunks + dim + group)
    assert op_fits(query, codes, scales)
    got = landmark_logits_int8(query, codes, scales)
    want = landmark_logits_int8_reference(query, codes, scales)
    assert got.shape == want.shape == (batch, heads, group, 1, chunks) and got.dtype == dtype
    landmarks = codes.double() * scales.double()[..., None]
    exact = torch.matmul(query.double().squeeze(3), landmarks.transpose(-1, -2)).unsqueeze(3)
    spread = torch.matmul(query.double().abs().squeeze(3), landmarks.abs().transpose(-1, -2)).unsqueeze(3)
    bound = torch.finfo(dtype).eps * exact.abs() + 1e-6 * spread + torch.finfo(dtype).tiny
    # fp16 logits of these wide queries overflow: both give inf of the exact sign there (as an fp16 GEMM would).
    inside = exact.abs() <= 0.99 * torch.finfo(dtype).max
    beyond = exact.abs() >= 1.01 * torch.finfo(dtype).max
    for logits in (got, want):
        assert bool(((logits.double() - exact).abs() <= bound)[inside].all())
        assert bool((logits.double()[beyond] == exact[beyond].sign() * float("inf")).all())
    assert bool((got[:, :, :, :, 0] == 0).all())  # the zero landmark
    assert bool(((got.double() - want.double()).abs() <= 2 * bound)[inside].all())


def op_fits(query, codes, scales) -> bool:
    from shadowkv_cache.ops import landmark_logits

    return landmark_logits._kernel_fits(query, codes, scales)


def test_landmark_logits_int8_kernel_reads_stride_0_rows_of_one_document():
    """Rows that share a loaded document hold stride-0 views of its codes and scales (shape[0] = B, stride 0)."""
    query, codes, scales = int8_landmark_case(3, 8, 4, 1000, 128, torch.bfloat16, True, 5)
    expanded = codes.expand(3, -1, -1, -1), scales.expand(3, -1, -1)
    assert op_fits(query, *expanded)
    got = landmark_logits_int8(query, *expanded)
    want = landmark_logits_int8(query, codes, scales)  # the one copy, batch 1 against 3 queries
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), landmark_logits_int8_reference(query, codes, scales).float(), rtol=1e-2,
                               atol=1e-3)  # fmt: skip


def test_landmark_logits_int8_kernel_replays_in_a_cuda_graph():
    query, codes, scales = int8_landmark_case(4, 8, 4, 3000, 128, torch.bfloat16, False, 0)
    landmark_logits_int8(query, codes, scales)  # compiled and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = landmark_logits_int8(query, codes, scales)
    query.copy_(int8_landmark_case(4, 8, 4, 3000, 128, torch.bfloat16, False, 1)[0])
    graph.replay()
    torch.cuda.synchronize()
    want = landmark_logits_int8_reference(query, codes, scales)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-3)


def native_landmark_case(batch, heads, group, chunks, dim, dtype, shared, seed):
    """16-bit landmarks of varied sizes (a zero landmark first: a padding chunk) and a strided query
    `[B, Hkv, G, 1, D]` of the same dtype, whose heads span a few orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    landmarks = torch.randn(1 if shared else batch, heads, chunks, dim, generator=gen)
    landmarks = landmarks * torch.exp(torch.randn(*landmarks.shape[:-1], 1, generator=gen))
    landmarks[:, :, 0] = 0
    query = torch.randn(batch, heads, group + 1, 1, dim, generator=gen)[:, :, :group]  # strided over the group
    exponent = torch.empty(batch, heads, group, 1, 1).uniform_(-2.0, 1.0, generator=gen)
    return (query * 10**exponent).to(dtype).to(CUDA), landmarks.to(dtype).to(CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize(
    "batch, heads, group, chunks, shared",
    [(3, 8, 4, 5000, False), (2, 2, 1, 37, False), (1, 3, 7, 2049, False), (4, 2, 8, 300, True), (2, 1, 4, 5, False),
     (1, 8, 4, 16380, False)],
)  # fmt: skip
def test_landmark_logits_native_kernel_matches_twin(dtype, dim, batch, heads, group, chunks, shared):
    """Exact products of 16-bit operands, fp32 sums in another order, then the dtype's rounding: within one rounding
    of the exact logits (fp64) plus fp32's summation error, and as close to the twin."""
    query, landmarks = native_landmark_case(batch, heads, group, chunks, dim, dtype, shared, chunks + dim + group)
    assert native_kernel_fits(query, landmarks, max_rows=None)
    got = landmark_logits_native(query, landmarks)
    want = landmark_logits_native_reference(query, landmarks)
    assert got.shape == want.shape == (batch, heads, group, 1, chunks) and got.dtype == dtype
    exact = torch.matmul(query.double().squeeze(3), landmarks.double().transpose(-1, -2)).unsqueeze(3)
    spread = torch.matmul(query.double().abs().squeeze(3), landmarks.double().abs().transpose(-1, -2)).unsqueeze(3)
    bound = torch.finfo(dtype).eps * exact.abs() + 1e-6 * spread + torch.finfo(dtype).tiny
    for logits in (got, want):
        assert bool(((logits.double() - exact).abs() <= bound).all())
    assert bool((got[:, :, :, :, 0] == 0).all())  # the zero landmark
    assert bool(((got.double() - want.double()).abs() <= 2 * bound).all())


def test_landmark_logits_native_kernel_reads_stride_0_rows_and_replays_in_a_cuda_graph():
    """Rows that share a loaded document hold stride-0 views of its landmarks; the kernel reads the one copy, and a
    captured launch reads the query it is replayed with."""
    query, landmarks = native_landmark_case(3, 8, 4, 1000, 128, torch.bfloat16, True, 5)
    expanded = landmarks.expand(3, -1, -1, -1)
    torch.testing.assert_close(landmark_logits_native(query, expanded), landmark_logits_native(query, landmarks),
                               rtol=0, atol=0)  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = landmark_logits_native(query, expanded)
    query.copy_(native_landmark_case(3, 8, 4, 1000, 128, torch.bfloat16, True, 6)[0])
    graph.replay()
    torch.cuda.synchronize()
    want = landmark_logits_native_reference(query, landmarks)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_native_landmark_scores_through_the_kernel_are_cublas_scores(batch):
    """`LandmarkTopK` takes the kernel up to `NATIVE_KERNEL_MAX_ROWS` rows (any, by default) and cuBLAS above: the
    masked scores of either path agree within the logits' bf16 rounding."""
    module = landmark_logits_module
    query = torch.randn(batch, 32, 1, 128, device=CUDA, dtype=torch.bfloat16)
    landmarks = torch.randn(batch, 8, 4000, 128, device=CUDA, dtype=torch.bfloat16) * 0.3
    selectable = torch.rand(batch, 8, 4000, device=CUDA) < 0.95
    policy, state = LandmarkTopK(), {"landmarks": landmarks}
    grouped = query.view(batch, 8, 4, 1, 128)
    assert native_kernel_fits(grouped, landmarks)
    got = policy.masked_scores(query, state, selectable, 0.088)
    saved = module.NATIVE_KERNEL_MAX_ROWS
    try:
        module.NATIVE_KERNEL_MAX_ROWS = 0  # cuBLAS
        assert not module.native_kernel_fits(grouped, landmarks)
        want = policy.masked_scores(query, state, selectable, 0.088)
    finally:
        module.NATIVE_KERNEL_MAX_ROWS = saved
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-7)


def test_int8_landmarks_through_the_kernel_score_as_the_twin_and_change_nothing_at_full_budget(monkeypatch):
    """A bf16 model whose head dim the kernel serves (64, GQA 2): the selection scores through the kernel equal the
    twin's, and at full budget (every chunk selected) generate gives the tokens and logits of native landmarks."""
    from helpers import full_budget_overrides, generate_with

    model = make_tiny_model("llama", head_dim=64).to(CUDA, torch.bfloat16)
    ids = random_prompt(301).to(CUDA)
    policy = LandmarkTopK("int8")
    cache = ShadowKVCache(model, policy=policy, **small_budget_overrides())
    forward_with(model, ids, cache)
    state, selectable = cache.layers[0].prompt.policy_state, cache.layers[0].prompt.selectable
    query = torch.randn(1, model.config.num_attention_heads, 1, 64, device=CUDA, dtype=torch.bfloat16)
    assert op_fits(query.view(1, model.config.num_key_value_heads, -1, 1, 64), state["landmark_codes"],
                   state["landmark_scales"])  # fmt: skip
    got = policy.masked_scores(query, state, selectable, 0.125)
    monkeypatch.setenv("SHADOWKV_KERNELS", "0")
    want = policy.masked_scores(query, state, selectable, 0.125)
    monkeypatch.delenv("SHADOWKV_KERNELS")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-6)
    full = full_budget_overrides(rank=model.config.num_key_value_heads * 64)
    runs = {}
    for fmt in ("native", "int8"):
        cache = ShadowKVCache(model, policy=LandmarkTopK(fmt), **full)
        runs[fmt] = generate_with(model, ids, cache, max_new_tokens=12)
        assert cache.step_graphs.replays > 0 or not cache.config.cuda_graphs
    assert torch.equal(runs["int8"].sequences, runs["native"].sequences)
    assert torch.equal(torch.stack(runs["int8"].logits), torch.stack(runs["native"].logits))


def compressed_cuda_cache(arch="llama", dtype=torch.float32, **changes):
    model = make_tiny_model(arch).to(CUDA, dtype)
    cache = ShadowKVCache(model, **small_budget_overrides(**changes))
    forward_with(model, random_prompt(301).to(CUDA), cache)
    return model, cache


@pytest.mark.parametrize("mode, value_format", [("shadowkv", "native"), ("shadowkv", "fp8"), ("shadowkv", "higgs4"),
                                                ("yakv", None)])  # fmt: skip
def test_decode_step_does_not_synchronise_with_the_host(mode, value_format):
    if mode == "yakv":  # scores from the device codes, gathers the selected records from pinned memory in place
        model = make_tiny_model("llama").to(CUDA)
        cache = ShadowKVCache(model, mode="yakv", sparse_budget=24, min_compress_len=64)
        forward_with(model, random_prompt(301).to(CUDA), cache)
    else:
        model, cache = compressed_cuda_cache(value_format=value_format)
    layer = cache.layers[0]
    assert layer.is_compressed
    heads, dim = model.config.num_attention_heads, model.config.head_dim
    kv_heads = model.config.num_key_value_heads
    for _ in range(3):
        query = torch.randn(1, heads, 1, dim, device=CUDA)
        k, v = torch.randn(2, 1, kv_heads, 1, dim, device=CUDA)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer.update(k, v)
            out = layer.sparse_attention(query, None, dim**-0.5)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert out.shape == (1, 1, heads, dim) and torch.isfinite(out).all()
    if mode == "yakv":
        assert layer.mode.sparse_steps == 3 and layer.prompt.store.data.is_pinned()
        assert layer.hit_counts()[1] == 3 * 24 * kv_heads  # the held tokens were scanned and refreshed
    else:
        assert int(layer.mode.temporal.lookups) > 0


@pytest.mark.parametrize("value_format", ["native", "fp8", "higgs4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kernel_path_matches_twin_path_end_to_end(arch, value_format, monkeypatch):
    from helpers import generate_with

    ids = random_prompt(301).to(CUDA)
    model = make_tiny_model(arch).to(CUDA)
    overrides = small_budget_overrides(value_format=value_format)
    with_kernels = generate_with(model, ids, ShadowKVCache(model, **overrides))
    monkeypatch.setenv("SHADOWKV_KERNELS", "0")
    twins = generate_with(model, ids, ShadowKVCache(model, **overrides))
    assert torch.equal(with_kernels.sequences, twins.sequences)
    torch.testing.assert_close(torch.stack(with_kernels.logits), torch.stack(twins.logits), rtol=1e-4, atol=1e-4)


def random_parts(batch, heads, dim, sizes, dtype, seed, shared=(), per_head=()):
    """Parts as a compressed layer hands them over: keys and values `[B or 1, Hkv, N_i, D]` (rows of part i in
    `shared` are one stride-0 copy), validity `[B, 1, 1, N_i]` or per head `[B, Hkv, 1, N_i]` (i in `per_head`).
    The last part's first slot is valid in every row, as the step's own token is."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i, n in enumerate(sizes):
        rows = 1 if i in shared else batch
        keys, values = torch.randn(2, rows, heads, n, dim, generator=g).to(CUDA, dtype)
        if i in shared:
            keys, values = keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1)
        valid = torch.rand(batch, heads if i in per_head else 1, 1, n, generator=g) < 0.7
        if i == len(sizes) - 1 and n:
            valid[..., 0] = True
        parts.append((keys, values, valid.to(CUDA)))
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch, heads, group, dim, sizes",
    [
        (1, 1, 1, 128, (1,)),  # one slot
        (2, 2, 2, 16, (16, 40, 8, 256)),  # the tiny test models' shape
        (3, 8, 4, 128, (64, 2048, 64, 256)),  # Llama-3.1-8B at ShadowKV's defaults
        (2, 3, 3, 64, (0, 700, 33, 300)),  # SmolLM2: 3 query heads per KV head; an empty part
        (1, 4, 8, 256, (63, 65, 129)),  # 8 query heads per KV head, the largest head size
        (5, 2, 7, 128, (5000, 17)),  # many splits
    ],
)
def test_attend_parts_kernel_matches_twin(dtype, batch, heads, group, dim, sizes):
    from shadowkv_cache.ops.attend_parts import attend_parts, attend_parts_reference, kernel_fits

    for seed in range(2):
        parts = random_parts(batch, heads, dim, sizes, dtype, seed, shared={0}, per_head={1})
        query = torch.randn(batch, heads * group, 1, dim, generator=torch.Generator().manual_seed(seed)).to(CUDA, dtype)
        scaling = dim**-0.5
        # A vector of at most 32 16-byte units: float32 at head size 256 runs the twin.
        assert kernel_fits(query, parts, NO_TERMS) == (dim * query.element_size() <= 512)
        got = attend_parts(query, parts, scaling)
        # The definition in float32 on the same inputs: the kernel accumulates in float32 and rounds once.
        ref = attend_parts_reference(query.float(), [(k.float(), v.float(), m) for k, v, m in parts], scaling)
        assert got.shape == ref.shape == (batch, 1, heads * group, dim) and got.dtype == dtype
        tol = 2e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_parts_kernel_applies_the_models_logit_terms(dtype):
    from shadowkv_cache.ops.attend_parts import attend_parts, attend_parts_reference

    batch, heads, group, dim = 2, 2, 4, 64
    parts = random_parts(batch, heads, dim, (32, 300, 7), dtype, seed=3, per_head={1})
    query = 3 * torch.randn(batch, heads * group, 1, dim, generator=torch.Generator().manual_seed(3)).to(CUDA, dtype)
    fp32 = [(k.float(), v.float(), m) for k, v, m in parts]
    for terms in (
        LogitTerms(softcap=5.0),
        LogitTerms(sinks=torch.linspace(-2, 4, heads * group, device=CUDA, dtype=dtype)),
        LogitTerms(softcap=3.0, sinks=torch.zeros(heads * group, device=CUDA)),
    ):
        got = attend_parts(query, parts, 0.125, terms)
        ref = attend_parts_reference(query.float(), fp32, 0.125, terms)
        tol = 2e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


def test_attend_parts_kernel_never_reads_invalid_slots():
    """Invalid slots (empty selection slots, free token-buffer slots) may hold anything: NaN there changes nothing."""
    from shadowkv_cache.ops.attend_parts import attend_parts

    parts = random_parts(3, 2, 128, (64, 512, 64, 256), torch.bfloat16, seed=5, per_head={1})
    query = torch.randn(3, 8, 1, 128, device=CUDA, dtype=torch.bfloat16)
    clean = attend_parts(query, parts, 0.1)
    poisoned = []
    for keys, values, valid in parts:
        keys, values = keys.clone(), values.clone()
        invalid = ~valid.expand(keys.shape[0], keys.shape[1], 1, -1)[:, :, 0]
        keys[invalid], values[invalid] = float("nan"), float("nan")
        poisoned.append((keys, values, valid))
    assert torch.equal(attend_parts(query, poisoned, 0.1), clean)


def test_attend_parts_kernel_in_a_cuda_graph():
    """Captured once, replayed over new values in the same tensors: the split and merge read nothing from the host."""
    from shadowkv_cache.ops.attend_parts import attend_parts

    parts = random_parts(2, 8, 128, (64, 1024, 64, 256), torch.bfloat16, seed=6, per_head={1})
    query = torch.randn(2, 32, 1, 128, device=CUDA, dtype=torch.bfloat16)
    attend_parts(query, parts, 0.1)  # loads the kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_parts(query, parts, 0.1)
    for seed in range(3):
        fresh = random_parts(2, 8, 128, (64, 1024, 64, 256), torch.bfloat16, seed=10 + seed, per_head={1})
        for (k, v, m), (k2, v2, m2) in zip(parts, fresh):
            k.copy_(k2), v.copy_(v2), m.copy_(m2)
        query.normal_()
        graph.replay()
        assert torch.equal(out, attend_parts(query, parts, 0.1))


def test_higgs4_values_encode_on_cuda_as_the_quantiser_defines():
    """ShadowKV's higgs4 value store encodes through the fused quantiser kernel on CUDA: the quantiser's codes and
    norms, a code differing only at a tie of two grid points to round-off."""
    from shadowkv_cache.stores.value_store import HostValueStore

    values = torch.randn(2, 3, 40, 8, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cpu = HostValueStore.offload(values, pin=False, value_format="higgs4")
    gpu = HostValueStore.offload(values.to(CUDA), pin=True, value_format="higgs4")
    assert gpu.data.is_pinned() and gpu.data.shape == cpu.data.shape
    assert (gpu.data != cpu.data).float().mean() < 1e-3
    torch.testing.assert_close(gpu.scales.float(), cpu.scales.float(), rtol=1e-3, atol=0)


def test_key_spectrum_of_16_bit_keys_on_cuda_is_the_fp32_spectrum():
    """The Gram product of bf16 keys on tensor cores (fp32 sums and result) gives the fp32 product's spectrum."""
    from shadowkv_cache.core.low_rank import key_spectrum

    keys = (torch.randn(4096, 256) @ torch.randn(256, 256) * 0.1).to(torch.bfloat16)
    want_vals, want_vecs = key_spectrum(keys)
    got_vals, got_vecs = key_spectrum(keys.to(CUDA))
    torch.testing.assert_close(got_vals.cpu(), want_vals, rtol=1e-4, atol=1e-3 * float(want_vals[0]) * 1e-3)
    top = 32  # well separated: the same directions up to sign
    agreement = (got_vecs[:, :top].cpu() * want_vecs[:, :top]).sum(0).abs()
    assert bool((agreement > 0.999).all())
