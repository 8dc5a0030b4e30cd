"""Architectures whose RoPE is not rotate-half over the whole head (design.md §8): partial rotary (Phi, Phi-3 at a
partial factor, StableLM, GPT-NeoX, GLM), interleaved pairs (GLM, GLM-4, Cohere, Cohere 2) and layers without RoPE
(Cohere 2's global layers, which are the ones compressed).

The layout the cache reads from each model is checked against the one its modeling file implements; prefix files
and YAKV mode are checked per layout. The invariants of design.md §6 (full budget and full rank give `DynamicCache`'s
logits and greedy tokens with the key rebuild really running; left-padded rows get what they get alone; every
prompt token stays reachable exactly once; a second chat turn continues exactly) run for every architecture's tiny
config in test_architectures.py, and here for the layouts that config does not reach (Phi-3 at a partial factor).

Legend: B batch, Hkv KV heads, S prompt tokens, D head dim.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    assert_left_padded_rows_reachable,
    assert_logits_close,
    decoded_in_graphs,
    dynamic_cache,
    forward_with,
    full_budget_overrides,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
)
from test_exactness import assert_full_selection_ran, rebuilt_chunks  # noqa: F401 (a fixture)
from test_yakv import quantised_reference, yakv

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.hf.adapters import SUPPORTED_ARCHITECTURES, patch_model
from shadowkv_cache.hf.layer import CompressedLayer
from shadowkv_cache.ops.rebuild_keys import RopeLayout

NEW_TOKENS = 12

# case -> (architecture, config overrides on top of helpers' tiny config, the layout its modeling file implements,
# the layers whose attention applies no RoPE). Head dim 16 throughout.
CASES: dict[str, tuple[str, dict, RopeLayout, frozenset[int]]] = {
    "phi": ("phi", {}, RopeLayout(8), frozenset()),
    "phi3": ("phi3", {}, RopeLayout(16), frozenset()),
    "phi3-partial": ("phi3", {"partial_rotary_factor": 0.5}, RopeLayout(8), frozenset()),
    "stablelm": ("stablelm", {}, RopeLayout(4), frozenset()),
    "gpt_neox": ("gpt_neox", {}, RopeLayout(4), frozenset()),
    "glm": ("glm", {}, RopeLayout(8, interleaved=True), frozenset()),
    "glm4": ("glm4", {}, RopeLayout(8, interleaved=True), frozenset()),
    "cohere": ("cohere", {}, RopeLayout(16, interleaved=True), frozenset()),
    "cohere2": ("cohere2", {}, RopeLayout(16, interleaved=True), frozenset({1, 3})),
    "glm4_moe": ("glm4_moe", {}, RopeLayout(8), frozenset()),
    "minimax_m2": ("minimax_m2", {}, RopeLayout(8), frozenset()),
    "ernie4_5": ("ernie4_5", {}, RopeLayout(16, interleaved=True), frozenset()),
    "ernie4_5_moe": ("ernie4_5_moe", {}, RopeLayout(16, interleaved=True), frozenset()),
}


@functools.cache
def case_model(case: str) -> torch.nn.Module:
    arch, overrides, _, _ = CASES[case]
    return make_tiny_model(arch, **overrides)


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> str:
    return request.param


# The end-to-end invariants of every supported architecture at its tiny config run in test_architectures.py; here
# they run for the layouts that config does not reach (Phi-3 with partial rotary).
VARIANTS = [name for name, (_, overrides, _, _) in CASES.items() if overrides]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request) -> str:
    return request.param


def exact_overrides(**changes) -> dict:
    # rank=1.0 is the full key dimension whatever Hkv*D is (64 for GPT-NeoX, 32 elsewhere).
    return full_budget_overrides(rank=1.0, **changes)


def compressed_layers(cache: ShadowKVCache) -> list[tuple[int, CompressedLayer]]:
    return [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, CompressedLayer)]


def test_every_case_is_a_supported_architecture():
    assert {arch for arch, *_ in CASES.values()} <= set(SUPPORTED_ARCHITECTURES)


def test_layout_is_read_from_the_model(case):
    _, _, layout, without_rope = CASES[case]
    adapter = patch_model(case_model(case))
    assert adapter.rope.layout == layout
    assert adapter.without_rope == without_rope
    for i in range(case_model(case).config.num_hidden_layers):
        assert adapter.layer_rope(i).layout == (RopeLayout(0) if i in without_rope else layout)


def test_model_rope_leaves_the_dims_past_rotary_dim_alone(case):
    """Partial rotary: the dims RoPE does not rotate come out as they went in; the rotated ones move."""
    rope = patch_model(case_model(case)).rope
    keys = torch.randn(6, 20, 16)
    positions = torch.randint(1, 4000, (6, 20))
    out = rope(keys, positions)
    r = rope.layout.rotary_dim
    assert torch.equal(out[..., r:], keys[..., r:])
    assert not torch.allclose(out[..., :r], keys[..., :r])


def test_unknown_layout_falls_back_to_the_models_rope():
    """A RoPE of neither known pairing gets no layout, so the CUDA rebuild never guesses one: it rebuilds through
    the model's own function instead."""
    model = case_model("phi")
    rope = patch_model(model).rope

    class Reversed(type(rope)):  # a made-up pairing: the model's RoPE on the head's dims in reverse order
        def __call__(self, keys, positions):
            return super().__call__(keys.flip(-1), positions).flip(-1)

    odd = Reversed(rope.rotary_emb, rope.apply_rotary)
    assert odd.layout is None


