"""Exactness invariant (design.md §6): full budget + full rank gives the logits and greedy tokens of `DynamicCache`.

Each test also checks that the ShadowKV machinery really ran (layers compressed, chunks selected, misses
rebuilt from the low-rank factors and fetched from the host store), so that "equal to DynamicCache" cannot
come from a cache that silently stayed exact.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import (
    ARCHS,
    assert_logits_close,
    dynamic_cache,
    full_budget_overrides,
    generate_with,
    random_prompt,
    tiny_model,
)

from shadowkv_cache import ShadowKVCache

NEW_TOKENS = 16


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


@pytest.fixture
def rebuilt_chunks(monkeypatch):
    """Counts the chunks whose keys `TemporalCache.refresh` rebuilt from `A·B` + RoPE (the CPU twin)."""
    counter = {"chunks": 0, "calls": 0}
    rebuild_module = importlib.import_module("shadowkv_cache.ops.rebuild_keys")
    original = rebuild_module.rebuild_keys

    def counting(a, b, positions, rows, heads, chunks, *args, **kwargs):
        counter["chunks"] += chunks.numel()
        counter["calls"] += 1
        return original(a, b, positions, rows, heads, chunks, *args, **kwargs)

    monkeypatch.setattr(rebuild_module, "rebuild_keys", counting)
    return counter


def assert_same_generation(out, ref) -> None:
    assert torch.equal(out.sequences, ref.sequences), (
        out.sequences[:, -NEW_TOKENS:],
        ref.sequences[:, -NEW_TOKENS:],
    )
    assert_logits_close(out.logits, ref.logits)


def assert_full_selection_ran(cache: ShadowKVCache, decode_steps: int, batch: int = 1) -> int:
    """Every layer compressed; every step selected every selectable chunk; only the first step missed.

    Returns the chunks missed (and so rebuilt) over all layers.
    """
    missed = 0
    for i, layer in enumerate(cache.layers):
        assert layer.is_compressed, f"layer {i} was not compressed"
        prompt, temporal = layer.prompt, layer.mode.temporal
        selectable = prompt.selectable  # [B, Hkv, C]
        per_step = int(selectable.sum())
        assert per_step > 0, "nothing selectable: the test would not exercise selection"
        # Full budget: the selection is every selectable chunk, no more, no padding slot.
        for row in range(batch):
            for head in range(selectable.shape[1]):
                ids = temporal.ids[row, head]
                chosen = sorted(ids[ids >= 0].tolist())
                assert chosen == selectable[row, head].nonzero().flatten().tolist()
        lookups, hits = int(temporal.lookups), int(temporal.hits)
        assert lookups == decode_steps * per_step
        # The first sparse step found an empty temporal cache (all misses, rebuilt); later steps all hit.
        assert lookups > hits
        assert lookups - hits == per_step
        missed += lookups - hits
    return missed


@pytest.mark.parametrize("length", [300, 301])  # 301: ragged, not a multiple of the chunk size
def test_full_budget_matches_dynamic_cache(model, length, rebuilt_chunks):
    ids = random_prompt(length, seed=length)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(model, **full_budget_overrides())
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)

    assert_same_generation(out, ref)
    missed = assert_full_selection_ran(cache, decode_steps=NEW_TOKENS - 1)
    assert rebuilt_chunks["chunks"] == missed  # every miss went through the low-rank rebuild
    for layer in cache.layers:
        # Every prompt token is either compressed in whole chunks or in the local window.
        chunk_tokens = layer.prompt.positions.shape[1]
        local = int(layer.prompt.local_valid.sum())
        assert chunk_tokens + local == length
        assert chunk_tokens % 8 == 0 and local >= 16
    assert cache.get_seq_length() == length + NEW_TOKENS - 1


@pytest.mark.parametrize(
    "changes",
    [
        {"rank": 1.0},  # a float rank of 1.0 is the full key dimension
        {"local_window": 0},  # the ragged tail alone stays exact
        {"chunk_size": 5},
        {"outlier_chunks": 0},
    ],
    ids=lambda c: next(iter(c)),
)
def test_full_budget_variants(changes):
    model = tiny_model("llama")
    ids = random_prompt(301, seed=7)
    ref = generate_with(model, ids, dynamic_cache(model))
    cache = ShadowKVCache(model, **full_budget_overrides(**changes))
    out = generate_with(model, ids, cache)
    assert_same_generation(out, ref)
    assert_full_selection_ran(cache, decode_steps=NEW_TOKENS - 1)


@pytest.mark.parametrize(
    "length, changes",
    [
        (200, {"outlier_chunks": 10**6, "sparse_budget": 64}),
        # The defaults at a 64-token prompt: 4 chunks and the default floor of 4 outliers.
        (64, {"rank": None, "sparse_budget": None, "outlier_chunks": None, "local_window": 32}),
    ],
    ids=["more-outliers-than-chunks", "defaults-at-64-tokens"],
)
def test_all_chunks_outliers_is_exact(length, changes):
    """Every chunk is an outlier: nothing is selectable, the budget clamps to 0 and nothing raises ."""
    model = tiny_model("llama")
    ids = random_prompt(length, seed=8)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=8)
    cache = ShadowKVCache(model, **full_budget_overrides(**changes))
    out = generate_with(model, ids, cache, max_new_tokens=8)
    assert_same_generation(out, ref)
    for layer in cache.layers:
        assert layer.is_compressed
        assert not layer.prompt.selectable.any()
        assert int(layer.prompt.budget_chunks.max()) == 0


def test_new_turn_after_compression_matches_dynamic_cache(model):
    """A second `generate` appends a multi-token chat turn: a `q_len > 1` step over the compressed prompt."""
    ids = random_prompt(300, seed=3)
    turn = random_prompt(7, seed=4)
    caches = {"dynamic": dynamic_cache(model), "shadowkv": ShadowKVCache(model, **full_budget_overrides())}
    results = {}
    for name, cache in caches.items():
        first = generate_with(model, ids, cache, max_new_tokens=6)
        second = generate_with(model, torch.cat([first.sequences, turn], dim=1), cache, max_new_tokens=10)
        results[name] = (first, second)

    for out, ref in zip(results["shadowkv"], results["dynamic"]):
        assert torch.equal(out.sequences, ref.sequences)
        assert_logits_close(out.logits, ref.logits)
    cache = caches["shadowkv"]
    assert all(layer.is_compressed for layer in cache.layers)
    # The prompt stayed compressed; the new turn and the generated tokens are held exactly after it.
    assert all(layer.prompt.slots == 300 for layer in cache.layers)
    assert cache.get_seq_length() == caches["dynamic"].get_seq_length() == 300 + 6 + 7 + 10 - 1


@pytest.mark.parametrize("dense", [True, False])
def test_new_turn_reads_the_whole_prompt_at_a_small_budget(model, dense):
    """With `dense_multi_token_steps` a new turn attends over every chunk whatever the budget, so at full rank
    its step is exact even at a 4-chunk budget; the sparse variant sees only the selected chunks."""
    ids, turn = random_prompt(300, seed=5), random_prompt(7, seed=6)
    overrides = full_budget_overrides(sparse_budget=32, dense_multi_token_steps=dense)
    logits = {}
    for name, cache in {"dynamic": dynamic_cache(model), "shadowkv": ShadowKVCache(model, **overrides)}.items():
        # One new token: only the prefill ran, so every cached token is what DynamicCache holds.
        first = generate_with(model, ids, cache, max_new_tokens=1)
        second = generate_with(model, torch.cat([first.sequences, turn], dim=1), cache, max_new_tokens=1)
        logits[name] = second.logits[0]
    if dense:
        torch.testing.assert_close(logits["shadowkv"], logits["dynamic"], rtol=1e-4, atol=1e-5)
    else:
        assert not torch.allclose(logits["shadowkv"], logits["dynamic"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length", [48, 63])
def test_short_prompt_stays_exact(model, length):
    ids = random_prompt(length, seed=length)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=24)
    cache = ShadowKVCache(model, **full_budget_overrides(min_compress_len=64))
    out = generate_with(model, ids, cache, max_new_tokens=24)
    assert_same_generation(out, ref)
    # Generation went past min_compress_len, but only the first fill decides: nothing is compressed.
    assert cache.get_seq_length() >= 64
    assert not any(layer.is_compressed for layer in cache.layers)
    assert all(layer.mode.temporal is None for layer in cache.layers)


def test_prompt_of_exactly_min_compress_len_is_compressed():
    model = tiny_model("qwen3")
    ids = random_prompt(64, seed=64)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=8)
    cache = ShadowKVCache(model, **full_budget_overrides(min_compress_len=64))
    out = generate_with(model, ids, cache, max_new_tokens=8)
    assert_same_generation(out, ref)
    assert all(layer.is_compressed for layer in cache.layers)


def test_a_float64_model_is_served_at_full_budget():
    """Landmarks, norms and similarities sum in fp32 for 16- and 32-bit keys; a float64 model's keys keep their own
    precision (torch refuses to sum them in fp32) and decode as `DynamicCache` does."""
    model = tiny_model("llama")
    ids = random_prompt(300, seed=9)
    try:
        model.to(torch.float64)
        ref = generate_with(model, ids, dynamic_cache(model))
        cache = ShadowKVCache(model, **full_budget_overrides())
        out = generate_with(model, ids, cache)
    finally:
        model.to(torch.float32)  # the shared tiny model
    assert_same_generation(out, ref)
    assert_full_selection_ran(cache, decode_steps=NEW_TOKENS - 1)
