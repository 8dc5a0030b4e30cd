"""`ShadowKVCache.memory_report()`: device and host bytes, the ratio to `DynamicCache`, the hit rate.

Each figure is checked against what it stands for (the real `DynamicCache`'s tensors, the host store's tensors,
a selection that never changes), not against the arithmetic that computes it.
"""

from __future__ import annotations

import pytest
from helpers import (
    dynamic_cache,
    forward_with,
    generate_with,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)

from shadowkv_cache import MemoryReport, ShadowKVCache
from shadowkv_cache.policies import StreamingLLM

LONG = 2000
NEW_TOKENS = 8


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dynamic_bytes(cache) -> int:
    return sum(tensor_bytes(layer.keys, layer.values) for layer in cache.layers)


def overrides() -> dict:
    return small_budget_overrides(rank=4, sparse_budget=64)


@pytest.fixture(scope="module")
def model():
    return tiny_model("mistral")


@pytest.fixture(scope="module")
def long_run(model):
    """A compressed 2000-token prefill plus decode at a small budget, and DynamicCache on the same input."""
    ids = random_prompt(LONG, seed=90)
    cache = ShadowKVCache(model, **overrides())
    generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)
    reference = dynamic_cache(model)
    generate_with(model, ids, reference, max_new_tokens=NEW_TOKENS)
    return cache, reference


def test_device_bytes_below_dynamic_cache(long_run):
    cache, reference = long_run
    report = cache.memory_report()
    assert isinstance(report, MemoryReport)
    assert all(layer.compressed for layer in report.layers)
    assert report.dynamic_cache_bytes == dynamic_bytes(reference)  # the same tokens, held in full
    for per_layer, full in zip(report.layers, reference.layers):
        assert per_layer.dynamic_cache_bytes == tensor_bytes(full.keys, full.values)
    assert 0 < report.gpu_bytes < report.dynamic_cache_bytes
    assert report.ratio == pytest.approx(report.gpu_bytes / report.dynamic_cache_bytes)
    assert report.ratio < 0.5
    assert report.gpu_bytes == sum(m.gpu_bytes for m in report.layers)


def test_decoding_adds_device_bytes_only_for_the_token_buffer(model, long_run):
    """The compressed prompt and the temporal cache are made at prefill: decoding adds only the buffer of the
    tokens after the prompt, which grows by whole capacities (so a few more steps add nothing), and no host
    bytes. `DynamicCache` grows with every token."""
    decoded, _ = long_run
    ids = random_prompt(LONG, seed=90)
    prefilled = ShadowKVCache(model, **overrides())
    forward_with(model, ids, prefilled)
    fewer = ShadowKVCache(model, **overrides())
    generate_with(model, ids, fewer, max_new_tokens=2)
    before, short, after = prefilled.memory_report(), fewer.memory_report(), decoded.memory_report()

    buffers = [layer.new for layer in decoded.layers]
    assert all(buffer.capacity >= NEW_TOKENS - 1 for buffer in buffers)
    assert after.gpu_bytes - before.gpu_bytes == sum(buffer.nbytes for buffer in buffers)
    assert short.gpu_bytes == after.gpu_bytes  # one step or seven: the same buffers
    assert before.host_bytes == short.host_bytes == after.host_bytes
    assert before.dynamic_cache_bytes < short.dynamic_cache_bytes < after.dynamic_cache_bytes


def test_host_bytes_are_the_value_store(model, long_run):
    """Host memory holds the values of every compressed token once (native format: no scales), nothing else."""
    cache, _ = long_run
    report = cache.memory_report()
    assert report.host_bytes > 0
    for layer, per_layer in zip(cache.layers, report.layers):
        store, prompt = layer.prompt.values, layer.prompt
        assert store.data.device.type == "cpu" and store.scales is None
        assert per_layer.host_bytes == tensor_bytes(store.data)
        rows, heads, chunks, c, dim = store.data.shape  # [rows, Hkv, C, c, D]: chunk-major
        assert chunks * c == prompt.positions.shape[1]  # every compressed token, once
        assert store.data.dtype == prompt.outlier_values.dtype  # stored at the KV dtype
        assert (rows, heads, dim) == (1, model.config.num_key_value_heads, model.config.head_dim)
    assert report.host_bytes == sum(m.host_bytes for m in report.layers)


def test_hit_rate_is_a_share(long_run):
    cache, _ = long_run
    rate = cache.memory_report().hit_rate
    assert rate is not None and 0.0 <= rate <= 1.0


@pytest.mark.parametrize("new_tokens", [2, NEW_TOKENS])
def test_hit_rate_when_every_step_selects_the_same_chunks(model, new_tokens):
    """StreamingLLM selects by position alone, so every step wants the chunks the first one fetched: the first
    sparse step (the first decoded token after the prefill's) misses every chunk, each later one hits all."""
    cache = ShadowKVCache(model, policy=StreamingLLM(), **overrides())
    generate_with(model, random_prompt(LONG, seed=93), cache, max_new_tokens=new_tokens)
    steps = new_tokens - 1  # the prefill produces the first token; each later one is a sparse step
    assert cache.memory_report().hit_rate == (steps - 1) / steps


def test_report_text_has_each_layer_and_the_total(long_run):
    cache, _ = long_run
    text = str(cache.memory_report())
    assert "total" in text
    lines = text.splitlines()
    for i in range(len(cache.layers)):
        assert any(line.split()[:2] == [str(i), "shadowkv"] for line in lines), text
    assert "hit rate" in text


def test_report_before_any_sparse_step(model):
    cache = ShadowKVCache(model, **small_budget_overrides())
    assert cache.memory_report().gpu_bytes == 0  # nothing stored yet
    forward_with(model, random_prompt(300, seed=91), cache)  # prefill only
    report = cache.memory_report()
    assert all(layer.compressed for layer in report.layers)
    assert report.hit_rate is None
    assert "n/a" in str(report)


def test_report_of_an_exact_cache(model):
    cache = ShadowKVCache(model, **small_budget_overrides())
    generate_with(model, random_prompt(40, seed=92), cache, max_new_tokens=4)  # shorter than min_compress_len
    reference = dynamic_cache(model)
    generate_with(model, random_prompt(40, seed=92), reference, max_new_tokens=4)
    report = cache.memory_report()
    assert not any(layer.compressed for layer in report.layers)
    assert report.gpu_bytes == report.dynamic_cache_bytes == dynamic_bytes(reference)
    assert report.host_bytes == 0
    assert report.ratio == 1.0
    assert report.hit_rate is None
    assert all(line.split()[1] == "exact" for line in str(report).splitlines()[1:3])
