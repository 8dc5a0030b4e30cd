"""Quantised value offload (`value_format`): the store's round trip, exactness against a DynamicCache that
holds the same rounded values, padded batches, prefix files, memory accounting, and bad settings.

Legend: R rows, Hkv KV heads, C chunks, c chunk size, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    HEAD_DIM,
    assert_logits_close,
    dynamic_cache,
    forward_with,
    full_budget_overrides,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)

from shadowkv_cache import PrefixCacheError, ShadowKVCache, ShadowKVConfig
from shadowkv_cache.ops.gather_values import gather_values
from shadowkv_cache.stores.value_codecs import value_codec
from shadowkv_cache.stores.value_store import HostValueStore

QUANTISED = ["fp8", "higgs4"]
NEW_TOKENS = 10


def value_like(shape, seed=0) -> torch.Tensor:
    """Values with the spread of real ones: a heavy-tailed scale per vector, some all-zero (pad) vectors."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[:-1], generator=gen) * 2)[..., None]
    x[0, 0, 0] = 0  # a pad chunk
    return x


# -- the store --------------------------------------------------------------------------------------------------


def test_native_store_round_trip_is_exact():
    data = value_like((2, 3, 5, 4, 16))
    store = HostValueStore.offload(data, pin=False)
    assert torch.equal(store.read_rows(2, torch.device("cpu"), data.dtype).view_as(data), data)
    assert store.nbytes == data.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_store_round_trip_error_bound(dtype):
    """Each value is off by at most 2^-4 of itself (3 mantissa bits, round to nearest; covers the clamp of the
    bf16-rounded scale) or 2^-10 of its vector's scale (the subnormal step), plus the output dtype's rounding."""
    data = value_like((3, 2, 7, 8, 64)).to(dtype)
    store = HostValueStore.offload(data, pin=False, value_format="fp8")
    assert store.data.dtype == torch.float8_e4m3fn and store.data.shape == data.shape
    assert store.scales.dtype == torch.bfloat16 and store.scales.shape == data.shape[:-1]
    out = store.read_rows(3, torch.device("cpu"), dtype).view_as(data).float()
    x = data.float()
    scale = store.scales.float()[..., None]
    eps = torch.finfo(dtype).eps / 2  # the output's own rounding
    bound = (2**-4 * x.abs() + 2**-10 * scale) * (1 + eps) + eps * x.abs()
    assert bool(((out - x).abs() <= bound).all())
    assert torch.equal(out[0, 0, 0], torch.zeros_like(out[0, 0, 0]))  # zero vectors stay zero
    # The largest value of each vector maps to the top of the fp8 range: nothing of the range is wasted.
    top = store.data.float().abs().amax(-1)
    assert bool((top[x.abs().amax(-1) > 0] >= 416).all())  # 448 less one step below it
    rel = ((out - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))[x.norm(dim=-1) > 0]
    assert float(rel.mean()) < 0.03  # ~2^-4/sqrt(3)/2 for uniform rounding in each binade


