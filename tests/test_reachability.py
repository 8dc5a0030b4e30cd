"""Nothing of the prompt is ever dropped (design.md §6): every real token stays reachable, exactly once.

After compression each real prompt token of a row is, per KV head, in exactly one of: a selectable chunk
(keys rebuilt from `A·B` + RoPE, values in the host store), an outlier chunk (exact on the device) or the
local window (exact on the device). At full rank the rebuilt keys equal the true post-RoPE keys.

Legend: B batch, Hkv KV heads, S prompt slots, n real tokens of a row, D head dim, c chunk size, C chunks.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    ARCHS,
    HEAD_DIM,
    KEY_DIM,
    NUM_KV_HEADS,
    assert_every_token_reachable_once,
    assert_left_padded_rows_reachable,
    full_budget_overrides,
    tiny_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shadowkv_cache import LandmarkTopK, ShadowKVConfig, patch_model
from shadowkv_cache.shadowkv.prompt import compress_prompt


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lengths", [(300,), (300, 217, 50)], ids=["one-row", "left-padded"])
def test_prefill_keeps_every_prompt_token_reachable(arch, lengths):
    overrides = full_budget_overrides(outlier_chunks=3)
    cache = assert_left_padded_rows_reachable(tiny_model(arch), lengths, overrides)
    assert all(layer.is_compressed for layer in cache.layers)
    config = ShadowKVConfig(**overrides)
    for n in lengths:
        if n < config.min_compress_len:  # a short row is held whole in the local window
            size = config.resolve(n, KEY_DIM)
            assert size.num_chunks == 0 and size.local == n


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    lengths=st.lists(st.integers(1, 160), min_size=1, max_size=3),
    chunk_size=st.integers(1, 12),
    local_window=st.integers(0, 40),
    outliers=st.one_of(st.none(), st.integers(0, 12), st.floats(0.0, 0.9)),
    min_compress_len=st.integers(1, 80),
    seed=st.integers(0, 2**16),
)
def test_compress_prompt_covers_every_token_once(lengths, chunk_size, local_window, outliers, min_compress_len, seed):
    """Property: for any sizes, `compress_prompt` keeps each real token reachable exactly once, pads never."""
    rope = patch_model(tiny_model("llama")).rope
    config = ShadowKVConfig(
        rank=KEY_DIM,
        chunk_size=chunk_size,
        sparse_budget=10**6,
        outlier_chunks=outliers,
        local_window=local_window,
        min_compress_len=min_compress_len,
    )
    gen = torch.Generator().manual_seed(seed)
    batch, width = len(lengths), max(lengths)
    keys_pre = torch.randn((batch, NUM_KV_HEADS, width, HEAD_DIM), generator=gen)
    values = torch.randn((batch, NUM_KV_HEADS, width, HEAD_DIM), generator=gen)
    real = torch.arange(width)[None] >= torch.tensor([width - n for n in lengths])[:, None]  # left padding
    positions = (real.cumsum(-1) - 1).clamp(min=0)
    keys = rope(keys_pre.flatten(0, 1), positions.repeat_interleave(NUM_KV_HEADS, 0)).view_as(keys_pre)

    prompt = compress_prompt(keys_pre, keys, values, positions, real, config, LandmarkTopK())

    sizes = [config.resolve(n, KEY_DIM) for n in lengths]
    if all(s.num_chunks == 0 for s in sizes):
        assert prompt is None  # no row long enough: the layer stays exact
        return
    assert prompt is not None and prompt.slots == width
    assert prompt.budget_chunks.tolist() == [s.num_chunks - s.outliers for s in sizes]
    for row, n in enumerate(lengths):
        start = width - n
        assert_every_token_reachable_once(prompt, row, keys[row, :, start:], values[row, :, start:], config, rope)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    n=st.integers(0, 5000),
    chunk_size=st.integers(1, 64),
    local_window=st.integers(0, 300),
    min_compress_len=st.integers(1, 4096),
    rank=st.one_of(st.none(), st.integers(1, KEY_DIM), st.floats(0.01, 1.0)),
    budget=st.one_of(st.none(), st.integers(1, 10**6), st.floats(0.001, 0.999)),
    outliers=st.one_of(st.none(), st.integers(0, 10**4), st.floats(0.0, 0.999)),
)
def test_resolved_sizes_account_for_every_token(n, chunk_size, local_window, min_compress_len, rank, budget, outliers):
    config = ShadowKVConfig(
        rank=rank,
        chunk_size=chunk_size,
        sparse_budget=budget,
        outlier_chunks=outliers,
        local_window=local_window,
        min_compress_len=min_compress_len,
    )
    size = config.resolve(n, KEY_DIM)  # never raises: everything clamps
    assert size.num_chunks * chunk_size + size.local == n
    assert size.num_chunks >= 0 and size.local >= 0
    if n < min_compress_len:
        assert (size.num_chunks, size.rank, size.budget_chunks, size.outliers, size.local) == (0, 0, 0, 0, n)
        return
    if size.num_chunks:
        assert local_window <= size.local < local_window + chunk_size
        assert 1 <= size.rank <= min(KEY_DIM, size.num_chunks * chunk_size)
    else:
        assert size.local == n < local_window + chunk_size
    assert 0 <= size.outliers <= size.num_chunks
    selectable = size.num_chunks - size.outliers
    assert 0 <= size.budget_chunks <= selectable
    if budget is not None:
        wanted = budget if isinstance(budget, int) else math.ceil(budget * n)
        assert size.budget_chunks == min(math.ceil(wanted / chunk_size), selectable)
