"""Selection policies (ShadowKV landmarks and the baselines) and the accuracy benchmark's plumbing.

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, C chunks, c chunk size, D head dim.

One parametrised list of every policy (ordered easy to hard, as kvpress does): shapes, selection stays within
the selectable chunks, each plugs into `ShadowKVCache` and `generate` runs, and at full budget and full rank
each gives `DynamicCache`'s logits. Then each policy's own property on a planted case, and the benchmark's fork
and probe (benchmarks/methods.py, benchmarks/selection_probe.py).
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
    random_prompt,
    small_budget_overrides,
    tiny_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.methods import METHODS, MODE_CHANGES, PolicyBundle, fork_cache
from benchmarks.selection_probe import SelectionProbe
from shadowkv_cache import ShadowKVCache, ShadowKVConfig
from shadowkv_cache.policies import LandmarkTopK, OracleTopK, Quest, SelectionPolicy, SnapKV, StreamingLLM

POLICIES = [StreamingLLM, SnapKV, LandmarkTopK, Quest, OracleTopK]  # easy to hard
B, HQ, HKV, C, CS, D, T = 2, 4, 2, 12, 4, 16, 1
SCALING = D**-0.5


def prepared(policy: SelectionPolicy, chunk_keys: torch.Tensor, recent: torch.Tensor | None = None) -> dict:
    if policy.observation_window:
        recent = torch.randn(B, HQ, policy.observation_window, D) if recent is None else recent
        return policy.prepare(chunk_keys, recent_queries=recent, scaling=SCALING)
    return policy.prepare(chunk_keys)


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_shapes_and_selection_within_selectable(policy_cls):
    torch.manual_seed(0)
    policy = policy_cls()
    chunk_keys = torch.randn(B, HKV, C, CS, D)
    state = prepared(policy, chunk_keys)
    assert all(t.shape[0] == B for t in state.values())  # the cache selects and reorders rows of the state
    selectable = torch.rand(B, HKV, C) > 0.3
    selectable[..., 0] = True
    query = torch.randn(B, HQ, T, D)
    assert policy.score(query, state, selectable, SCALING).shape == (B, HKV, C)
    k = int(selectable.sum(-1).min())
    chosen = policy.select(query, state, selectable, k, SCALING)
    assert chosen.shape == (B, HKV, k)
    assert selectable.gather(-1, chosen).all()
    assert (chosen.sort(-1).values.diff(dim=-1) > 0).all()  # no chunk twice


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_policy_plugs_into_the_cache_and_generate_runs(policy_cls):
    model = tiny_model("llama")
    cache = ShadowKVCache(model, policy=policy_cls(), **small_budget_overrides())
    out = generate_with(model, random_prompt(200), cache, max_new_tokens=6)
    assert out.sequences.shape == (1, 206)
    assert all(layer.is_compressed for layer in cache.layers)
    assert cache.memory_report().hit_rate is not None


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_full_budget_and_rank_is_exact_for_every_policy(policy_cls):
    model, prompt = tiny_model("qwen2"), random_prompt(160, seed=4)
    ref = generate_with(model, prompt, dynamic_cache(model), max_new_tokens=8)
    out = generate_with(model, prompt, ShadowKVCache(model, policy=policy_cls(), **full_budget_overrides()), 8)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


# -- each policy's own property, on planted cases ----------------------------------------------------------------


def planted(target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Small random keys, except that chunk `target` of every row and head aligns with the query."""
    torch.manual_seed(1)
    direction = torch.randn(D)
    keys = 0.1 * torch.randn(B, HKV, C, CS, D)
    keys[:, :, target] += 3 * direction
    return keys, direction.expand(B, HQ, T, D).clone()


@pytest.mark.parametrize("policy_cls", [LandmarkTopK, Quest, OracleTopK])
def test_query_aware_policies_find_the_aligned_chunk(policy_cls):
    keys, query = planted(target=7)
    policy = policy_cls()
    chosen = policy.select(query, policy.prepare(keys), torch.ones(B, HKV, C, dtype=torch.bool), 1, SCALING)
    assert (chosen[..., 0] == 7).all()