@pytest.mark.parametrize("head_dim", [64, 128])
def test_higgs4_store_round_trip_error_matches_the_grid(head_dim):
    """The relative squared error of a vector is about the grid's distortion on N(0, 1) (the rotated, rescaled
    coordinates are close to it), whatever the vector's scale; zero vectors stay zero."""
    data = value_like((2, 4, 16, 8, head_dim))
    store = HostValueStore.offload(data, pin=False, value_format="higgs4")
    assert store.data.dtype == torch.uint8 and store.data.shape == (*data.shape[:-1], head_dim // 2)
    assert store.scales.dtype == torch.float16 and store.scales.shape == data.shape[:-1]
    out = store.read_rows(2, torch.device("cpu"), torch.float32).view_as(data)
    norm = data.norm(dim=-1)
    rel = ((out - data).norm(dim=-1) / norm.clamp_min(1e-30)).square()[norm > 0]
    expected = store.codec.quantizer.expected_distortion
    assert 0.8 * expected <= float(rel.mean()) <= 1.25 * expected, (float(rel.mean()), expected)
    assert float(rel.max()) < 10 * expected  # no vector is lost (a wrong code or norm costs ~1)
    assert torch.equal(out[0, 0, 0], torch.zeros_like(out[0, 0, 0]))


@pytest.mark.parametrize("value_format", QUANTISED)
def test_quantised_store_counts_its_real_bytes(value_format):
    data = value_like((2, 3, 5, 8, 64))
    store = HostValueStore.offload(data, pin=False, value_format=value_format)
    bits = value_codec(value_format, 64).bits_per_value(torch.bfloat16)
    assert store.nbytes == data.numel() * bits / 8
    assert store.nbytes == store.data.nbytes + store.scales.nbytes


@pytest.mark.parametrize("value_format", QUANTISED)
def test_gather_twin_decodes_through_row_map(value_format):
    data = value_like((3, 2, 11, 4, 16))
    store = HostValueStore.offload(data, pin=False, value_format=value_format).select_rows(torch.tensor([2, 0]))
    decoded = store.codec.decode(store.data, store.scales, torch.float32)  # [R, Hkv, C, c, D]
    ids = torch.randint(0, 11, (2, 2, 7))
    miss = torch.rand(2, 2, 7) < 0.5
    values = torch.full((2, 2, 7, 4, 16), 7.0)
    gather_values(values, ids, miss, store)
    rows = torch.tensor([2, 0])
    for b in range(2):
        for h in range(2):
            for k in range(7):
                expected = decoded[rows[b], h, ids[b, h, k]] if miss[b, h, k] else torch.full((4, 16), 7.0)
                torch.testing.assert_close(values[b, h, k], expected)  # higgs4: a matmul of another size


# -- the cache ---------------------------------------------------------------------------------------------------


def dynamic_reference(model, ids, steps: int, cache: ShadowKVCache | None = None) -> tuple[torch.Tensor, float]:
    """Teacher-forced logits `[steps+1, V]` of a `DynamicCache` prefilled with `ids[:, :-steps]` and fed the rest.

    With `cache`, its prompt values in `cache`'s selectable chunks are replaced after prefill by what `cache`'s
    store decodes to; outliers and the local window stay exact, as in ShadowKV. Also returns the relative RMS
    error `||decoded - exact|| / ||exact||` over the replaced values (0 without `cache`).
    """
    ref = dynamic_cache(model)
    out = forward_with(model, ids[:, : ids.shape[1] - steps], ref)
    logits, err, norm = [out.logits[:, -1]], 0.0, 0.0
    for dyn, layer in zip(ref.layers, cache.layers if cache is not None else []):
        prompt, store = layer.prompt, layer.prompt.values
        decoded = store.codec.decode(store.data, store.scales, dyn.values.dtype)  # [1, Hkv, C, c, D]
        _, heads, chunks, c, dim = decoded.shape
        start = prompt.slots - (prompt.positions.shape[1] + prompt.local_keys.shape[2])  # 0 for one row
        span = dyn.values[:, :, start : start + chunks * c].view(1, heads, chunks, c, dim)
        keep = prompt.selectable[..., None, None]
        err += ((decoded - span) * keep).pow(2).sum().item()
        norm += (span * keep).pow(2).sum().item()
        span.copy_(torch.where(keep, decoded, span))
    for t in range(ids.shape[1] - steps, ids.shape[1]):
        logits.append(forward_with(model, ids[:, t : t + 1], ref).logits[:, -1])
    return torch.cat(logits), (err / norm) ** 0.5 if norm else 0.0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("value_format", QUANTISED)
def test_full_budget_equals_dynamic_cache_with_the_same_rounded_values(arch, value_format):
    """At full rank and budget the only approximation left is the value format: ShadowKV must then equal a
    DynamicCache holding the same decoded values, to fp32 round-off, and stay close to the exact one."""
    model = tiny_model(arch)
    prompt = random_prompt(301)
    cache = ShadowKVCache(model, **full_budget_overrides(value_format=value_format))
    out = generate_with(model, prompt, cache, max_new_tokens=NEW_TOKENS)
    assert all(layer.is_compressed and layer.prompt.values.codec.name == value_format for layer in cache.layers)
    got, tokens = torch.cat(out.logits), out.sequences[:, :-1]

    rounded, value_error = dynamic_reference(model, tokens, NEW_TOKENS - 1, cache)
    torch.testing.assert_close(got, rounded, rtol=1e-4, atol=1e-4)

    exact, _ = dynamic_reference(model, tokens, NEW_TOKENS - 1)
    assert_drift_sized_by(got, exact, value_error, value_format)
    if value_format == "fp8":  # 4-bit values may flip a near tie of these random models' logits
        greedy = generate_with(model, prompt, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
        assert torch.equal(out.sequences, greedy.sequences)


# The bound: a convex combination of values (attention) is off by at most the values' relative error, and the
# nearly linear layers after it move the logits by about that share of their spread. So the RMS logit drift
# against exact values (same tokens) should be about the measured relative RMS value error times the logits'
# std; 2x allows for the amplification through the layers (measured on these tiny models: fp8 1.1-1.7x,
# higgs4 ~1.3x, of value errors ~0.018 and ~0.09). A wrong fetch or decode moves logits by whole units.
VALUE_ERROR = {"fp8": (0.01, 0.03), "higgs4": (0.07, 0.12)}  # plausible relative RMS value error per format


def assert_drift_sized_by(got: torch.Tensor, exact: torch.Tensor, value_error: float, value_format: str) -> None:
    low, high = VALUE_ERROR[value_format]
    assert low <= value_error <= high, value_error
    rms = (got - exact).pow(2).mean().sqrt().item()
    assert 0 < rms <= 2 * value_error * exact.std().item(), (rms, value_error, exact.std().item())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_left_padded_rows_match_rows_alone(arch):
    model = tiny_model(arch)
    overrides = small_budget_overrides(value_format="fp8")
    rows = [random_prompt(n, seed=i)[0] for i, n in enumerate((300, 211, 40))]
    ids, mask = left_pad(rows)
    batch = generate_with(model, ids, ShadowKVCache(model, **overrides), attention_mask=mask, max_new_tokens=8)
    for i, row in enumerate(rows):
        alone = generate_with(model, row[None], ShadowKVCache(model, **overrides), max_new_tokens=8)
        assert torch.equal(batch.sequences[i, ids.shape[1] :], alone.sequences[0, len(row) :]), f"row {i}"
        assert_logits_close([step[i : i + 1] for step in batch.logits], alone.logits)


@pytest.mark.parametrize("value_format", QUANTISED)
def test_multi_token_step_decodes_the_whole_prompt(value_format):
    """A new turn reads every chunk from the store (the whole-prompt step) and must decode it too."""
    model = tiny_model("mistral")
    prompt, turn = random_prompt(300), random_prompt(5, seed=9)
    cache = ShadowKVCache(model, **full_budget_overrides(value_format=value_format))
    first = generate_with(model, prompt, cache, max_new_tokens=4)
    ids = torch.cat([first.sequences, turn], dim=1)
    second = generate_with(model, ids, cache, max_new_tokens=4)
    # Teacher-forced on the same tokens: the first turn, then the whole new turn as one step, then one by one.
    ref = dynamic_cache(model)
    forward_with(model, first.sequences[:, :-1], ref)
    logits = [forward_with(model, ids[:, first.sequences.shape[1] - 1 :], ref).logits[:, -1]]
    for t in range(ids.shape[1], second.sequences.shape[1] - 1):
        logits.append(forward_with(model, second.sequences[:, t : t + 1], ref).logits[:, -1])
    got, exact = torch.cat(second.logits), torch.cat(logits)
    rms = (got - exact).pow(2).mean().sqrt().item()
    high = VALUE_ERROR[value_format][1]
    assert 0 < rms <= 2 * high * exact.std().item(), rms  # > 0: the decoded values were really used


def test_memory_report_counts_quantised_host_bytes():
    model = tiny_model("llama")
    prompt = random_prompt(301)
    native = ShadowKVCache(model, **small_budget_overrides())
    fp8 = ShadowKVCache(model, **small_budget_overrides(value_format="fp8"))
    forward_with(model, prompt, native)
    forward_with(model, prompt, fp8)
    a, b = native.memory_report(), fp8.memory_report()
    assert a.gpu_bytes == b.gpu_bytes  # only the host side changes
    # fp32 values are 32 bits; fp8 codes plus a bf16 scale per 16-value vector are 8 + 16/16 = 9 bits.
    assert b.host_bytes * 32 == a.host_bytes * (8 + 16 / HEAD_DIM)


# -- prefix files ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_format", QUANTISED)
def test_prefix_round_trip_keeps_the_encoded_values(tmp_path, value_format):
    model = tiny_model("llama")
    document, question = random_prompt(240, seed=500)[0], random_prompt(6, seed=501)[0]
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides(value_format=value_format))
    doc.save_prefix(tmp_path / "doc.safetensors")
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    assert loaded.config.value_format == value_format
    for a, b in zip(doc.layers, loaded.layers):
        assert a.prompt.values.data.dtype == b.prompt.values.data.dtype
        assert torch.equal(a.prompt.values.data.view(torch.uint8), b.prompt.values.data.view(torch.uint8))
        assert torch.equal(a.prompt.values.scales, b.prompt.values.scales)
    ids = torch.cat([document, question])[None]
    original = generate_with(model, ids, doc.fork(), max_new_tokens=8)
    again = generate_with(model, ids, loaded, max_new_tokens=8)
    assert torch.equal(again.sequences, original.sequences)
    assert_logits_close(again.logits, original.logits, rtol=0, atol=0)

    with pytest.raises(PrefixCacheError, match=f"value_format: '{value_format}' in the file, 'native' here"):
        ShadowKVCache.load_prefix(make_tiny_model("llama"), tmp_path / "doc.safetensors", value_format="native")


def test_prefix_with_another_codec_is_refused(tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from shadowkv_cache.prefix import METADATA_KEY

    model = tiny_model("llama")
    src, dst = tmp_path / "doc.safetensors", tmp_path / "other.safetensors"
    ShadowKVCache.prefill(model, random_prompt(240)[0], **small_budget_overrides(value_format="fp8")).save_prefix(src)
    with safe_open(src, framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    meta["value_codec"]["head_dim"] = 32
    save_file(tensors, dst, metadata={METADATA_KEY: json.dumps(meta)})
    with pytest.raises(PrefixCacheError, match="stores values encoded as"):
        ShadowKVCache.load_prefix(model, dst)


# -- bad settings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["int3", "FP8", "bf16", None, 8])
def test_unknown_value_format_is_refused(bad):
    with pytest.raises(ValueError, match="ShadowKVConfig.value_format=.*use one of 'native', 'fp8'"):
        ShadowKVConfig(value_format=bad)
    model = make_tiny_model("llama", seed=7)
    with pytest.raises(ValueError, match="value_format"):
        ShadowKVCache(model, value_format=bad)


def test_higgs4_needs_a_power_of_two_head_dim():
    model = make_tiny_model("llama", seed=7, head_dim=24, hidden_size=96)
    with pytest.raises(ValueError, match="value_format='higgs4' needs a power-of-two head dim.*this model's is 24"):
        ShadowKVCache(model, value_format="higgs4")
    ShadowKVCache(model, value_format="fp8")  # fp8 takes any head dim


# -- the real model --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_smollm2_fidelity_per_value_format(smollm2, smollm2_reference):
    """SmolLM2 at 3K tokens, the default budget (rank 32, 256 tokens, 4 outliers), teacher-forced for 48 steps
    against its own DynamicCache, with each value format.

    Measured on CPU (fp32): top-1 agreement 0.918 for all three; mean KL 0.0693 (native), 0.0695 (fp8), 0.0763
    (higgs4). At full rank and budget (the value format alone): agreement 1.000 for both, KL 4e-5 (fp8) and
    6.4e-4 (higgs4). The floors sit just under: fp8 costs next to nothing, 4-bit a little KL."""
    from shadowkv_cache.fidelity import natural_text_ids, teacher_forced_logits

    model, tokenizer = smollm2
    prompt, steps = 3072, 48
    ids = natural_text_ids(tokenizer, prompt + steps)
    full = smollm2_reference(ids, prompt, 16).logits  # shared with test_smollm2's default-budget fidelity
    log_p = full.log_softmax(-1)
    measured = {}
    for value_format in ("native", "fp8", "higgs4"):
        test = teacher_forced_logits(model, ids, prompt, ShadowKVCache(model, min_compress_len=2048,
                                                                       value_format=value_format))  # fmt: skip
        agreement = (full.argmax(-1) == test.argmax(-1)).float().mean().item()
        kl = (log_p.exp() * (log_p - test.log_softmax(-1))).sum(-1).mean().item()
        measured[value_format] = (agreement, kl)
    print(f"SmolLM2 3K default budget, (agreement, mean KL) per value format: {measured}")
    assert all(agreement >= 0.89 for agreement, _ in measured.values())
    native_kl = measured["native"][1]
    assert measured["fp8"][1] <= native_kl + 0.003
    assert measured["higgs4"][1] <= native_kl + 0.015
