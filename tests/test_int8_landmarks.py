"""int8 landmarks (`LandmarkTopK(landmark_format="int8")`): the quantiser, the logits' twin, selection against the
model-dtype landmarks, the cache end to end, prefix files and the synthetic cache. The kernel against its twin is in
tests/test_kernels.py (`-m gpu`).

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, C chunks, c chunk size, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    dynamic_cache,
    forward_with,
    full_budget_overrides,
    generate_with,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from benchmarks.bounds import shadowkv_bound
from shadowkv_cache import LandmarkTopK, PrefixCacheError, ShadowKVCache
from shadowkv_cache.core.landmarks import quantize_landmarks
from shadowkv_cache.ops import landmark_logits as op
from shadowkv_cache.ops.landmark_logits import landmark_logits_int8, landmark_logits_int8_reference
from shadowkv_cache.policies.base import grouped_query
from shadowkv_cache.prefix.format import policy_settings, settings_as_saved
from shadowkv_cache.testing import synthetic_cache
from shadowkv_cache.testing.hit_rate import ControlledHitRate

B, HQ, HKV, C, CS, D = 2, 8, 2, 40, 8, 32
SCALING = D**-0.5


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 17), st.sampled_from([1, 4, 64])),
    log_scale=st.floats(-20, 20),
    seed=st.integers(0, 2**16),
)
@example(shape=(3, 3, 3, 64), log_scale=1.6307448043531423, seed=3)
def test_quantised_landmarks_are_within_half_a_step(shape, log_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen) * 3) * 2.0**log_scale
    x[..., 0, :] = 0  # a padding chunk
    codes, scales = quantize_landmarks(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    assert bool((codes.abs() <= 127).all())
    assert bool((codes[..., 0, :] == 0).all()) and bool((scales[..., 0] == 0).all())
    assert torch.equal(codes.abs().amax(-1)[..., 1:], torch.full_like(scales[..., 1:], 127, dtype=torch.int8))
    back = codes.float() * scales[..., None]
    # Half a step up to fp32 rounding: x / s and codes * s are each rounded (relative 2^-24 on up to 127.5 steps), so
    # the bound is (0.5 + 255 * 2^-24) steps; 2^-15 covers it and the subtraction's own rounding. A ratio that rounds to
    # exactly k + 0.5 (seed 3, shape (3, 3, 3, 64), log_scale 1.63) lands there.
    assert bool(((back - x).abs() <= scales[..., None] * (0.5 + 2**-15)).all())


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_is_the_dequantised_landmarks_times_the_queries(shared, dtype):
    torch.manual_seed(0)
    landmarks = torch.randn(1 if shared else B, HKV, C, D)
    codes, scales = quantize_landmarks(landmarks)
    q = torch.randn(B, HKV, HQ // HKV, 1, D).to(dtype)
    got = landmark_logits_int8_reference(q, codes, scales)
    dequantised = (codes.float() * scales[..., None]).expand(B, -1, -1, -1)
    want = torch.einsum("bhgtd,bhcd->bhgtc", q.float(), dequantised).to(dtype)
    assert got.dtype == dtype and got.shape == (B, HKV, HQ // HKV, 1, C)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert landmark_logits_int8(q, codes, scales).equal(got)  # the op's dispatch runs the twin on CPU


def test_policy_state_and_bad_format():
    torch.manual_seed(0)
    keys = torch.randn(B, HKV, C, CS, D, dtype=torch.bfloat16)
    native, int8 = LandmarkTopK().prepare(keys), LandmarkTopK("int8").prepare(keys)
    assert sorted(native) == ["landmarks"] and native["landmarks"].dtype == torch.bfloat16
    assert sorted(int8) == ["landmark_codes", "landmark_scales"]
    assert int8["landmark_codes"].shape == (B, HKV, C, D) and int8["landmark_codes"].dtype == torch.int8
    assert int8["landmark_scales"].shape == (B, HKV, C) and int8["landmark_scales"].dtype == torch.float32
    # Quantised from the fp32 means, not from the bf16 landmarks.
    codes, scales = quantize_landmarks(keys.float().mean(dim=-2))
    assert torch.equal(int8["landmark_codes"], codes) and torch.equal(int8["landmark_scales"], scales)
    with pytest.raises(ValueError, match=r"landmark_format='fp4'.*'native', 'int8'"):
        LandmarkTopK("fp4")


def test_int8_selection_keeps_what_the_model_dtype_landmarks_select():
    """Keys in clusters (each chunk near its own direction, as real keys are): the int8 landmarks rank the chunks as
    the fp32 ones do, up to near ties."""
    torch.manual_seed(3)
    centres = torch.randn(B, HKV, 400, 1, 64) * torch.rand(B, HKV, 400, 1, 1) * 3
    keys = centres + 0.3 * torch.randn(B, HKV, 400, CS, 64)
    query = torch.randn(B, HQ, 1, 64)
    selectable = torch.ones(B, HKV, 400, dtype=torch.bool)
    picks = {}
    for fmt in ("native", "int8"):
        policy = LandmarkTopK(fmt)
        picks[fmt] = policy.select(query, policy.prepare(keys), selectable, 40, 64**-0.5)
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picks["native"].flatten(0, 1),
                                                                      picks["int8"].flatten(0, 1)))  # fmt: skip
    assert same / picks["native"].numel() >= 0.95


def test_shared_document_rows_score_against_the_one_copy():
    torch.manual_seed(1)
    policy = LandmarkTopK("int8")
    state = policy.prepare(torch.randn(1, HKV, C, CS, D))
    shared = {k: v.expand(B, *v.shape[1:]) for k, v in state.items()}  # stride-0 rows, as a loaded prefix holds
    query = torch.randn(B, HQ, 1, D)
    selectable = torch.ones(B, HKV, C, dtype=torch.bool)
    got = policy.masked_scores(query, shared, selectable, SCALING)
    for row in range(B):
        alone = policy.masked_scores(query[row : row + 1], state, selectable[:1], SCALING)
        torch.testing.assert_close(got[row : row + 1], alone)
    want = grouped_query(query * SCALING, HKV)  # the twin directly, on the expanded copy
    logits = landmark_logits_int8_reference(want, shared["landmark_codes"], shared["landmark_scales"])
    torch.testing.assert_close(policy._logits(query, shared, SCALING), logits)


def test_full_budget_with_int8_landmarks_gives_dynamic_cache_tokens():
    model, prompt = tiny_model("llama"), random_prompt(200, seed=5)
    ref = generate_with(model, prompt, dynamic_cache(model), max_new_tokens=8)
    cache = ShadowKVCache(model, policy=LandmarkTopK("int8"), **full_budget_overrides())
    out = generate_with(model, prompt, cache, max_new_tokens=8)
    assert torch.equal(out.sequences, ref.sequences)
    layer = cache.layers[0]
    assert layer.prompt.policy_state["landmark_codes"].dtype == torch.int8


def test_memory_report_counts_the_int8_landmarks():
    """The same prompt with either format: the device bytes differ by the landmarks' bytes alone, one byte per value
    and four per landmark against the model dtype's (fp32 here)."""
    model, prompt = tiny_model("llama"), random_prompt(300, seed=6)
    gpu, landmarks = {}, {}
    for fmt in ("native", "int8"):
        cache = ShadowKVCache(model, policy=LandmarkTopK(fmt), **small_budget_overrides())
        forward_with(model, prompt, cache)
        gpu[fmt] = cache.memory_report().gpu_bytes
        states = [layer.prompt.policy_state for layer in cache.layers]
        landmarks[fmt] = sum(t.numel() * t.element_size() for state in states for t in state.values())
    count = landmarks["native"] // 4  # fp32 values
    assert landmarks["int8"] == count + 4 * count // model.config.head_dim
    assert gpu["native"] - gpu["int8"] == landmarks["native"] - landmarks["int8"] > 0


