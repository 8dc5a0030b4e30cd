"""Bad input gets a clear exception before any state changes (design.md §6); patching is idempotent and undoable
(design.md §8).

Construction failures must leave the model untouched, so these tests use fresh models, not the shared ones.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    KEY_DIM,
    dynamic_cache,
    generate_with,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
)
from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.models.llama import modeling_llama

import shadowkv_cache
from shadowkv_cache import SUPPORTED_ARCHITECTURES, ShadowKVCache, ShadowKVConfig, patch_model, unpatch_model
from shadowkv_cache.hf.adapters import model_type_of

# (override, field named in the message)
BAD_VALUES = [
    ({"rank": 0}, "rank"),
    ({"rank": -3}, "rank"),
    ({"rank": 1.5}, "rank"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": 2.0}, "chunk_size"),
    ({"sparse_budget": 0}, "sparse_budget"),
    ({"sparse_budget": 1.5}, "sparse_budget"),
    ({"sparse_budget": -8}, "sparse_budget"),
    ({"local_window": -1}, "local_window"),
    ({"outlier_chunks": -1}, "outlier_chunks"),
    ({"outlier_chunks": 1.5}, "outlier_chunks"),
    ({"min_compress_len": 0}, "min_compress_len"),
    ({"pin_memory": "yes"}, "pin_memory"),
    ({"value_format": "int4"}, "value_format"),
    ({"auto_rank_error": 0}, "auto_rank_error"),
    ({"auto_rank_error": float("nan")}, "auto_rank_error"),
    ({"auto_rank_shift": -0.1}, "auto_rank_shift"),
    ({"auto_rank_shift": float("inf")}, "auto_rank_shift"),
    ({"auto_rank_shift": "0.2"}, "auto_rank_shift"),
    ({"device_record_share": 0.5}, "device_record_share"),  # ShadowKV mode has no records to mirror
    ({"mode": "yakv", "device_record_share": 1.5}, "device_record_share"),
    ({"mode": "yakv", "device_record_share": -0.1}, "device_record_share"),
    ({"mode": "yakv", "device_record_share": "half"}, "device_record_share"),
    ({"mode": "yakv", "device_record_share": True}, "device_record_share"),
    # A setting the mode does not read, changed from its default, is refused rather than ignored.
    ({"recent_window": 16}, "recent_window"),
    ({"host_grid_dim": 4}, "host_grid_dim"),
    ({"score_grid_dim": 2}, "score_grid_dim"),
    ({"mode": "yakv", "chunk_size": 4}, "chunk_size"),
    ({"mode": "yakv", "local_window": 16}, "local_window"),
]


def ids_of(case):
    return ",".join(f"{name}={value!r}" for name, value in case[0].items())


@pytest.fixture
def fresh_model():
    model = make_tiny_model("llama", seed=123)
    yield model
    unpatch_model(model)  # a test that did patch it leaves no patched model behind


@pytest.mark.parametrize("case", BAD_VALUES, ids=ids_of)
def test_bad_config_value_raises_naming_the_field(case):
    overrides, field = case
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        ShadowKVConfig(**overrides)


@pytest.mark.parametrize("case", BAD_VALUES + [({"rank": KEY_DIM + 1}, "rank")], ids=ids_of)
def test_bad_override_raises_before_the_model_is_patched(fresh_model, case):
    overrides, field = case
    before = fresh_model.config._attn_implementation
    rotary = modeling_llama.apply_rotary_pos_emb
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        ShadowKVCache(fresh_model, **overrides)
    assert fresh_model.config._attn_implementation == before
    assert modeling_llama.apply_rotary_pos_emb is rotary
    assert not fresh_model._forward_pre_hooks and not any(m._forward_pre_hooks for m in fresh_model.modules())


def test_rank_above_the_key_dimension_names_the_limit(fresh_model):
    with pytest.raises(ValueError, match=rf"rank.*{KEY_DIM}"):
        ShadowKVCache(fresh_model, rank=KEY_DIM + 1)
    ShadowKVCache(fresh_model, rank=KEY_DIM)  # the bound itself is fine


def test_bad_config_object_raises_before_patching(fresh_model):
    config = ShadowKVConfig(rank=KEY_DIM * 2)  # fine on its own: the bound depends on the model
    before = fresh_model.config._attn_implementation
    with pytest.raises(ValueError, match="rank"):
        ShadowKVCache(fresh_model, config=config)
    assert fresh_model.config._attn_implementation == before


def test_unknown_override_lists_the_valid_options(fresh_model):
    before = fresh_model.config._attn_implementation
    with pytest.raises(TypeError, match="sparse_budgett") as info:
        ShadowKVCache(fresh_model, sparse_budgett=128)
    for name in ShadowKVConfig.field_names():
        assert name in str(info.value)
    assert fresh_model.config._attn_implementation == before


def test_bad_policy_raises_before_patching(fresh_model):
    before = fresh_model.config._attn_implementation
    with pytest.raises(TypeError, match="SelectionPolicy"):
        ShadowKVCache(fresh_model, policy="landmarks")
    assert fresh_model.config._attn_implementation == before


def tiny_gpt2():
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=64)
    return GPT2LMHeadModel(config).eval()


def tiny_bloom():  # ALiBi: no RoPE, so no pre-RoPE keys to factorise
    config = BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)
    return BloomForCausalLM(config).eval()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_bloom], ids=["gpt2", "bloom"])
def test_unsupported_architecture_lists_the_supported_ones(make):
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=model.config.model_type) as info:
        ShadowKVCache(model, min_compress_len=64)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(info.value)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="Supported"):
        patch_model(model)


def patched_llamas():
    gc.collect()
    return [m for m in list(shadowkv_cache.hf.adapters._ADAPTERS) if model_type_of(m) == "llama"]


def test_patching_is_idempotent_and_unpatching_restores_the_model():
    # Other tests may have patched shared llama models; unpatch them (a later ShadowKVCache re-patches them)
    # so that this test sees the module's own `apply_rotary_pos_emb`.
    for other in patched_llamas():
        unpatch_model(other)
    original_rotary = modeling_llama.apply_rotary_pos_emb
    assert not hasattr(original_rotary, "__shadowkv_original__")

    first, second = make_tiny_model("llama", seed=5), make_tiny_model("llama", seed=5)
    ids = random_prompt(120, seed=5)
    with torch.no_grad():
        expected = first(ids).logits
    assert first.config._attn_implementation == "sdpa"

    # Two caches on one model: one patch; the second cache works like the first.
    overrides = small_budget_overrides()
    caches = [ShadowKVCache(first, **overrides), ShadowKVCache(first, **overrides)]
    assert first.config._attn_implementation == "shadowkv"
    wrapped = sum("forward" in vars(m) for m in first.modules())
    assert wrapped == 3  # one per attention module and the model's own, not one per cache
    outs = [generate_with(first, ids, cache, max_new_tokens=6) for cache in caches]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(layer.is_compressed for cache in caches for layer in cache.layers)

    # A second model on the same modeling module shares the rotary wrapper; it stays until both unpatch.
    ShadowKVCache(second, **overrides)
    unpatch_model(first)
    assert first.config._attn_implementation == "sdpa"
    assert not any(set(vars(m)) & {"forward", "generate", "prepare_inputs_for_generation"} for m in first.modules())
    assert getattr(modeling_llama.apply_rotary_pos_emb, "__shadowkv_original__", None) is original_rotary
    second_out = generate_with(second, ids, ShadowKVCache(second, **overrides), max_new_tokens=6)
    assert torch.equal(second_out.sequences, outs[0].sequences)  # same weights, still patched and working
    unpatch_model(second)
    assert modeling_llama.apply_rotary_pos_emb is original_rotary
    unpatch_model(second)  # a second unpatch is a no-op

    # After unpatching, the model is the plain model again: same logits, same generation as DynamicCache.
    with torch.no_grad():
        assert torch.equal(first(ids).logits, expected)
    plain = make_tiny_model("llama", seed=5)
    ref = generate_with(plain, ids, dynamic_cache(plain), max_new_tokens=6)
    again = generate_with(first, ids, dynamic_cache(first), max_new_tokens=6)
    assert torch.equal(again.sequences, ref.sequences)
    for a, b in zip(again.logits, ref.logits):
        assert torch.equal(a, b)

    # And it can be patched again.
    cache = ShadowKVCache(first, **overrides)
    generate_with(first, ids, cache, max_new_tokens=2)
    assert cache.layers[0].is_compressed
    unpatch_model(first)


LEAK_SCRIPT = """
import gc, sys
sys.path[:0] = {paths!r}
from helpers import make_tiny_model
from transformers.models.llama import modeling_llama
from shadowkv_cache import ShadowKVCache, unpatch_model

original = modeling_llama.apply_rotary_pos_emb
assert not hasattr(original, "__shadowkv_original__"), "importing shadowkv_cache patched the model code"
dropped = make_tiny_model("llama")
ShadowKVCache(dropped)
del dropped  # a patched model dropped without unpatch_model
gc.collect()
kept = make_tiny_model("llama")
ShadowKVCache(kept)
unpatch_model(kept)  # the only live patched model
print("restored" if modeling_llama.apply_rotary_pos_emb is original else "still wrapped")
"""


def test_a_dropped_patched_model_does_not_keep_the_rotary_wrapper():
    """Once no live model is patched, the modeling module's `apply_rotary_pos_emb` is the original again.

    Run in a fresh interpreter: the patch is process-wide state.
    """
    tests = Path(__file__).resolve().parent
    paths = [str(tests), str(tests.parent / "src")]
    result = subprocess.run(
        [sys.executable, "-c", LEAK_SCRIPT.format(paths=paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "restored"
