"""`ShadowKVCache.memory_report()`: device and host bytes, the ratio to `DynamicCache`, the hit rate."""

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

LONG = 2000
NEW_TOKENS = 8


def dynamic_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.fixture(scope="module")
def model():
    return tiny_model("mistral")


@pytest.fixture(scope="module")
def long_run(model):
    """A compressed 2000-token prefill plus decode at a small budget, and DynamicCache on the same input."""
    ids = random_prompt(LONG, seed=90)
    cache = ShadowKVCache(model, **small_budget_overrides(rank=4, sparse_budget=64))
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
    assert 0 < report.gpu_bytes < report.dynamic_cache_bytes
    assert report.ratio == pytest.approx(report.gpu_bytes / report.dynamic_cache_bytes)
    assert report.ratio < 0.5
    assert report.gpu_bytes == sum(m.gpu_bytes for m in report.layers)


def test_host_bytes_are_the_value_store(long_run):
    cache, _ = long_run
    report = cache.memory_report()
    stores = [layer.prompt.values for layer in cache.layers]
    assert report.host_bytes == sum(store.nbytes for store in stores)
    assert report.host_bytes == sum(store.data.numel() * store.data.element_size() for store in stores)
    for store, layer, per_layer in zip(stores, cache.layers, report.layers):
        assert store.data.device.type == "cpu"
        _, _, chunks, c, _ = store.data.shape  # [rows, Hkv, C, c, D]: chunk-major
        assert chunks * c == layer.prompt.positions.shape[1]
        assert per_layer.host_bytes == store.nbytes


def test_hit_rate_is_a_share(long_run):
    cache, _ = long_run
    report = cache.memory_report()
    hits = sum(int(layer.mode.temporal.hits) for layer in cache.layers)
    lookups = sum(int(layer.mode.temporal.lookups) for layer in cache.layers)
    assert lookups > 0
    assert 0.0 <= report.hit_rate <= 1.0
    assert report.hit_rate == pytest.approx(hits / lookups)


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
