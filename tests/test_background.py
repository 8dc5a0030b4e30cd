"""Compression beside the forward (hf/background.py): a layer's prompt compressed on a worker thread while the next
layers run gives the prompt the layer would have made inline, joins when read and when the call ends, bounds what
waits beside the forward, and a compression that fails fails its call and leaves the cache as it was.

On the CPU a layer compresses inline; `ON_CPU` runs the worker's path here too (no stream), so every path but the
side stream runs in CI. The CUDA tests (`-m gpu`) compare the side stream with inline compression, bit for bit.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import generate_with, left_pad, make_tiny_model, random_prompt
from helpers import small_budget_overrides as small

from shadowkv_cache import ShadowKVCache, unpatch_model
from shadowkv_cache.hf import background
from shadowkv_cache.shadowkv import mode as shadowkv_mode
from shadowkv_cache.shadowkv.mode import ShadowKVMode

PROMPT = 120  # tokens: compressed at the small budget (min_compress_len 64)
MODES = {"shadowkv": small(), "yakv": {"mode": "yakv", "sparse_budget": 24, "min_compress_len": 64}}


@pytest.fixture
def model():
    model = make_tiny_model("llama", num_hidden_layers=3)
    yield model
    unpatch_model(model)


@pytest.fixture
def worker(monkeypatch):
    """Compression on the worker thread (also on the CPU); the threads that ran `make_prompt` are recorded."""
    monkeypatch.setattr(background, "ON_CPU", True)
    threads: list[str] = []
    real = background._run

    def run(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(background, "_run", run)
    return threads


def inline(monkeypatch):
    monkeypatch.setattr(background, "BACKGROUND", False)


@pytest.mark.parametrize("settings", MODES.values(), ids=list(MODES))
def test_compression_beside_the_forward_gives_the_inline_tokens(model, worker, monkeypatch, settings):
    ids, mask = left_pad([random_prompt(PROMPT, seed=1)[0], random_prompt(PROMPT - 25, seed=2)[0]])
    got = generate_with(model, ids, ShadowKVCache(model, **settings), attention_mask=mask, max_new_tokens=6)
    assert len(worker) == 3 and all(name.startswith("shadowkv-compress") for name in worker)
    inline(monkeypatch)
    expected = generate_with(model, ids, ShadowKVCache(model, **settings), attention_mask=mask, max_new_tokens=6)
    assert len(worker) == 3  # inline: the worker ran nothing more
    assert torch.equal(got.sequences, expected.sequences)
    for step, (a, b) in enumerate(zip(got.logits, expected.logits)):
        # One fp32 factorisation on another thread: the same operations, whose CPU kernels may split their sums
        # over another number of threads.
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_a_pending_prompt_waits_beside_the_forward_and_joins_when_read(model, worker, monkeypatch):
    """While layer 2 runs, layer 1's prompt is still pending (the call has not ended) and layer 0's compression has
    ended (a job waits for the one before it); reading a layer's prompt joins it. After the call nothing is pending."""
    ended: list[int] = []
    real = ShadowKVMode.make_prompt

    def make_prompt(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        finally:
            ended.append(1)

    monkeypatch.setattr(ShadowKVMode, "make_prompt", make_prompt)
    cache = ShadowKVCache(model, **small())
    seen = {}

    def before_layer_2(module, args):
        if seen:  # the prefill's call only
            return
        first, second = cache.layers[0], cache.layers[1]
        seen["ended before layer 2"] = len(ended)
        seen["layer 1 pending"] = second._pending is not None and second.is_compressed
        seen["layer 0 read"] = first.prompt is not None and first._pending is None

    handle = model.model.layers[2].register_forward_pre_hook(before_layer_2)
    try:
        generate_with(model, random_prompt(PROMPT, seed=3), cache, max_new_tokens=3)
    finally:
        handle.remove()
    assert seen["ended before layer 2"] >= 1
    assert seen["layer 1 pending"]
    assert seen["layer 0 read"]
    assert all(layer._pending is None and layer.is_compressed for layer in cache.layers)
    assert len(worker) == 3


def test_a_failed_compression_beside_the_forward_fails_the_call_and_leaves_the_cache_empty(model, worker, monkeypatch):
    ids = random_prompt(PROMPT, seed=4)
    expected = generate_with(model, ids, ShadowKVCache(model, **small()), max_new_tokens=4)
    real, calls = shadowkv_mode.compress_prompt, []

    def compress(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("Could not pin 1.00 GiB of host memory for the value store (simulated).")
        return real(*args, **kwargs)

    monkeypatch.setattr(shadowkv_mode, "compress_prompt", compress)
    cache = ShadowKVCache(model, **small())
    with pytest.raises(RuntimeError, match="Could not pin"):
        generate_with(model, ids, cache, max_new_tokens=4)
    assert len(calls) == 3  # every layer's job ran to its end before the call failed
    assert not any(layer.is_initialized or layer._pending is not None for layer in cache.layers)
    assert cache.get_seq_length() == 0
    monkeypatch.setattr(shadowkv_mode, "compress_prompt", real)
    assert torch.equal(generate_with(model, ids, cache, max_new_tokens=4).sequences, expected.sequences)


def test_an_error_in_the_forward_waits_for_the_compressions_it_started(model, worker, monkeypatch):
    """A forward that fails after layer 0 handed its compression to the worker: the call ends only once that job has,
    and the cache is empty."""
    running, release, ended = threading.Event(), threading.Event(), threading.Event()
    real = ShadowKVMode.make_prompt

    def slow(self, *args, **kwargs):
        running.set()
        release.wait(timeout=30)
        try:
            return real(self, *args, **kwargs)
        finally:
            ended.set()

    monkeypatch.setattr(ShadowKVMode, "make_prompt", slow)

    def fail(module, args):
        assert running.wait(timeout=30)
        threading.Timer(0.2, release.set).start()
        raise RuntimeError("injected")

    handle = model.model.layers[1].register_forward_pre_hook(fail)
    cache = ShadowKVCache(model, **small())
    try:
        with pytest.raises(RuntimeError, match="injected"):
            generate_with(model, random_prompt(PROMPT, seed=5), cache, max_new_tokens=2)
    finally:
        handle.remove()
    assert ended.is_set()  # drained: the job (let go 0.2 s after the error) ended before the call returned
    assert cache.get_seq_length() == 0 and not any(layer.is_initialized for layer in cache.layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("settings", MODES.values(), ids=list(MODES))
def test_side_stream_compression_equals_inline_on_cuda(monkeypatch, settings):
    model = make_tiny_model("llama").cuda()
    ids, mask = left_pad([random_prompt(300, seed=6)[0], random_prompt(211, seed=7)[0]])
    ids, mask = ids.cuda(), mask.cuda()
    caches = []
    for on in (True, False):
        monkeypatch.setattr(background, "BACKGROUND", on)
        cache = ShadowKVCache(model, **settings)
        caches.append((cache, generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=8)))
    (beside, got), (_, expected) = caches
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        assert torch.equal(a, b)
    assert all(layer.is_compressed and layer._pending is None for layer in beside.layers)