def test_prefix_files_keep_the_landmark_format(tmp_path):
    model, prompt = tiny_model("llama"), random_prompt(300, seed=7)
    cache = ShadowKVCache(model, policy=LandmarkTopK("int8"), **small_budget_overrides())
    forward_with(model, prompt, cache)
    path = tmp_path / "doc.skv"
    cache.save_prefix(path, prompt)
    loaded = ShadowKVCache.load_prefix(model, path, policy=LandmarkTopK("int8"))
    state = loaded.layers[0].prompt.policy_state
    assert torch.equal(state["landmark_codes"], cache.layers[0].prompt.policy_state["landmark_codes"])
    with pytest.raises(PrefixCacheError, match="landmark_format"):
        ShadowKVCache.load_prefix(model, path)  # the default policy keeps native landmarks


def test_settings_a_file_predates_take_their_values_from_before():
    """Files written before `landmark_format` existed record LandmarkTopK's settings as {}: native landmarks, even
    if the default changes."""
    assert settings_as_saved({}, LandmarkTopK()) == policy_settings(LandmarkTopK())
    assert settings_as_saved({}, LandmarkTopK("int8")) != policy_settings(LandmarkTopK("int8"))
    assert settings_as_saved({"landmark_format": "int8"}, LandmarkTopK()) == {"landmark_format": "int8"}
    wrapped = ControlledHitRate(0.5, LandmarkTopK())  # a wrapped policy's settings are filled in too
    old = {**policy_settings(wrapped), "inner": {"name": "LandmarkTopK", "settings": {}}}
    assert settings_as_saved(old, wrapped) == policy_settings(wrapped)