def test_quest_bound_is_an_upper_bound_of_every_key_logit():
    torch.manual_seed(2)
    keys, query = torch.randn(B, HKV, C, CS, D), torch.randn(B, HQ, T, D)
    state = Quest().prepare(keys)
    q = query.view(B, HKV, HQ // HKV, T, D)
    exact = torch.einsum("bhgtd,bhcnd->bhgtcn", q, keys).amax(-1)  # best key logit per chunk
    upper = torch.einsum("bhgtd,bhcd->bhgtc", q.clamp(min=0), state["key_max"])
    upper = upper + torch.einsum("bhgtd,bhcd->bhgtc", q.clamp(max=0), state["key_min"])
    assert (upper >= exact - 1e-5).all()


def test_streaming_llm_keeps_the_sink_and_the_most_recent_chunks():
    selectable = torch.ones(B, HKV, C, dtype=torch.bool)
    selectable[1, :, 9:] = False  # a shorter row: its last real chunk is 8
    policy = StreamingLLM(sink_chunks=1)
    state = policy.prepare(torch.randn(B, HKV, C, CS, D))
    for query in (torch.randn(B, HQ, T, D), torch.randn(B, HQ, T, D)):  # the query does not matter
        chosen = policy.select(query, state, selectable, 3, SCALING).sort(-1).values
        assert chosen[0].tolist() == [[0, 10, 11]] * HKV
        assert chosen[1].tolist() == [[0, 7, 8]] * HKV


def test_snapkv_keeps_what_the_observation_window_attended():
    keys, direction = planted(target=4)
    recent = direction[:, :, :1].expand(B, HQ, 32, D)  # the window's queries look at chunk 4
    policy = SnapKV(window=32)
    state = policy.prepare(keys, recent_queries=recent, scaling=SCALING)
    other = -direction  # a decode query that looks elsewhere changes nothing: SnapKV evicts at prefill
    chosen = policy.select(other, state, torch.ones(B, HKV, C, dtype=torch.bool), 1, SCALING)
    assert (chosen[..., 0] == 4).all()


def test_snapkv_gets_its_window_from_the_cache_at_prefill():
    model = tiny_model("llama")
    cache = ShadowKVCache(model, policy=SnapKV(window=8), **small_budget_overrides())
    forward_with(model, random_prompt(150), cache)
    votes = cache.layers[0].prompt.policy_state["votes"]
    assert votes.shape[:2] == (1, 2) and votes.sum() > 0


def test_oracle_scores_are_exact_attention_mass():
    torch.manual_seed(3)
    keys, query = torch.randn(1, HKV, C, CS, D), torch.randn(1, HQ, T, D)
    selectable = torch.ones(1, HKV, C, dtype=torch.bool)
    selectable[..., 2] = False
    score = OracleTopK().score(query, OracleTopK().prepare(keys), selectable, SCALING)
    q = query.view(1, HKV, HQ // HKV, T, D)
    logits = torch.einsum("bhgtd,bhnd->bhgtn", q, keys.flatten(2, 3)) * SCALING
    logits[..., 2 * CS : 3 * CS] = float("-inf")
    expected = logits.softmax(-1).view(1, HKV, HQ // HKV, T, C, CS).sum(dim=(2, 3, 5))
    torch.testing.assert_close(score, expected)
    assert score[..., 2].eq(0).all()


def test_policies_reject_bad_settings():
    with pytest.raises(ValueError, match="sink_chunks"):
        StreamingLLM(sink_chunks=-1)
    with pytest.raises(ValueError, match="window"):
        SnapKV(window=0)
    with pytest.raises(ValueError, match="observation window"):
        SnapKV().prepare(torch.randn(B, HKV, C, CS, D))


# -- the benchmark's plumbing ----------------------------------------------------------------------------------


def test_a_fork_decodes_like_a_cache_with_its_own_prefill():
    """`fork_cache` (one prefill, many methods) must give what each method gives on its own."""
    model, prompt = tiny_model("llama"), random_prompt(180, seed=7)
    overrides = small_budget_overrides(sparse_budget=24)
    shared = {m: cls for m, cls in METHODS.items() if m not in MODE_CHANGES}
    base = ShadowKVCache(model, policy=PolicyBundle({m: cls() for m, cls in shared.items()}), **overrides)
    forward_with(model, prompt[:, :-1], base)
    for name, cls in shared.items():
        alone = ShadowKVCache(model, policy=cls(), **overrides)
        forward_with(model, prompt[:, :-1], alone)
        ref = generate_with(model, prompt, alone, max_new_tokens=6)
        out = generate_with(model, prompt, fork_cache(base, model, name, cls(), 24), max_new_tokens=6)
        assert torch.equal(out.sequences, ref.sequences), name
        assert_logits_close(out.logits, ref.logits)
    assert all(layer.keys.shape[2] == 0 for layer in base.layers)  # the base itself never moved on


def test_a_yakv_fork_decodes_like_its_own_prefill_and_counts_its_bytes():
    """YAKV has its own prefill (mode="yakv"); a fork of it at a budget decodes as a YAKV cache at that budget."""
    from shadowkv_cache.policies import QuantizedKeyTopK

    model, prompt = tiny_model("llama"), random_prompt(180, seed=9)
    layers = model.config.num_hidden_layers
    overrides = {"min_compress_len": 64, **MODE_CHANGES["yakv"]}
    base = ShadowKVCache(model, policy=PolicyBundle({"yakv": QuantizedKeyTopK()}), **overrides)
    forward_with(model, prompt[:, :-1], base)
    alone = ShadowKVCache(model, sparse_budget=24, **overrides)
    forward_with(model, prompt[:, :-1], alone)
    ref = generate_with(model, prompt, alone, max_new_tokens=6)
    probe = SelectionProbe(QuantizedKeyTopK(), layers)
    fork = fork_cache(base, model, "yakv", probe, 24)
    out = generate_with(model, prompt, fork, max_new_tokens=6)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)
    record = 2 * 16 // 2 + 4  # 4-bit keys and values of one token and head, with their fp16 norms
    for layer in fork.layers:
        hits, lookups = layer.mode.hit_counts()
        assert lookups == 6 * 24 * 2 and layer.mode.fetched_bytes == (lookups - hits) * record
    recall, oracle, units = probe.totals()
    assert probe.steps == 6 and 0 < recall <= oracle + 1e-6 <= units + 2e-6


def test_probe_changes_nothing_and_the_oracle_reaches_the_oracle_recall():
    model, prompt = tiny_model("llama"), random_prompt(180, seed=8)
    layers = model.config.num_hidden_layers
    ref = generate_with(model, prompt, ShadowKVCache(model, policy=LandmarkTopK(), **small_budget_overrides()), 5)
    probe = SelectionProbe(LandmarkTopK(), layers)
    out = generate_with(model, prompt, ShadowKVCache(model, policy=probe, **small_budget_overrides()), 5)
    assert torch.equal(out.sequences, ref.sequences)
    assert probe.steps == 4  # the prefill's step selects nothing
    recall, oracle, units = probe.totals()
    assert 0 < recall <= oracle + 1e-6 and oracle <= units + 1e-6

    oracle_probe = SelectionProbe(OracleTopK(), layers)
    generate_with(model, prompt, ShadowKVCache(model, policy=oracle_probe, **small_budget_overrides()), 5)
    recall, oracle, units = oracle_probe.totals()
    assert recall == pytest.approx(oracle, rel=1e-6)

    full_probe = SelectionProbe(Quest(), layers)
    generate_with(model, prompt, ShadowKVCache(model, policy=full_probe, **full_budget_overrides()), 3)
    recall, _, units = full_probe.totals()
    assert recall == pytest.approx(units, rel=1e-5)  # everything selected: all the mass


@pytest.mark.parametrize("name", ["yakv_residual", "yakv_shared"])
def test_yakv_extension_forks_share_yakvs_prefill_and_are_probed(name):
    """The extensions fork from one YAKV prefill, decode as their own caches, and the probe measures the shared
    budget on its valid entries against the shared oracle (all the mass at full budget)."""
    model, prompt = tiny_model("llama"), random_prompt(180, seed=10)
    layers = model.config.num_hidden_layers
    overrides = {"min_compress_len": 64, **MODE_CHANGES[name]}
    assert MODE_CHANGES[name] == MODE_CHANGES["yakv"]  # one prefill serves all three
    base = ShadowKVCache(model, policy=PolicyBundle({m: METHODS[m]() for m in ("yakv", name)}), **overrides)
    forward_with(model, prompt[:, :-1], base)
    alone = ShadowKVCache(model, policy=METHODS[name](), sparse_budget=24, **overrides)
    forward_with(model, prompt[:, :-1], alone)
    ref = generate_with(model, prompt, alone, max_new_tokens=6)
    probe = SelectionProbe(METHODS[name](), layers)
    out = generate_with(model, prompt, fork_cache(base, model, name, probe, 24), max_new_tokens=6)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)
    recall, oracle, units = probe.totals()
    assert probe.steps == 6 and 0 < recall <= oracle + 1e-6 <= units + 2e-6

    full = SelectionProbe(METHODS[name](), layers)
    generate_with(model, prompt, fork_cache(base, model, name, full, 10**6), max_new_tokens=3)
    recall, oracle, units = full.totals()
    assert recall == pytest.approx(units, rel=1e-5) and oracle == pytest.approx(units, rel=1e-5)


def test_int8_landmark_fork_decodes_as_its_own_prefill():
    """The accuracy harness's `shadowkv_int8` forks from the shared ShadowKV prefill with its own int8 state."""
    model, prompt = tiny_model("llama"), random_prompt(300, seed=11)
    overrides = small_budget_overrides()
    base = ShadowKVCache(model, policy=PolicyBundle({m: METHODS[m]() for m in ("shadowkv", "shadowkv_int8")}),
                         **overrides)  # fmt: skip
    forward_with(model, prompt[:, :-1], base)
    alone = ShadowKVCache(model, policy=METHODS["shadowkv_int8"](), **overrides)
    forward_with(model, prompt[:, :-1], alone)
    ref = generate_with(model, prompt, alone, max_new_tokens=6)
    fork = fork_cache(base, model, "shadowkv_int8", METHODS["shadowkv_int8"](), overrides["sparse_budget"])
    assert fork.layers[0].prompt.policy_state["landmark_codes"].dtype == torch.int8
    out = generate_with(model, prompt, fork, max_new_tokens=6)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)


