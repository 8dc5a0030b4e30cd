"""Nothing silently wrong (docs/reliability.md): a cache whose model no longer routes attention through it, a cache
used by another model or by two threads at once, a call that fails part way, a deep copy of a patched model, an
interrupt inside a forward: each ends in correct tokens or a clear error, never in wrong tokens.

The reference for a call that failed and was retried is the same calls on a fresh cache that never failed.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
from helpers import dynamic_cache, forward_with, generate_with, left_pad, make_tiny_model, random_prompt
from helpers import small_budget_overrides as small

from shadowkv_cache import CacheInUseError, CacheStateError, ShadowKVCache, ShadowKVConfig, patch_model, unpatch_model
from shadowkv_cache.core.low_rank import factorize_keys
from shadowkv_cache.hf import adapters, wrappers
from shadowkv_cache.hf.layer import CompressedLayer
from shadowkv_cache.hf.step_context import current_step

PROMPT = 120  # tokens: compressed at the small budget (min_compress_len 64)
WRAPPED = ("forward", "generate", "prepare_inputs_for_generation")


@pytest.fixture
def model():
    model = make_tiny_model("llama", num_hidden_layers=3)  # a middle layer to fail in
    yield model
    unpatch_model(model)


def turns(model, cache, first, second, new=4):
    """Two turns of a conversation on `cache`: `first` ids, then its output followed by `second` ids."""
    one = generate_with(model, first, cache, max_new_tokens=new)
    two = generate_with(model, torch.cat([one.sequences, second], 1), cache, max_new_tokens=new)
    return one, two


def lengths(cache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


def wrappers_of(model) -> list[tuple[str, str]]:
    return [(type(m).__name__, name) for m in model.modules() for name in WRAPPED if name in vars(m)]


class FailOnCall:
    """A forward hook that raises `error` on its `at`-th call (1-based), then never again."""

    def __init__(self, error: BaseException, at: int):
        self.error, self.at, self.calls = error, at, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.at:
            raise self.error


# -- 1. a cache whose model no longer routes attention through it -----------------------------------------------


def test_models_that_share_one_config_are_patched_apart():
    """Two models built from one config object: patching one must not route the other, and unpatching the other must
    not un-route the first (its compressed cache would then attend only to the tokens after the prompt)."""
    a = make_tiny_model("llama")
    config = a.config
    b = type(a)(config).eval()
    b.load_state_dict(a.state_dict())
    assert b.config is config
    first, second = random_prompt(PROMPT, seed=1), random_prompt(5, seed=2)
    _, expected = turns(a, ShadowKVCache(a, **small()), first, second)
    unpatch_model(a)

    cache = ShadowKVCache(a, **small())
    one = generate_with(a, first, cache, max_new_tokens=4)
    assert config._attn_implementation == "sdpa" and a.config is not config  # the shared object is untouched
    plain = generate_with(b, first, dynamic_cache(b), max_new_tokens=4)  # b still runs plain SDPA
    ShadowKVCache(b)
    unpatch_model(b)
    assert a.config._attn_implementation == "shadowkv" and b.config is config
    two = generate_with(a, torch.cat([one.sequences, second], 1), cache, max_new_tokens=4)
    assert torch.equal(two.sequences, expected.sequences)
    assert torch.equal(plain.sequences, generate_with(b, first, dynamic_cache(b), max_new_tokens=4).sequences)
    unpatch_model(a)
    assert a.config is config  # unpatching gives the model its own config object back


@pytest.mark.parametrize("leave", ["unpatch_model", "set_attn_implementation"])
def test_a_cache_refuses_a_model_that_no_longer_routes_attention_to_it(model, leave):
    first, second = random_prompt(PROMPT, seed=3), random_prompt(5, seed=4)
    _, expected = turns(model, ShadowKVCache(model, **small()), first, second)
    cache = ShadowKVCache(model, **small())
    one = generate_with(model, first, cache, max_new_tokens=4)
    assert all(layer.is_compressed for layer in cache.layers)
    before = lengths(cache)
    if leave == "unpatch_model":
        unpatch_model(model)
    else:
        model.set_attn_implementation("sdpa")
    ids = torch.cat([one.sequences, second], 1)
    with pytest.raises(CacheStateError, match=r"patch_model\(model\)"):
        generate_with(model, ids, cache, max_new_tokens=4)
    with pytest.raises(CacheStateError, match="outside the patched attention|implementation is 'sdpa'"):
        forward_with(model.model, ids, cache)  # the base model, past the top model's checks: update() refuses
    assert lengths(cache) == before  # nothing was stored
    patch_model(model)  # routed again: the cache goes on as if nothing happened
    assert torch.equal(generate_with(model, ids, cache, max_new_tokens=4).sequences, expected.sequences)


# -- 6. a cache is bound to its model ---------------------------------------------------------------------------


def test_a_cache_is_bound_to_the_model_it_was_made_for(model):
    other = make_tiny_model("llama", num_hidden_layers=3, seed=7)
    try:
        cache = ShadowKVCache(model, **small())
        ids = random_prompt(PROMPT, seed=5)
        generate_with(model, ids, cache, max_new_tokens=2)
        before = lengths(cache)
        ShadowKVCache(other)  # the other model is patched too
        with pytest.raises(CacheStateError, match="made for another model"):
            generate_with(other, ids, cache, max_new_tokens=2)
        with pytest.raises(CacheStateError, match="made for another model"):
            forward_with(other.model, ids[:, -1:], cache)
        assert lengths(cache) == before
    finally:
        unpatch_model(other)


# -- 2. a call that fails part way ------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()], ids=["RuntimeError", "interrupt"])
@pytest.mark.parametrize("at", [1, 3], ids=["question step", "decode step"])
def test_a_failed_generate_leaves_the_cache_as_it_was(model, error, at):
    """An exception in the middle layer (after layer 0 stored its keys) of the second turn's question step or of a
    decode step: the cache goes back to what it held before that generate, and the same call then gives what it
    gives on a cache that never failed."""
    first, second = random_prompt(PROMPT, seed=6), random_prompt(5, seed=7)
    _, expected = turns(model, ShadowKVCache(model, **small()), first, second)
    cache = ShadowKVCache(model, **small())
    one = generate_with(model, first, cache, max_new_tokens=4)
    before = lengths(cache)
    ids = torch.cat([one.sequences, second], 1)
    handle = model.model.layers[1].mlp.register_forward_hook(FailOnCall(error, at))
    try:
        with pytest.raises(type(error)):
            generate_with(model, ids, cache, max_new_tokens=4)
    finally:
        handle.remove()
    assert lengths(cache) == before
    assert current_step() is None
    again = generate_with(model, ids, cache, max_new_tokens=4)
    assert torch.equal(again.sequences, expected.sequences)


def test_a_failed_roll_back_marks_the_cache_broken_until_reset(model, monkeypatch):
    ids = random_prompt(PROMPT, seed=8)
    expected = generate_with(model, ids, ShadowKVCache(model, **small()), max_new_tokens=4)
    cache = ShadowKVCache(model, **small())
    generate_with(model, ids, cache, max_new_tokens=2)

    def cannot(self, saved, **kwargs):
        raise RuntimeError("cannot restore")

    monkeypatch.setattr(CompressedLayer, "restore", cannot)
    handle = model.model.layers[1].mlp.register_forward_hook(FailOnCall(RuntimeError("injected"), 2))
    try:
        with pytest.raises(RuntimeError, match="injected"):
            generate_with(model, torch.cat([ids, ids[:, :3]], 1), cache, max_new_tokens=4)
    finally:
        handle.remove()
    monkeypatch.undo()
    for use in (
        lambda: generate_with(model, ids, cache, max_new_tokens=2),
        lambda: forward_with(model.model, ids[:, -1:], cache),
        lambda: cache.fork(),
    ):
        with pytest.raises(CacheStateError, match=r"could not be put back.*cache\.reset\(\)"):
            use()
    cache.reset()
    assert torch.equal(generate_with(model, ids, cache, max_new_tokens=4).sequences, expected.sequences)


def test_a_roll_back_after_a_failed_capture_keeps_the_decode_state(model):
    """A failed CUDA-graph capture recorded kernels but ran none, so the temporal cache on the device is as it was:
    the roll-back keeps it (made again, it would hold its chunks in other slots and attention would round differently
    from a cache that never failed). A failed call that ran on the device drops it, as it may be half refreshed."""
    ids = random_prompt(PROMPT, seed=9)
    cache = ShadowKVCache(model, **small())
    generate_with(model, ids, cache, max_new_tokens=3)
    held = [layer.mode.temporal for layer in cache.layers]
    assert all(temporal is not None for temporal in held)
    before = lengths(cache)
    saved = cache._state.checkpoint(cache)
    forward_with(model, ids[:, -1:], cache)
    cache._state.roll_back(cache, saved, None, ran_on_device=False)
    assert lengths(cache) == before
    assert all(layer.mode.temporal is temporal for layer, temporal in zip(cache.layers, held))
    forward_with(model, ids[:, -1:], cache)
    cache._state.roll_back(cache, saved, None)
    assert lengths(cache) == before
    assert all(layer.mode.temporal is None for layer in cache.layers)


# -- 8. the library's own input checks leave a retry possible ---------------------------------------------------


def _fail_in_second_compression(monkeypatch):
    from shadowkv_cache.shadowkv import mode as shadowkv_mode

    real = shadowkv_mode.compress_prompt
    calls = []

    def compress(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # layer 1, after layer 0 stored and compressed its prompt
            raise RuntimeError("Could not pin 1.00 GiB of host memory for the value store (simulated).")
        return real(*args, **kwargs)

    monkeypatch.setattr(shadowkv_mode, "compress_prompt", compress)


BAD_BATCHES = {  # (the error's message, how the batch is spoilt; None: pinning fails in layer 1 instead)
    "right padding": ("left padding", lambda ids, mask: (ids.flip(1), mask.flip(1))),
    "a hole": ("left padding", lambda ids, mask: (ids, mask.index_fill(1, torch.tensor([PROMPT - 20]), 0))),
    "an all-pad row": (r"Row\(s\) \[1\].*no real token", lambda ids, mask: (ids, mask * torch.tensor([[1], [0]]))),
    "pinning fails": ("Could not pin", None),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_BATCHES, ids=list(BAD_BATCHES))
def test_a_rejected_first_fill_leaves_the_cache_empty_for_a_retry(model, monkeypatch, case):
    message, spoil = BAD_BATCHES[case]
    ids, mask = left_pad([random_prompt(PROMPT, seed=9)[0], random_prompt(PROMPT - 30, seed=10)[0]])
    expected = generate_with(model, ids, ShadowKVCache(model, **small()), attention_mask=mask, max_new_tokens=4)
    cache = ShadowKVCache(model, **small())
    if spoil is None:
        _fail_in_second_compression(monkeypatch)
        bad_ids, bad_mask = ids, mask
    else:
        bad_ids, bad_mask = spoil(ids, mask)
    with pytest.raises((ValueError, NotImplementedError, RuntimeError), match=message):
        forward_with(model, bad_ids, cache, attention_mask=bad_mask)
    monkeypatch.undo()
    assert not any(layer.is_initialized for layer in cache.layers) and cache.get_seq_length() == 0
    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(out.sequences, expected.sequences)


# -- 7. one cache, two threads; patching from two threads -------------------------------------------------------


def test_a_second_thread_is_refused_while_a_generate_runs(model):
    ids = random_prompt(PROMPT, seed=11)
    expected = generate_with(model, ids, ShadowKVCache(model, **small()), max_new_tokens=6)
    cache = ShadowKVCache(model, **small())
    inside, tried = threading.Event(), threading.Event()
    calls = []

    def pause(module, args, output):
        calls.append(1)
        if len(calls) == 3:  # the first thread is decoding
            inside.set()
            tried.wait(timeout=10)

    handle = model.model.layers[1].mlp.register_forward_hook(pause)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=generate_with(model, ids, cache, max_new_tokens=6)))
    worker.start()
    try:
        assert inside.wait(timeout=60)
        with pytest.raises(CacheInUseError, match="another thread"):
            generate_with(model, ids, cache, max_new_tokens=6)
        with pytest.raises(CacheInUseError, match="another thread"):
            forward_with(model.model, ids[:, -1:], cache)  # past the model's own checks: update() refuses too
    finally:
        tried.set()
        worker.join(timeout=60)
        handle.remove()
    assert torch.equal(result["out"].sequences, expected.sequences)  # the first thread never noticed
    # Once the first call returned, another thread may use the cache (one at a time is fine).
    after = {}
    worker = threading.Thread(target=lambda: after.update(n=cache.get_seq_length()))
    worker.start()
    worker.join()
    generate_with(model, torch.cat([expected.sequences, ids[:, :2]], 1), cache, max_new_tokens=1)


def test_two_threads_that_patch_one_model_patch_it_once(monkeypatch):
    model = make_tiny_model("llama")
    slow = adapters.check_supported

    def check_slowly(m):  # widens the window between "not patched yet" and "patched"
        threading.Event().wait(0.05)
        return slow(m)

    monkeypatch.setattr(adapters, "check_supported", check_slowly)
    barrier = threading.Barrier(4)
    results = []

    def patch():
        barrier.wait()
        results.append(patch_model(model))

    workers = [threading.Thread(target=patch) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    for module in attention:
        assert isinstance(vars(module)["forward"], wrappers.AttentionForward)
        assert vars(module)["forward"]._previous is None  # wrapped once, not a wrapper around a wrapper
    unpatch_model(model)
    assert wrappers_of(model) == [] and model.config._attn_implementation == "sdpa"
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


# -- 10. deep copies, interrupts --------------------------------------------------------------------------------


def test_a_deep_copy_of_a_patched_model_is_a_model_of_its_own():
    original = make_tiny_model("llama")
    ids = random_prompt(PROMPT, seed=12)
    cache = ShadowKVCache(original, **small())
    expected = generate_with(original, ids, cache, max_new_tokens=4)
    twin = copy.deepcopy(original)
    assert twin.config is not original.config
    with pytest.raises(CacheStateError, match="made for another model"):
        generate_with(twin, torch.cat([expected.sequences, ids[:, :2]], 1), cache, max_new_tokens=1)
    own = generate_with(twin, ids, ShadowKVCache(twin, **small()), max_new_tokens=4)  # patched for itself
    assert torch.equal(own.sequences, expected.sequences)

    unpatch_model(twin)
    assert wrappers_of(twin) == [] and twin.config._attn_implementation == "sdpa"
    plain = make_tiny_model("llama")
    ref = generate_with(plain, ids, dynamic_cache(plain), max_new_tokens=4)
    assert torch.equal(generate_with(twin, ids, dynamic_cache(twin), max_new_tokens=4).sequences, ref.sequences)
    assert original.config._attn_implementation == "shadowkv"  # the original stays patched

    alive = weakref.ref(original)
    del original, cache
    gc.collect()
    assert alive() is None  # the copy does not keep the original alive


def test_a_deep_copy_made_while_patched_can_be_unpatched_alone():
    original = make_tiny_model("llama")
    ShadowKVCache(original)
    twin = copy.deepcopy(original)
    unpatch_model(twin)  # never registered as patched: what it carries over is still removed
    assert wrappers_of(twin) == [] and twin.config._attn_implementation == "sdpa"
    assert wrappers_of(original) and original.config._attn_implementation == "shadowkv"
    unpatch_model(original)


def test_an_interrupt_inside_attention_leaves_no_stale_step(model):
    cache = ShadowKVCache(model, **small())
    handle = model.model.layers[0].self_attn.o_proj.register_forward_hook(FailOnCall(KeyboardInterrupt(), 1))
    try:
        with pytest.raises(KeyboardInterrupt):
            forward_with(model, random_prompt(PROMPT, seed=13), cache)
    finally:
        handle.remove()
    assert current_step() is None
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is None  # nothing on this thread holds the cache


# -- 11. concurrent factorisations ------------------------------------------------------------------------------


def test_concurrent_factorisations_restore_the_thread_count():
    """Each CPU factorisation runs single-threaded (core/low_rank.py); concurrent ones share that section, and the
    process's thread count comes back once the last leaves."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        barrier = threading.Barrier(2)
        errors = []

        def work(seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            keys = torch.randn(64, 32, generator=gen)
            barrier.wait()
            try:
                for _ in range(60):
                    a, b = factorize_keys(keys, 32)
                    torch.testing.assert_close(a @ b, keys, rtol=1e-4, atol=1e-4)
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)

        workers = [threading.Thread(target=work, args=(seed,)) for seed in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not errors
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


# -- 13. clear messages -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [True, 0, 2.0, "2"])
def test_fork_names_a_bad_batch_size(model, batch_size):
    doc = ShadowKVCache.prefill(model, random_prompt(PROMPT, seed=14)[0], **small())
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        doc.fork(batch_size)


def test_yakv_mode_refuses_a_value_format():
    with pytest.raises(ValueError, match=r"value_format='fp8'.*YAKV.*value_format='native'"):
        ShadowKVConfig(mode="yakv", value_format="fp8")
    ShadowKVConfig(mode="yakv")  # the default format is fine
