"""Batches with left padding (design.md §5): each row gets what it would get alone; pads are never selected.

The budget here is small (4 of ~35 chunks per head, rank 8 of 32), so rows really are approximated, and
the comparison is row-in-batch against the same row alone with its own fresh cache and the same settings.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHS,
    assert_logits_close,
    dynamic_cache,
    full_budget_overrides,
    generate_with,
    left_pad,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)

from shadowkv_cache import ShadowKVCache, ShadowKVConfig
from shadowkv_cache.shadowkv.temporal_cache import TemporalCache

# One row shorter than min_compress_len (64), so compressed and exact rows mix.
LENGTHS = (300, 211, 40)
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


@pytest.fixture
def selections(monkeypatch):
    """Records `(temporal cache, chunk ids [B, Hkv, K] it holds)` after every refresh."""
    seen: list[tuple[TemporalCache, torch.Tensor]] = []
    original = TemporalCache.refresh

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self, self.ids.clone()))

    monkeypatch.setattr(TemporalCache, "refresh", recording)
    return seen


def rows_of(lengths, seed=0):
    return [random_prompt(n, seed=seed + i)[0] for i, n in enumerate(lengths)]


def test_left_padded_rows_match_rows_alone(model, selections):
    overrides = small_budget_overrides()
    rows = rows_of(LENGTHS)
    ids, mask = left_pad(rows)
    width = ids.shape[1]
    cache = ShadowKVCache(model, **overrides)
    batch = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    batch_selections = list(selections)

    for i, row in enumerate(rows):
        alone = generate_with(model, row[None], ShadowKVCache(model, **overrides), max_new_tokens=NEW_TOKENS)
        assert torch.equal(batch.sequences[i, width:], alone.sequences[0, len(row) :]), f"row {i}"
        assert_logits_close([step[i : i + 1] for step in batch.logits], alone.logits)

    # The ShadowKV path really ran, on the long rows only.
    config = ShadowKVConfig(**overrides)
    sizes = [config.resolve(n, 32) for n in LENGTHS]
    assert [s.num_chunks > 0 for s in sizes] == [True, True, False]
    assert len(batch_selections) == len(cache.layers) * (NEW_TOKENS - 1)
    for layer in cache.layers:
        assert layer.is_compressed
        assert layer.get_seq_length() == width + NEW_TOKENS - 1  # lengths reported to generate include pads
        assert layer.prompt.budget_chunks.tolist() == [s.budget_chunks for s in sizes]

    # Pads are never selected: every held chunk is a real, selectable chunk of its own row, at every step.
    selectable_of = {id(layer.mode.temporal): layer.prompt.selectable for layer in cache.layers}
    for step, (temporal, ids_held) in enumerate(batch_selections):
        selectable = selectable_of[id(temporal)]
        for row, size in enumerate(sizes):
            held = ids_held[row]
            if size.num_chunks == 0:
                assert (held == -1).all(), f"step {step}: exact row {row} selected {held}"
                continue
            assert (held >= 0).sum(dim=-1).tolist() == [size.budget_chunks] * held.shape[0]
            assert int(held.max()) < size.num_chunks, f"step {step}: row {row} selected a padding chunk"
            for head in range(held.shape[0]):
                real = held[head][held[head] >= 0]
                assert selectable[row, head, real].all(), f"step {step}: row {row} head {head} picked an outlier"


def test_padding_chunks_are_never_selectable():
    model = tiny_model("llama")
    overrides = small_budget_overrides()
    rows = rows_of(LENGTHS, seed=10)
    ids, mask = left_pad(rows)
    cache = ShadowKVCache(model, **overrides)
    generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=2)
    config = ShadowKVConfig(**overrides)
    for layer in cache.layers:
        prompt = layer.prompt
        for row, n in enumerate(LENGTHS):
            size = config.resolve(n, 32)
            chunk_tokens = size.num_chunks * config.chunk_size
            # Chunks start at the row's first real token (position 0), whatever the padding before it.
            assert prompt.positions[row, :chunk_tokens].tolist() == list(range(chunk_tokens))
            assert not prompt.selectable[row, :, size.num_chunks :].any()
            assert prompt.selectable[row].sum(dim=-1).tolist() == [size.num_chunks - size.outliers] * 2
            assert int(prompt.outlier_valid[row].sum()) == size.outliers * config.chunk_size
            assert int(prompt.local_valid[row].sum()) == size.local
            assert size.num_chunks * config.chunk_size + size.local == n


def test_left_padded_batch_at_full_budget_matches_dynamic_cache():
    model = tiny_model("qwen2")
    ids, mask = left_pad(rows_of(LENGTHS, seed=20))
    ref = generate_with(model, ids, dynamic_cache(model), attention_mask=mask)
    out = generate_with(model, ids, ShadowKVCache(model, **full_budget_overrides()), attention_mask=mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


def test_right_padding_raises_and_says_left_padding():
    model = tiny_model("llama")
    rows = rows_of((200, 150), seed=30)
    ids = torch.zeros((2, 200), dtype=torch.long)
    mask = torch.zeros((2, 200), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    with pytest.raises(NotImplementedError, match="left padding"):
        generate_with(model, ids, ShadowKVCache(model, **small_budget_overrides()), attention_mask=mask)


def test_temporal_cache_counts_go_on_after_rows_are_selected():
    """`hits` and `lookups` derive from the scan's counts (misses, steps) and the counts of the rows a cache came
    from: selecting rows keeps what was counted and counts on with the selected rows' lookups per step; a reset zeroes
    both."""
    ids = torch.full((3, 2, 4), -1, dtype=torch.int64)
    valid = torch.ones(3, 2, 4, dtype=torch.bool)
    keys = torch.zeros(3, 2, 4, 2, 8)
    cache = TemporalCache(ids, keys, keys.clone(), valid)
    cache.counts += torch.tensor([5, 2])  # 2 steps of 24 lookups, 5 misses
    assert (int(cache.lookups), int(cache.hits)) == (48, 43)
    rows = cache.select_rows(torch.tensor([0, 2]))
    assert (int(rows.lookups), int(rows.hits)) == (48, 43)
    rows.counts += torch.tensor([3, 1])  # a step of the 2 rows: 16 lookups, 3 misses
    assert (int(rows.lookups), int(rows.hits)) == (64, 56)
    rows.reset_counts()
    assert (int(rows.lookups), int(rows.hits)) == (0, 0)