def test_probe_counting_kept_units_covers_the_outliers():
    """With `count_kept`, outlier chunks join the denominator and count as covered: the oracle still reaches its
    own bound, a full budget holds all the mass, and no recall exceeds its oracle."""
    model, prompt = tiny_model("llama"), random_prompt(180, seed=8)
    layers = model.config.num_hidden_layers
    overrides = small_budget_overrides()
    assert ShadowKVConfig(**overrides).resolve(179, 32).outliers > 0  # there are outliers to count
    probe = SelectionProbe(LandmarkTopK(), layers, count_kept=True)
    generate_with(model, prompt, ShadowKVCache(model, policy=probe, **overrides), 5)
    recall, oracle, units = probe.totals()
    assert 0 < recall <= oracle + 1e-6 <= units + 2e-6
    oracle_probe = SelectionProbe(OracleTopK(), layers, count_kept=True)
    generate_with(model, prompt, ShadowKVCache(model, policy=oracle_probe, **overrides), 5)
    recall, oracle, _ = oracle_probe.totals()
    assert recall == pytest.approx(oracle, rel=1e-6)
    full = SelectionProbe(Quest(), layers, count_kept=True)
    generate_with(model, prompt, ShadowKVCache(model, policy=full, **full_budget_overrides()), 3)
    recall, _, units = full.totals()
    assert recall == pytest.approx(units, rel=1e-5)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("chunks", [37, 40])
