"""Micro-batched prefill (`ShadowKVCache.prefill_batch`): rows prefilled a few at a time, decoded together.

A batch prefilled by micro batches must decode exactly as the same batch prefilled in one forward (all but the
last token, which `generate` then feeds): same compressed state, same logits, same greedy tokens. At full budget
and full rank both equal plain `generate` and `DynamicCache`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_logits_close,
    dynamic_cache,
    forward_with,
    full_budget_overrides,
    generate_with,
    left_pad,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)

from shadowkv_cache import PrefixCacheError, ShadowKVCache
from shadowkv_cache.hf import microbatch as microbatch_module
from shadowkv_cache.hf.microbatch import position_ids
from shadowkv_cache.policies import OracleTopK, Quest, SnapKV, StreamingLLM
from shadowkv_cache.shadowkv.prompt import CompressedPrompt

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

NEW_TOKENS = 10
# min_compress_len is 64 in every setting below: the 40-token row stays exact, the others are compressed.
SETTINGS = {
    "default": {"min_compress_len": 64},  # the paper's settings scaled to the model (rank 8, 256-token budget)
    "small": small_budget_overrides(),
    "full": full_budget_overrides(),
    "fp8 values": small_budget_overrides(value_format="fp8"),
}


def batch(lengths, seed=0):
    return left_pad([random_prompt(n, seed=seed + i)[0] for i, n in enumerate(lengths)])


def batched_prefill(model, ids, mask, **overrides) -> ShadowKVCache:
    """The reference: the same batch but its last token prefilled in one forward, positions as `generate` makes."""
    cache = ShadowKVCache(model, **overrides)
    head = mask[:, :-1]
    forward_with(model, ids[:, :-1], cache, attention_mask=head, position_ids=position_ids(head), logits_to_keep=1)
    return cache


def assert_same_state(cache: ShadowKVCache, ref: ShadowKVCache) -> None:
    for layer, expected in zip(cache.layers, ref.layers):
        assert layer.is_compressed == expected.is_compressed
        assert layer.get_seq_length() == expected.get_seq_length()
        if not layer.is_compressed:
            torch.testing.assert_close(layer.keys, expected.keys)
            continue
        got, want = layer.prompt, expected.prompt
        assert (got.slots, got.max_budget_chunks) == (want.slots, want.max_budget_chunks)
        for name in CompressedPrompt.ROW_FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.shape == b.shape, name
            if a.dtype == torch.bool or not a.is_floating_point():
                assert torch.equal(a, b), name
            elif name not in ("a", "b"):  # the factors are unique only up to signs; their product is checked below
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(
            torch.einsum("btr,brhd->bthd", got.a, got.b),
            torch.einsum("btr,brhd->bthd", want.a, want.b),
            atol=1e-4,
            rtol=1e-4,
        )

        # Compared decoded: a padded chunk may hold zero codes under another scale and still decode to zeros.
        def decoded(store):
            scales = store.scales[store.row_map] if store.scales is not None else None
            return store.codec.decode(store.data[store.row_map], scales, torch.float32)

        torch.testing.assert_close(decoded(got.values), decoded(want.values))
        for name, state in want.policy_state.items():
            torch.testing.assert_close(got.policy_state[name], state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("setting", SETTINGS)
def test_one_row_at_a_time_equals_a_batched_prefill(setting):
    model = tiny_model("llama")
    overrides = SETTINGS[setting]
    ids, mask = batch((300, 211, 40))
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **overrides)
    ref_cache = batched_prefill(model, ids, mask, **overrides)
    assert_same_state(cache, ref_cache)
    assert all(layer.is_compressed for layer in cache.layers)

    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, ref_cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)
    assert cache.layers[0].get_seq_length() == ids.shape[1] + NEW_TOKENS - 1

    if setting == "full":  # exact: the same as plain generate with ShadowKV, and as DynamicCache
        for plain_cache in (ShadowKVCache(model, **overrides), dynamic_cache(model)):
            plain = generate_with(model, ids, plain_cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
            assert torch.equal(out.sequences, plain.sequences)
            assert_logits_close(out.logits, plain.logits)


def test_micro_batches_of_two_mixing_compressed_and_exact_rows(monkeypatch):
    """3 rows by 2: the first micro batch compresses a long row next to an exact one, the second holds only an
    exact row (stored as an exact layer until the join puts it in the local window)."""
    model = tiny_model("qwen2")
    overrides = small_budget_overrides()
    ids, mask = batch((40, 300, 50), seed=5)
    parts_seen = []
    real_join = microbatch_module.join_parts

    def recording_join(cache, parts, *args, **kwargs):
        parts_seen.extend([layer.is_compressed for layer in part.layers] for part in parts)
        return real_join(cache, parts, *args, **kwargs)

    monkeypatch.setattr(microbatch_module, "join_parts", recording_join)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=2, **overrides)
    assert parts_seen == [[True, True], [False, False]]
    ref_cache = batched_prefill(model, ids, mask, **overrides)
    assert_same_state(cache, ref_cache)
    assert cache.layers[0].prompt.budget_chunks[[0, 2]].tolist() == [0, 0]

    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, ref_cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


@pytest.mark.parametrize("policy", [Quest, OracleTopK, SnapKV, StreamingLLM])
def test_other_policies_join_their_state(policy):
    """Policy state is padded over its chunk axis; each policy then selects as after a batched prefill."""
    model = tiny_model("llama")
    ids, mask = batch((300, 40, 211), seed=11)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, policy=policy(), **small_budget_overrides())
    ref_cache = batched_prefill(model, ids, mask, policy=policy(), **small_budget_overrides())
    for layer, expected in zip(cache.layers, ref_cache.layers):
        assert {k: v.shape for k, v in layer.prompt.policy_state.items()} == {
            k: v.shape for k, v in expected.prompt.policy_state.items()
        }
    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, ref_cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


def test_rows_all_too_short_stay_exact_and_equal_dynamic_cache():
    model = tiny_model("mistral")
    ids, mask = batch((50, 30, 61), seed=9)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=2, **small_budget_overrides())
    assert not any(layer.is_compressed for layer in cache.layers)
    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, dynamic_cache(model), attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


@pytest.mark.parametrize("mode", ["shadowkv", "yakv"])
def test_only_compressed_rows_stay_between_micro_batches(monkeypatch, mode):
    """When a micro batch starts, the earlier ones hold their compressed prompts only: no exact prompt token
    (no full K/V) and no decode state (ShadowKV's temporal cache, YAKV's held tokens)."""
    model = tiny_model("llama")
    parts, seen = [], []
    real_run = microbatch_module.run_prompt
    decode_state = "temporal" if mode == "shadowkv" else "held"

    def checking_run(model, ids, part, **kwargs):
        seen.append(
            [
                (layer.is_compressed, layer.keys.shape[2], getattr(layer.mode, decode_state))
                for p in parts
                for layer in p.layers
            ]
        )
        real_run(model, ids, part, **kwargs)
        parts.append(part)

    monkeypatch.setattr(microbatch_module, "run_prompt", checking_run)
    ids, mask = batch((300, 260, 280), seed=3)
    overrides = small_budget_overrides() if mode == "shadowkv" else {"mode": "yakv", "min_compress_len": 64}
    ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **overrides)
    assert seen == [[], [(True, 0, None)] * 2, [(True, 0, None)] * 4]


def test_value_stores_join_into_reused_pinned_memory(monkeypatch):
    """Stores of different chunk counts join row by row (reordered rows too); padding chunks are zero even in a
    reused pool block that held other data (a fake pin: the pool's bookkeeping, no CUDA)."""
    from shadowkv_cache.stores import pinned_pool
    from shadowkv_cache.stores.pinned_pool import PinnedPool
    from shadowkv_cache.stores.value_store import HostValueStore

    pool = PinnedPool(register=lambda t: None, unregister=lambda t: None)
    monkeypatch.setattr(pinned_pool, "pinned_pool", lambda: pool)
    gen = torch.Generator().manual_seed(0)
    first = HostValueStore(torch.randn((2, 2, 5, 4, 3), generator=gen), torch.arange(2))
    second = HostValueStore(torch.randn((2, 2, 3, 4, 3), generator=gen), torch.tensor([1, 1, 0]))  # repeated rows
    dirty = pool.allocate((5, 2, 5, 4, 3), torch.float32)
    dirty.fill_(float("nan"))
    del dirty  # its block returns to the pool, still full of NaN

    joined = HostValueStore.concat([first, second], pin=True)
    assert pool.pinned_bytes == pool.used_bytes == 2 << 20  # the dirty block, reused
    assert joined.data.shape == (5, 2, 5, 4, 3)
    assert torch.equal(joined.row_map, torch.arange(5))
    assert torch.equal(joined.data[:2], first.data)
    for row, stored in enumerate([1, 1, 0], start=2):
        assert torch.equal(joined.data[row, :, :3], second.data[stored])
        assert torch.equal(joined.data[row, :, 3:], torch.zeros((2, 2, 4, 3)))


def count_forwards(model) -> list:
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive int"),
        ({"micro_batch_size": 1.5}, "micro_batch_size must be a positive int"),
        ({"micro_batch_size": True}, "micro_batch_size must be a positive int"),
        ({"attention_mask": torch.ones((3, 10), dtype=torch.long)}, "attention_mask must have the shape"),
        ({"right_padded": True}, "left padding"),
        ({"input_ids": torch.ones((2, 1), dtype=torch.long)}, "too short"),
        ({"input_ids": torch.ones(5, dtype=torch.long)}, r"\[batch, length\] integer tensor"),
        ({"one_token_row": True}, "fewer than two real tokens"),
    ],
)
def test_bad_input_raises_before_the_model_runs(kwargs, match):
    model = tiny_model("llama")
    ids, mask = batch((120, 90))
    if kwargs.pop("right_padded", False):
        mask = mask.flip(-1)
    if kwargs.pop("one_token_row", False):
        mask[1] = 0
        mask[1, -1] = 1
    args = {"input_ids": ids, "attention_mask": mask, **kwargs}
    calls, handle = count_forwards(model)
    try:
        with pytest.raises(ValueError, match=match):
            ShadowKVCache.prefill_batch(model, **args, **small_budget_overrides())
    finally:
        handle.remove()
    assert calls == []