def test_synthetic_cache_fills_int8_landmarks_and_wraps_the_policy_for_a_hit_rate():
    model = tiny_model("llama")
    cache = synthetic_cache(model, 2, 512, policy=LandmarkTopK("int8"), hit_rate=0.5, **small_budget_overrides())
    assert cache.policy.inner.landmark_format == "int8"
    state = cache.layers[0].prompt.policy_state
    assert state["landmark_codes"].dtype == torch.int8 and state["landmark_scales"].shape[:2] == (2, 2)
    token = torch.zeros(2, 1, dtype=torch.long)
    for _ in range(3):
        model(input_ids=token, past_key_values=cache)
    assert cache.memory_report().hit_rate is not None


def test_bytes_bound_counts_int8_landmarks():
    model = tiny_model("llama")
    config = ShadowKVCache(model, **small_budget_overrides()).config
    native = shadowkv_bound(model, config, 4096, 4, 0.5, 0, 1.0)[1]
    int8 = shadowkv_bound(model, config, 4096, 4, 0.5, 0, 1.0, "int8")[1]
    cfg = model.config
    chunks = (4096 - 16) // 8  # less the local window; outliers are landmarks too
    saved = 4 * cfg.num_hidden_layers * cfg.num_key_value_heads * (2 * cfg.head_dim - cfg.head_dim - 4)
    assert native - int8 == pytest.approx(saved * chunks, rel=0.02)


def test_kernel_dispatch_rules(monkeypatch):
    """One-token bf16/fp16 steps of head dim 64/128/256 and at most 8 query heads per KV head take the kernel (on an
    sm_80+ device); everything else the twin."""
    monkeypatch.setattr(op, "kernels_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def fits(batch=4, group=4, tokens=1, dim=128, dtype=torch.bfloat16, shared=False, scales_dtype=torch.float32):
        q = torch.zeros(batch, 8, group, tokens, dim, dtype=dtype)
        codes = torch.zeros(1 if shared else batch, 8, 100, dim, dtype=torch.int8)
        scales = torch.zeros(1 if shared else batch, 8, 100, dtype=scales_dtype)
        return op._kernel_fits(q, codes, scales)

    assert fits() and fits(dim=64) and fits(dim=256) and fits(group=8) and fits(shared=True)
    assert fits(dtype=torch.float16) and fits(group=1)
    assert not fits(tokens=2) and not fits(dim=96) and not fits(group=9) and not fits(dtype=torch.float32)
    assert not fits(scales_dtype=torch.float16)

    def fits_with(q=None, codes=None, scales=None):
        base_q = torch.zeros(4, 8, 4, 1, 128, dtype=torch.bfloat16)
        base_codes = torch.zeros(4, 8, 100, 128, dtype=torch.int8)
        base_scales = torch.zeros(4, 8, 100)
        return op._kernel_fits(base_q if q is None else q, base_codes if codes is None else codes,
                               base_scales if scales is None else scales)  # fmt: skip

    wide = torch.zeros(4, 8, 100, 129, dtype=torch.int8)
    assert fits_with(codes=torch.zeros(1, 8, 100, 128, dtype=torch.int8).expand(4, -1, -1, -1),
                     scales=torch.zeros(1, 8, 100).expand(4, -1, -1))  # stride-0 rows of one document  # fmt: skip
    assert not fits_with(codes=wide[..., 1:])  # rows not 16-byte aligned (the pointer, then the strides)
    assert not fits_with(codes=wide[..., :128])
    assert not fits_with(codes=torch.zeros(4, 8, 128, 100, dtype=torch.int8).transpose(2, 3))  # D not contiguous
    assert not fits_with(q=torch.zeros(4, 8, 4, 1, 256, dtype=torch.bfloat16)[..., ::2])  # strided query dims
    assert not fits_with(codes=torch.zeros(2, 8, 100, 128, dtype=torch.int8), scales=torch.zeros(2, 8, 100))
    assert not fits_with(scales=torch.zeros(4, 8, 200)[..., ::2])  # strided scales
    assert not fits_with(scales=torch.zeros(4, 8, 99))  # scales of other landmarks
    assert not fits_with(codes=torch.zeros(4, 8, 0, 128, dtype=torch.int8), scales=torch.zeros(4, 8, 0))
    assert not fits_with(codes=torch.zeros(4, 8, 100, 128, dtype=torch.int8, device="meta"))  # another device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not fits()
