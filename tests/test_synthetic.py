"""`shadowkv_cache.testing`: synthetic compressed caches, the hit rate by construction, continuing a prefill with
another policy and budget.

Legend: B batch, S context, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, O outlier chunks, W local
tokens, K selected chunks (YAKV: tokens), R rank.

A synthetic cache is random, so it is not compared with a prefilled one; the tests check what benchmarks rely on:
the lengths `generate` sees, memory figures equal to the intended tensor sizes, the constructed hit rate measured
back, and rows that share one stored row reading the same values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import (
    HEAD_DIM,
    NUM_KV_HEADS,
    VOCAB,
    forward_with,
    generate_with,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)

from shadowkv_cache import LandmarkTopK, ShadowKVCache, ShadowKVConfig
from shadowkv_cache.policies import SharedBudgetTopK
from shadowkv_cache.testing import (
    ControlledHitRate,
    continue_with_policy,
    layer_sizes,
    reset_hit_counts,
    selection_figures,
    synthetic_cache,
)

S, B = 256, 2
SETTINGS = dict(rank=8, sparse_budget=32, outlier_chunks=2, local_window=16, chunk_size=8, min_compress_len=64)
MODES = [
    pytest.param(dict(SETTINGS), id="native"),
    pytest.param(dict(SETTINGS, value_format="fp8"), id="fp8"),
    pytest.param(dict(SETTINGS, value_format="higgs4"), id="higgs4"),
    pytest.param(dict(mode="yakv", sparse_budget=32, recent_window=16, min_compress_len=64), id="yakv"),
]


def model():
    return tiny_model("llama")


def decode(cache, steps: int, batch: int = B) -> None:
    token = torch.ones(batch, 1, dtype=torch.long)
    for _ in range(steps):
        forward_with(model(), token, cache)


@pytest.mark.parametrize("settings", MODES)
def test_lengths_reported_to_generate(settings):
    cache = synthetic_cache(model(), B, S, **settings)
    assert cache.get_seq_length() == S
    assert all(layer.keys.shape == (B, NUM_KV_HEADS, 0, HEAD_DIM) for layer in cache.layers)
    ids = torch.randint(1, VOCAB, (B, S + 1))  # generate feeds the last id
    out = generate_with(model(), ids, cache, max_new_tokens=3)
    assert out.sequences.shape == (B, S + 4)
    assert cache.get_seq_length() == S + 3  # the last generated token is not fed


def expected_device_bytes(config: ShadowKVConfig) -> int:
    """Device bytes of one layer, from the intended shapes (fp32 model)."""
    size = layer_sizes(model(), config, S).resolved
    hkv, d, f, i64 = NUM_KV_HEADS, HEAD_DIM, 4, 8
    n, w, k = size.num_chunks, size.local, size.budget_chunks
    local = 2 * B * hkv * w * d * f + B * w  # keys, values, validity
    if config.mode == "yakv":
        m = d // config.score_grid_dim
        held = B * hkv * k * i64 + 2 * B * hkv * k * d * f  # ids, keys, values of the held tokens
        return B * hkv * n * m + B * hkv * n * 2 + B * n + B * i64 + local + held  # codes, norms, real, budget
    c, o, r = config.chunk_size, size.outliers, size.rank
    prompt = B * n * c * r * f + B * r * hkv * d * f + B * n * c * i64  # a, b, positions
    prompt += B * hkv * n * d * f + B * hkv * n + B * i64  # landmarks, selectable, budget
    prompt += 2 * B * hkv * o * c * d * f + B * o * c + local  # outliers, local window
    temporal = B * hkv * k * i64 + 2 * B * hkv * k * c * d * f + B * hkv * k  # ids, keys, values, valid slots
    return prompt + temporal


@pytest.mark.parametrize("settings", MODES)
@pytest.mark.parametrize("share", [False, True], ids=["own rows", "shared row"])
def test_memory_report_counts_the_intended_sizes(settings, share):
    cache = synthetic_cache(model(), B, S, share_stored_row=share, **settings)
    layers = len(cache.layers)
    sizes = layer_sizes(model(), cache.config, S)
    report = cache.memory_report()
    assert report.host_bytes == layers * (1 if share else B) * sizes.host_bytes_per_row
    assert report.gpu_bytes == layers * expected_device_bytes(cache.config)
    assert report.dynamic_cache_bytes == layers * 2 * B * NUM_KV_HEADS * S * HEAD_DIM * 4
    yakv = cache.config.mode == "yakv"
    tokens = sizes.resolved.budget_chunks * (1 if yakv else cache.config.chunk_size)
    for layer in report.layers:
        assert (layer.mode, layer.budget_tokens) == (cache.config.mode, tokens)
        assert layer.rank == (None if yakv else sizes.resolved.rank)


def test_auto_rank_takes_the_largest_rank_allowed():
    cache = synthetic_cache(model(), B, S, **dict(SETTINGS, rank="auto"))
    rank = layer_sizes(model(), cache.config, S).resolved.rank
    assert rank == 24  # 75% of Hkv*D = 32
    assert all(layer.rank == rank for layer in cache.memory_report().layers)
    decode(cache, 2)


def test_layer_sizes_of_each_value_format():
    config = ShadowKVConfig(**SETTINGS)
    size = layer_sizes(model(), config, S, dtype=torch.bfloat16)
    values = size.resolved.num_chunks * config.chunk_size * NUM_KV_HEADS
    assert size.host_bytes_per_row == values * HEAD_DIM * 2
    fp8 = layer_sizes(model(), ShadowKVConfig(**SETTINGS, value_format="fp8"), S)
    assert fp8.host_bytes_per_row == values * (HEAD_DIM + 2)  # one bf16 scale per vector
    higgs = layer_sizes(model(), ShadowKVConfig(**SETTINGS, value_format="higgs4"), S)
    assert higgs.host_bytes_per_row == values * (HEAD_DIM // 2 + 2)  # one fp16 norm per vector
    yakv = layer_sizes(model(), ShadowKVConfig(mode="yakv", min_compress_len=64), S)
    assert yakv.record_bytes == 2 * 2 + 2 * HEAD_DIM // 2
    assert yakv.host_bytes_per_row == yakv.resolved.num_chunks * NUM_KV_HEADS * yakv.record_bytes


@pytest.mark.parametrize("hit_rate", [0.0, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("settings", [MODES[0], MODES[1], MODES[-1]])
def test_constructed_hit_rate_is_measured(hit_rate, settings):
    cache = synthetic_cache(model(), B, S, hit_rate=hit_rate, **settings)
    decode(cache, 1)
    assert cache.memory_report().hit_rate == 0.0  # the first step finds nothing held
    reset_hit_counts(cache)
    decode(cache, 5)
    k = layer_sizes(model(), cache.config, S).resolved.budget_chunks
    assert cache.memory_report().hit_rate == pytest.approx(hit_rate)
    assert cache.policy.expected_hit_rate(k) == pytest.approx(hit_rate)


@pytest.mark.parametrize("settings", [MODES[0], MODES[-1]])
def test_constructed_hit_rate_keeps_no_state_the_size_of_the_prompt(settings):
    """One permutation of the N units for the whole cache and, per layer, its windows' K positions: a permutation per
    layer, row and head held 8 bytes per prompt token and head in every layer (0.25 GiB per 128K row of a YAKV cache
    of Llama-3.1-8B's shape), memory a benchmark counted as the cache's. Each window still selects K distinct units,
    from a random start per layer, row and head."""
    cache = synthetic_cache(model(), B, S, hit_rate=0.5, **settings)
    decode(cache, 3)
    policy = cache.policy
    k = layer_sizes(model(), cache.config, S).resolved.budget_chunks
    units = cache.layers[0].prompt.selectable.shape[-1]
    assert [p.shape for p in policy.perms.values()] == [(units,)]
    assert sorted(policy.perms[(units, "cpu")].tolist()) == list(range(units))
    assert len(policy.positions) == model().config.num_hidden_layers
    for positions in policy.positions.values():
        assert positions.shape == (B, NUM_KV_HEADS, k)
        chosen = policy.perms[(units, "cpu")][positions]
        assert all(len(set(ids)) == k for ids in chosen.flatten(0, 1).tolist())
    firsts = {tuple(p[..., 0].flatten().tolist()) for p in policy.positions.values()}
    assert len(firsts) > 1  # the layers' windows start apart


@pytest.mark.parametrize("settings", MODES)
def test_selection_figures_count_what_was_built_and_moved(settings):
    cache = synthetic_cache(model(), B, S, **settings)
    size = layer_sizes(model(), cache.config, S)
    decode(cache, 3)
    figures = selection_figures(cache)
    layers, k = len(cache.layers), size.resolved.budget_chunks
    assert figures.compressed_layers == layers
    assert figures.selected_units == layers * k
    assert figures.prompt_units == layers * NUM_KV_HEADS * size.resolved.num_chunks
    if cache.config.mode == "yakv":
        assert (figures.rank, figures.unit_tokens, figures.record_bytes) == (None, 1, size.record_bytes)
        assert figures.lookups == 3 * layers * B * NUM_KV_HEADS * k
        assert figures.fetched_bytes == (figures.lookups - figures.hits) * size.record_bytes
    else:
        assert (figures.rank, figures.unit_tokens) == (size.resolved.rank, cache.config.chunk_size)
        assert figures.lookups == 3 * layers * B * NUM_KV_HEADS * k
        assert figures.hits / figures.lookups == cache.memory_report().hit_rate


def test_reset_hit_counts_zeroes_yakv_held_tokens():
    cache = synthetic_cache(model(), B, S, **MODES[-1].values[0])
    decode(cache, 1)
    assert cache.memory_report().hit_rate == 0.0  # the first step holds no token yet
    reset_hit_counts(cache)
    assert cache.memory_report().hit_rate is None  # nothing counted since the reset
    decode(cache, 2)
    figures = selection_figures(cache)
    assert (
        figures.lookups
        == 2 * len(cache.layers) * B * NUM_KV_HEADS * layer_sizes(model(), cache.config, S).resolved.budget_chunks
    )
    assert cache.memory_report().hit_rate == figures.hits / figures.lookups


def stored_rows(layer) -> torch.Tensor:
    """What each cache row reads from host memory, `[B, ...]`."""
    prompt = layer.prompt
    if hasattr(prompt, "store"):  # YAKV records
        return prompt.store.data[prompt.store.row_map]
    return prompt.values.read_rows(B, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("settings", MODES)
def test_rows_sharing_a_stored_row_read_the_same_values(settings):
    shared = synthetic_cache(model(), B, S, share_stored_row=True, **settings)
    own = synthetic_cache(model(), B, S, **settings)
    for layer in shared.layers:
        rows = stored_rows(layer)
        assert torch.equal(rows[0], rows[1])
    for layer in own.layers:
        rows = stored_rows(layer)
        assert not torch.equal(rows[0], rows[1])
    decode(shared, 2)  # and such a cache decodes


def test_host_values_are_carved_from_the_given_blocks():
    config = ShadowKVConfig(**SETTINGS, value_format="fp8")
    need = B * layer_sizes(model(), config, S).host_bytes_per_row + 256
    blocks = [torch.zeros(need, dtype=torch.uint8) for _ in range(2)]
    cache = synthetic_cache(model(), B, S, config, host_blocks=blocks)
    for block, layer in zip(blocks, cache.layers):
        start = block.data_ptr()
        assert start <= layer.prompt.values.data.data_ptr() < start + need
        assert start <= layer.prompt.values.scales.data_ptr() < start + need
        assert block.any()
    decode(cache, 2)
    small = [torch.zeros(need - 512, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(ValueError, match="too small"):
        synthetic_cache(model(), B, S, config, host_blocks=small)


def test_bad_requests_raise():
    with pytest.raises(ValueError, match="min_compress_len"):
        synthetic_cache(model(), B, 32, **SETTINGS)
    with pytest.raises(ValueError, match="hit_rate must be"):
        ControlledHitRate(1.5)
    with pytest.raises(ValueError, match="shares the budget"):
        ControlledHitRate(0.5, SharedBudgetTopK())
    with pytest.raises(ValueError, match="one block per layer"):
        synthetic_cache(model(), B, S, host_blocks=[torch.zeros(8, dtype=torch.uint8)], **SETTINGS)


def test_continued_cache_decodes_like_its_own_prefill():
    prompt = random_prompt(200, batch=B)
    overrides = small_budget_overrides()
    own = ShadowKVCache(model(), **overrides)
    forward_with(model(), prompt[:, :-1], own)
    expected = generate_with(model(), prompt, own, max_new_tokens=6).sequences

    base = ShadowKVCache(model(), **dict(overrides, sparse_budget=10**6))
    forward_with(model(), prompt[:, :-1], base)
    for _ in range(2):  # the base is left as it was: it can be continued again
        cache = continue_with_policy(base, model(), LandmarkTopK(), overrides["sparse_budget"])
        assert cache.config.sparse_budget == overrides["sparse_budget"]
        assert torch.equal(generate_with(model(), prompt, cache, max_new_tokens=6).sequences, expected)


# -- who may import what (design.md §7) ---------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
INTERNALS = ("shadowkv_cache.shadowkv", "shadowkv_cache.yakv", "shadowkv_cache.stores")


def imports(path: Path, package: str) -> set[str]:
    """Absolute names of the modules `path` imports (relative imports resolved against `package`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            out |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return out


def within(name: str, *roots: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def test_no_other_room_imports_testing():
    src = REPO / "src"
    for path in (src / "shadowkv_cache").rglob("*.py"):
        package = ".".join(path.relative_to(src).with_suffix("").parts[:-1])
        if within(package, "shadowkv_cache.testing"):
            continue
        assert not [n for n in imports(path, package) if within(n, "shadowkv_cache.testing")], path


def test_benchmarks_build_caches_through_the_api_and_testing():
    for path in (REPO / "benchmarks").rglob("*.py"):
        package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
        assert not [n for n in imports(path, package) if within(n, *INTERNALS)], path
        assert "sys.path" not in path.read_text(), path