def test_generate_must_get_the_prefilled_ids_and_mask():
    model = tiny_model("llama")
    ids, mask = batch((120, 90), seed=7)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, **small_budget_overrides())
    other = ids.clone()
    other[1, -5] = (other[1, -5] % 100) + 1
    with pytest.raises(PrefixCacheError, match="row 1 differs first at slot"):
        generate_with(model, other, cache, attention_mask=mask, max_new_tokens=2)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, **small_budget_overrides())
    # Transformers >= 5.18 drops an all-ones mask before the cache sees it; 5.17 passes it on: refused either way.
    with pytest.raises(PrefixCacheError, match="attention_mask"):
        generate_with(model, ids, cache, attention_mask=torch.ones_like(mask), max_new_tokens=2)
    shifted = mask.clone()
    shifted[1, 30] = 0  # one more pad on the left of row 1
    cache = ShadowKVCache.prefill_batch(model, ids, mask, **small_budget_overrides())
    with pytest.raises(PrefixCacheError, match="differs from the one prefill_batch got"):
        generate_with(model, ids, cache, attention_mask=shifted, max_new_tokens=2)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, **small_budget_overrides())
    with pytest.raises(PrefixCacheError, match="batch of 4"):
        generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=2, do_sample=True, num_return_sequences=2)