def test_a_wrong_rule_for_layers_without_rope_raises(monkeypatch):
    """If a layer declared without RoPE (`WITHOUT_ROPE`, hf/architectures.py) rotates its keys after all, compressing
    it would rebuild keys without positions: the cache raises at prefill instead, and stays empty."""
    model = make_tiny_model("cohere")  # every layer rotates
    adapter = patch_model(model)
    monkeypatch.setattr(adapter, "without_rope", frozenset({0}))
    cache = ShadowKVCache(model, **exact_overrides())
    with pytest.raises(RuntimeError, match="expected a layer without RoPE"):
        forward_with(model, random_prompt(100), cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("length", [300, 301])
def test_full_budget_matches_dynamic_cache(variant, length, rebuilt_chunks):  # noqa: F811
    model = case_model(variant)
    ids = random_prompt(length, seed=length)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(model, **exact_overrides())
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)

    assert torch.equal(out.sequences, ref.sequences), (out.sequences[:, -NEW_TOKENS:], ref.sequences[:, -NEW_TOKENS:])
    assert_logits_close(out.logits, ref.logits)
    layers = compressed_layers(cache)
    assert len(layers) == (2 if case == "cohere2" else model.config.num_hidden_layers)

    # assert_full_selection_ran walks `cache.layers`; Cohere 2's sliding layers are exact, not compressed.
    missed = assert_full_selection_ran(SimpleNamespace(layers=[layer for _, layer in layers]), NEW_TOKENS - 1)
    assert rebuilt_chunks["chunks"] == missed > 0  # every miss went through the low-rank rebuild and RoPE
    assert cache.get_seq_length() == length + NEW_TOKENS - 1


def test_every_prompt_token_reachable_once(variant):
    """Left-padded rows: each real token is in exactly one of selectable chunk, outlier chunk or local window,
    and the rebuilt keys of the selectable chunks are the model's post-RoPE keys."""
    assert_left_padded_rows_reachable(case_model(variant), (300, 217, 50), exact_overrides(outlier_chunks=3))


def test_padded_rows_equal_rows_alone(variant):
    model = case_model(variant)
    rows = [random_prompt(300, seed=1)[0], random_prompt(211, seed=2)[0], random_prompt(40, seed=3)[0]]
    ids, mask = left_pad(rows)
    together = generate_with(
        model, ids, ShadowKVCache(model, **small_budget_overrides()), attention_mask=mask, max_new_tokens=NEW_TOKENS
    )
    for i, row in enumerate(rows):
        alone = generate_with(model, row[None], ShadowKVCache(model, **small_budget_overrides()), NEW_TOKENS)
        assert torch.equal(together.sequences[i, ids.shape[1] :], alone.sequences[0, len(row) :]), f"row {i}"
        assert_logits_close([step[i : i + 1] for step in together.logits], alone.logits)


