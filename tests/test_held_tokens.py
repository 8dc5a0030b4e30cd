"""YAKV's token reuse (`yakv/held_tokens.py`): tokens selected at the previous step stay on the device, only new ones
are fetched, and the outputs are those of fetching every selected token at every step.

Legend: B batch, Hkv KV heads, N stored tokens, K slots, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from helpers import HEAD_DIM, NUM_KV_HEADS, forward_with, generate_with, left_pad, random_prompt, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import StoppingCriteria, StoppingCriteriaList

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.ops.gather_dequant import gather_dequant, gather_dequant_missed
from shadowkv_cache.quant import HiggsQuantizer
from shadowkv_cache.stores.quantized_store import QuantizedKVStore, pack_records
from shadowkv_cache.yakv.held_tokens import HeldTokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DIM = 16


def random_store(rows: int, heads: int, num: int, quantizer: HiggsQuantizer) -> QuantizedKVStore:
    keys, values = torch.randn(rows, heads, num, quantizer.head_dim), torch.randn(rows, heads, num, quantizer.head_dim)
    records = pack_records(quantizer.quantize(keys), quantizer.quantize(values))
    return QuantizedKVStore.offload(records, pin=False)


def test_gather_dequant_missed_writes_only_the_missed_slots():
    torch.manual_seed(0)
    quantizer = HiggsQuantizer(DIM, 2)
    store = random_store(2, 3, 40, quantizer).select_rows(torch.tensor([1, 0]))
    ids = torch.randint(0, 40, (2, 3, 9))
    ids[0, 1, 4] = -1  # an empty slot, never missed
    missed = torch.rand(2, 3, 9) < 0.5
    missed[0, 1, 4] = False
    keys, values = torch.full((2, 3, 9, DIM), 7.0), torch.full((2, 3, 9, DIM), -7.0)
    gather_dequant_missed(store, ids, missed, quantizer, keys, values)
    fresh_keys, fresh_values = gather_dequant(store, ids.clamp(min=0), quantizer, torch.float32)
    torch.testing.assert_close(keys[missed], fresh_keys[missed], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values[missed], fresh_values[missed], rtol=1e-6, atol=1e-6)
    assert keys[~missed].eq(7.0).all() and values[~missed].eq(-7.0).all()


@settings(max_examples=40, deadline=None)
@given(
    slots=st.integers(1, 8),
    steps=st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 8)), min_size=1, max_size=6),
)
def test_held_tokens_hold_exactly_the_selection_and_fetch_only_new_tokens(slots, steps):
    """After each refresh the slots hold this step's valid selection (as a set, per row and head) with its
    dequantised keys and values; it fetched the selected tokens that were not held before, and no other."""
    batch, heads, num = 2, 2, 12
    quantizer = HiggsQuantizer(DIM, 2)
    store = random_store(batch, heads, num, quantizer)
    held = HeldTokens.empty((batch, heads, slots, DIM), torch.float32, torch.device("cpu"))
    before: list[set[int]] = [set() for _ in range(batch * heads)]
    fetched = lookups = 0
    for step, (seed, count) in enumerate(steps, 1):
        gen = torch.Generator().manual_seed(seed)
        wanted = torch.stack([torch.randperm(num, generator=gen)[:slots] for _ in range(batch * heads)])
        wanted = wanted.view(batch, heads, slots)
        valid = torch.arange(slots) < min(count, slots)
        valid = valid.expand(batch, heads, slots) & (torch.rand(batch, heads, 1, generator=gen) < 0.8)
        misses_before = int(held.counts[0])
        held.refresh(wanted, valid, store, quantizer)
        new = int(held.counts[0]) - misses_before

        keys, values = gather_dequant(store, held.ids.clamp(min=0), quantizer, torch.float32)
        mask = held.held
        # Equal up to float32 round-off: the inverse rotation is a matmul over another batch shape.
        torch.testing.assert_close(held.keys[mask], keys[mask], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(held.values[mask], values[mask], rtol=1e-6, atol=1e-6)
        fetched_before = fetched
        for i, (ids, want, ok) in enumerate(zip(held.ids.flatten(0, 1), wanted.flatten(0, 1), valid.flatten(0, 1))):
            now = set(want[ok].tolist())
            assert set(ids[ids >= 0].tolist()) == now and int((ids >= 0).sum()) == len(now)
            fetched += len(now - before[i])
            lookups += len(now)
            before[i] = now
        misses, refreshes, counted, host = held.totals(mirrored=False).tolist()
        assert new == fetched - fetched_before and counted == lookups and misses == host == fetched
        assert refreshes == step  # the scan counted itself


@pytest.mark.parametrize("policy", ["per head", "shared budget"])
def test_reuse_changes_the_bytes_not_the_outputs(policy):
    """Greedy decoding with held tokens against the same cache made to forget them before every step (so every
    selected token is fetched again): the same tokens and logits; with reuse, fewer bytes. A shared budget is
    fetched afresh at every step, its valid entries only."""
    from shadowkv_cache.policies import QuantizedKeyTopK, SharedBudgetTopK

    model = tiny_model("llama")
    ids = random_prompt(300, seed=61)
    overrides = {"mode": "yakv", "sparse_budget": 24, "min_compress_len": 64}

    def decode(forget: bool) -> tuple[list[torch.Tensor], ShadowKVCache]:
        chosen = QuantizedKeyTopK() if policy == "per head" else SharedBudgetTopK()
        cache = ShadowKVCache(model, policy=chosen, **overrides)
        logits = [forward_with(model, ids, cache).logits[:, -1]]
        for _ in range(10):
            if forget:
                for layer in cache.layers:
                    layer.drop_decode_state()
            logits.append(forward_with(model, logits[-1].argmax(-1, keepdim=True), cache).logits[:, -1])
        return logits, cache

    with torch.no_grad():
        reused, cache = decode(forget=False)
        fetched_again, again = decode(forget=True)
    assert [t.argmax(-1).item() for t in reused] == [t.argmax(-1).item() for t in fetched_again]
    for got, want in zip(reused, fetched_again):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the order of the softmax sums differs
    record = 2 * HEAD_DIM // 2 + 4
    everything = 10 * 24 * NUM_KV_HEADS * record  # every selected token at every one of the 10 steps
    for with_reuse, without in zip(cache.layers, again.layers):
        assert without.mode.fetched_bytes == everything
        if policy == "shared budget":  # heads hold different counts: the valid selection is fetched every step
            assert with_reuse.mode.hit_counts() is None and with_reuse.mode.fetched_bytes == everything
            continue
        hits, lookups = with_reuse.mode.hit_counts()
        assert lookups == 10 * 24 * NUM_KV_HEADS and hits > 0
        assert with_reuse.mode.fetched_bytes == (lookups - hits) * record < everything


class ForgetHeldTokens(StoppingCriteria):
    """Never stops; after every step drops each layer's held tokens, so the next step fetches its whole selection."""

    def __init__(self, cache: ShadowKVCache):
        self.cache = cache

    def __call__(self, input_ids, scores, **kwargs):
        for layer in self.cache.layers:
            layer.drop_decode_state()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_beam_search_reorders_the_held_tokens_with_their_rows():
    """Beam search reorders the cache's rows at every step; the held tokens must follow their rows (two documents, so
    a row holding another row's tokens would attend to the wrong keys and values). The search with reuse equals the
    one that fetches every selection afresh (same beams, scores within float32 round-off)."""
    model = tiny_model("llama")
    ids, mask = left_pad([random_prompt(300, seed=62)[0], random_prompt(280, seed=63)[0]])
    overrides = {"mode": "yakv", "sparse_budget": 24, "min_compress_len": 64}
    reused_cache, fresh_cache = ShadowKVCache(model, **overrides), ShadowKVCache(model, **overrides)
    options = dict(attention_mask=mask, num_beams=3, num_return_sequences=2, max_new_tokens=8, output_scores=True)
    reused = generate_with(model, ids, reused_cache, **options)
    forget = StoppingCriteriaList([ForgetHeldTokens(fresh_cache)])
    fresh = generate_with(model, ids, fresh_cache, stopping_criteria=forget, **options)
    assert torch.equal(reused.sequences, fresh.sequences)
    torch.testing.assert_close(reused.sequences_scores, fresh.sequences_scores, rtol=1e-5, atol=1e-5)
    assert reused_cache.layers[0].mode.held.ids.shape[0] == 6  # one row of slots per beam
    hits, lookups = reused_cache.layers[0].hit_counts()
    assert 0 < hits < lookups


def test_held_tokens_restored_by_a_rollback_are_not_counted_twice():
    """A call that fails restores the mode's attributes as they were, held tokens included, then drops them: what
    they counted is banked once, so the counters after the rollback are those before the failed call."""
    model = tiny_model("llama")
    cache = ShadowKVCache(model, mode="yakv", sparse_budget=24, min_compress_len=64)
    with torch.no_grad():
        logits = forward_with(model, random_prompt(300, seed=64), cache).logits[:, -1]
        for _ in range(3):
            logits = forward_with(model, logits.argmax(-1, keepdim=True), cache).logits[:, -1]
    mode = cache.layers[0].mode
    before = (mode.hit_counts(), mode.fetched_bytes, mode.sparse_steps)
    assert before[0][1] == 3 * 24 * NUM_KV_HEADS and before[2] == 3
    saved = dict(vars(mode))
    mode.drop_decode_state()  # the failed call dropped (banked) the held tokens ...
    vars(mode).update(saved)  # ... the rollback restores them ...
    mode.drop_decode_state()  # ... and drops them again
    assert (mode.hit_counts(), mode.fetched_bytes, mode.sparse_steps) == before