@pytest.mark.parametrize("batch, group", [(3, 4), (1, 1), (1, 8), (2, 3)])
def test_landmark_logits_both_ways_agree(shared, chunks, batch, group):
    """The product with padded query rows (what CUDA takes when C is not a multiple of 8: rows padded by copies of
    themselves, fewer or more than the padding, or none needed) is the einsum's."""
    from shadowkv_cache.policies.landmark_topk import landmark_logits

    gen = torch.Generator().manual_seed(chunks)
    q = torch.randn(batch, 2, group, 1, 16, generator=gen)
    landmarks = torch.randn(1 if shared else batch, 2, chunks, 16, generator=gen)
    want = landmark_logits(q, landmarks, pad_rows=False)
    got = landmark_logits(q, landmarks, pad_rows=True)
    # A view of the product (the scores read it in place).
    assert got.shape == want.shape == (batch, 2, group, 1, chunks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 3])
def test_landmark_scores_are_the_masked_softmax_summed_over_tokens_and_maxed_over_the_group(dtype, steps):
    """The definition written out (softmax over selectable chunks with -inf elsewhere, NaN of an empty head cleared,
    sum over the query tokens, max over the GQA group): the same bits on every head with a selectable chunk, and
    after `masked_scores` the same scores everywhere, heads with nothing selectable included."""
    from shadowkv_cache.policies.base import grouped_query
    from shadowkv_cache.policies.landmark_topk import landmark_logits

    gen = torch.Generator().manual_seed(steps)
    policy = LandmarkTopK()
    state = policy.prepare(torch.randn(B, HKV, 40, CS, D, generator=gen).to(dtype))
    query = torch.randn(B, HQ, steps, D, generator=gen).to(dtype)
    selectable = torch.rand(B, HKV, 40, generator=gen) < 0.6
    selectable[0, 1] = False  # a head with nothing selectable
    q = grouped_query(query * SCALING, HKV).to(dtype)
    logits = landmark_logits(q, state["landmarks"]).masked_fill(~selectable[:, :, None, None, :], float("-inf"))
    want = torch.softmax(logits, dim=-1, dtype=torch.float32).nan_to_num(0.0).sum(dim=3).amax(dim=2)
    got = policy.score(query, state, selectable, SCALING)
    some = selectable.any(-1)
    assert torch.equal(got[some], want[some])
    masked = want.masked_fill(~selectable, float("-inf"))
    assert torch.equal(policy.masked_scores(query, state, selectable, SCALING), masked)