def test_new_turn_after_compression_matches_dynamic_cache(variant):
    """A second `generate` appends a multi-token chat turn over the compressed prompt."""
    model = case_model(variant)
    ids, turn = random_prompt(300, seed=3), random_prompt(7, seed=4)
    caches = {"dynamic": dynamic_cache(model), "shadowkv": ShadowKVCache(model, **exact_overrides())}
    results = {}
    for name, cache in caches.items():
        first = generate_with(model, ids, cache, max_new_tokens=6)
        second = generate_with(model, torch.cat([first.sequences, turn], dim=1), cache, max_new_tokens=8)
        results[name] = (first, second)
    for out, ref in zip(results["shadowkv"], results["dynamic"]):
        assert torch.equal(out.sequences, ref.sequences)
        assert_logits_close(out.logits, ref.logits)
    layers = compressed_layers(caches["shadowkv"])
    assert layers and all(layer.is_compressed and layer.prompt.slots == 300 for _, layer in layers)


def test_small_budget_differs_from_full_budget(case):
    """The sparse path is really sparse for these layouts too: 4 chunks at rank 8 change the logits."""
    model = case_model(case)
    ids = random_prompt(300, seed=11)
    full = generate_with(model, ids, ShadowKVCache(model, **exact_overrides()), max_new_tokens=4)
    small = generate_with(model, ids, ShadowKVCache(model, **small_budget_overrides()), max_new_tokens=4)
    assert not torch.allclose(torch.stack(small.logits), torch.stack(full.logits), rtol=1e-4, atol=1e-5)


# Cohere 2 has sliding-window layers, whose prefix files are not available yet (as for Gemma 3).
@pytest.mark.parametrize("prefix_case", list(CASES))
def test_full_budget_prefix_file_matches_dynamic_cache(prefix_case, tmp_path):
    """A saved and loaded document + a question = DynamicCache on both (fused-QKV models included)."""
    model = case_model(prefix_case)
    document, question = random_prompt(240, seed=500)[0], random_prompt(6, seed=501)[0]
    ids = torch.cat([document, question])[None]
    ShadowKVCache.prefill(model, document, **exact_overrides()).save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    out = generate_with(model, ids, loaded, max_new_tokens=8)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=8)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)
    assert loaded.memory_report().hit_rate is not None  # selection and rebuild ran


@pytest.mark.parametrize("yakv_case", [c for c in CASES if c != "cohere2"])  # the reference quantises every layer
def test_yakv_full_budget_matches_the_quantised_reference(yakv_case):
    """YAKV keeps post-RoPE keys, so it needs no layout; it must still run on these attention modules (fused QKV,
    `layer_past`, partial rotary) and give the quantised-prompt reference."""
    model = case_model(yakv_case)
    ids = random_prompt(300, seed=5)
    cache = ShadowKVCache(model, **yakv())
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)
    ref_tokens, ref_logits = quantised_reference(model, ids, NEW_TOKENS)
    assert torch.equal(out.sequences[:, 300:], ref_tokens)
    assert_logits_close(out.logits, ref_logits)
    assert all(layer.is_compressed and layer.mode.sparse_steps == NEW_TOKENS - 1 for layer in cache.layers)


# -- the same on CUDA, where the key rebuild runs the kernel's layout-aware RoPE --------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_full_budget_exact_on_cuda(case, graphs):
    arch, overrides, layout, _ = CASES[case]
    model = make_tiny_model(arch, **overrides).cuda()
    ids = random_prompt(301).cuda()
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(model, cuda_graphs=graphs, **exact_overrides())
    got = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.sequences, ref.sequences)
    # CUDA SDPA kernels sum in another order than CPU ones: fp32 round-off reaches ~5e-5 on logits of ~3.
    assert_logits_close(got.logits, ref.logits, atol=1e-4)
    assert patch_model(model).rope.layout == layout  # the kernel path was open to every case
    for _, layer in compressed_layers(cache):
        assert layer.is_compressed and layer.mode.temporal.keys.is_cuda
        assert int(layer.mode.temporal.lookups) > int(layer.mode.temporal.hits)
    assert decoded_in_graphs(cache) == graphs  # a failed capture would have fallen back to eager silently