@pytest.mark.slow
def test_smollm2_two_long_rows_one_at_a_time(smollm2):
    """Two rows of ~2K real tokens, prefilled one by one, at full budget and rank: the same greedy tokens as the
    same batch through plain batched `generate` with ShadowKV."""
    from shadowkv_cache.fidelity import natural_text_ids

    model, tokenizer = smollm2
    text = natural_text_ids(tokenizer, 4000)[0]
    ids, mask = left_pad([text[:2048], text[2048 : 2048 + 1800]])
    cfg = model.config
    overrides = dict(
        rank=cfg.num_key_value_heads * cfg.head_dim, sparse_budget=10**6, outlier_chunks=4, min_compress_len=1024
    )
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **overrides)
    assert all(layer.is_compressed for layer in cache.layers)
    assert cache.layers[0].prompt.budget_chunks.tolist() == [(2047 - 32) // 8 - 4, (1799 - 32) // 8 - 4]
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, **kwargs)
        plain = model.generate(ids, past_key_values=ShadowKVCache(model, **overrides), **kwargs)
    assert torch.equal(out, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_pinned_values_and_lower_peak_memory():
    """On CUDA: the joined store is pinned with its row map on the device, decoding equals a batched prefill,
    and one row at a time peaks lower than the batched prefill."""
    from helpers import make_tiny_model

    # A wide MLP, so that the prefill's activations (which micro batches shrink) outweigh the compressed state
    # (which both hold) as they do in real models; with the tiny default the join's transient copy dominates.
    model = make_tiny_model("llama", max_position_embeddings=8192, intermediate_size=4096).cuda()
    overrides = small_budget_overrides()
    ids, mask = batch((3000, 2500, 40, 2900), seed=13)

    def peak(fill):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cache = fill()
        torch.cuda.synchronize()
        return cache, torch.cuda.max_memory_allocated() - base

    cache, micro_peak = peak(lambda: ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **overrides))
    ref_cache, batched_peak = peak(lambda: batched_prefill(model, ids.cuda(), mask.cuda(), **overrides))
    print(f"peak prefill memory: {micro_peak / 2**20:.1f} MiB by rows, {batched_peak / 2**20:.1f} MiB batched")
    assert micro_peak < batched_peak
    for layer in cache.layers:
        store = layer.prompt.values
        assert store.data.is_pinned() and store.device_row_map(torch.device("cuda")).is_cuda
        assert layer.prompt.a.is_cuda and layer.mode.temporal.keys.is_cuda

    out = generate_with(model, ids.cuda(), cache, attention_mask=mask.cuda(), max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids.cuda(), ref_cache, attention_mask=mask.cuda(), max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits, atol=1e-4)


def test_yakv_mode_joins_like_a_batched_prefill():
    """Once refused: YAKV prompts prefilled a row at a time join into what a batched prefill holds."""
    model = tiny_model("llama")
    ids, mask = batch((300, 220))
    overrides = {"mode": "yakv", "min_compress_len": 64, "sparse_budget": 24}
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, **overrides)
    ref_cache = batched_prefill(model, ids, mask, **overrides)
    for layer, expected in zip(cache.layers, ref_cache.layers):
        assert torch.equal(layer.prompt.store.data, expected.prompt.store.data)
        assert torch.equal(layer.prompt.real, expected.prompt.real)
        torch.testing.assert_close(layer.prompt.local_keys, expected.prompt.local_keys)
    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, ref_cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)