def test_a_landmark_subclass_that_scores_otherwise_is_ranked_by_its_own_scores():
    """`LandmarkTopK.masked_scores` takes its one-op path only for its own `score`; a subclass's `score` is masked and
    ranked as the base class does."""

    class Reversed(LandmarkTopK):
        def score(self, query, state, selectable, scaling):
            return -super().score(query, state, selectable, scaling)

    gen = torch.Generator().manual_seed(0)
    policy = Reversed()
    state = policy.prepare(torch.randn(B, HKV, 40, CS, D, generator=gen))
    query = torch.randn(B, HQ, 1, D, generator=gen)
    selectable = torch.rand(B, HKV, 40, generator=gen) < 0.6
    got = policy.masked_scores(query, state, selectable, SCALING)
    want = torch.where(selectable, -LandmarkTopK().score(query, state, selectable, SCALING), float("-inf"))
    assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 4),
    k=st.integers(1, 40),
    parts=st.integers(2, 9),
    rest=st.integers(0, 50),
    masked=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**16),
)
def test_two_stage_topk_is_topk(rows, k, parts, rest, masked, seed):
    """The top k of each part, then the top k of those and the scores past the last part: torch.topk's scores, best
    first, at distinct in-range indices; the same indices where no two scores tie (-inf marks unselectable units)."""
    from shadowkv_cache.policies.base import two_stage_topk

    part = k + seed % (2 * k + 1)  # k <= part
    n = parts * part + rest
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, 3, n, generator=gen)
    scores[torch.rand(rows, 3, n, generator=gen) < masked] = float("-inf")
    got = two_stage_topk(scores, k, part)
    want = scores.topk(k, dim=-1)
    assert got.shape == (rows, 3, k) and bool(((got >= 0) & (got < n)).all())
    assert torch.equal(scores.gather(-1, got), want.values)
    assert bool((got.sort(-1).values.diff(dim=-1) > 0).all())  # distinct
    finite = torch.isfinite(want.values).all(-1)
    assert torch.equal(got[finite].sort(-1).values, want.indices[finite].sort(-1).values)


def test_best_indices_is_topk_off_cuda():
    from shadowkv_cache.policies.base import best_indices

    scores = torch.randn(1, 8, 16384)
    assert torch.equal(best_indices(scores, 256), scores.topk(256, dim=-1).indices)
    assert best_indices(scores, 0).shape == (1, 8, 0)


def test_two_stage_topk_with_the_dispatch_part_and_tied_scores():
    """`best_indices` cuts rows into parts of 4k; with many tied scores the units taken may differ from torch.topk's,
    the scores never."""
    from shadowkv_cache.policies.base import two_stage_topk

    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 50, (2, 8, 16380), generator=gen).float()  # ties everywhere
    got = two_stage_topk(scores, 256, 4 * 256)
    assert torch.equal(scores.gather(-1, got), scores.topk(256, dim=-1).values)
    assert bool((got.sort(-1).values.diff(dim=-1) > 0).all())
