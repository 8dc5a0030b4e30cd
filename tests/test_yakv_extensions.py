"""The YAKV study's two extensions: residual landmarks and a token budget shared by the heads of a layer.

Scores are checked against their definitions written out by hand; at full budget a YAKV cache with either policy
must reproduce `DynamicCache` on the 4-bit quantised prompt (as plain YAKV does, `test_yakv.py`); below it,
padded rows decode as they would alone and the shared budget spends exactly `Hkv*k` tokens per row.

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, N quantised tokens, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    HEAD_DIM,
    NUM_KV_HEADS,
    assert_logits_close,
    forward_with,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    tiny_model,
)
from test_yakv import PROMPT, RECENT, STEPS, quantised_reference, small_yakv, yakv

from shadowkv_cache import LandmarkTopK, ShadowKVCache
from shadowkv_cache.policies import QuantizedKeyTopK, ResidualLandmarkTopK, SharedBudgetTopK
from shadowkv_cache.quant import HiggsQuantizer

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

POLICIES = {
    "residual": ResidualLandmarkTopK,
    "shared": SharedBudgetTopK,
    "shared_residual": lambda: SharedBudgetTopK(ResidualLandmarkTopK()),
}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def keys_with_padding(batch_real=(37, 21), heads=2, dim=HEAD_DIM, seed=0) -> torch.Tensor:
    """Post-RoPE-like keys `[B, Hkv, N, 1, D]`; row b holds `batch_real[b]` real tokens, zeros after (as YAKV)."""
    gen = torch.Generator().manual_seed(seed)
    num = max(batch_real)
    keys = torch.randn(len(batch_real), heads, num, 1, dim, generator=gen) * 2 + torch.randn(dim, generator=gen)
    for row, n in enumerate(batch_real):
        keys[row, :, n:] = 0
    return keys


def brute_force_keys(keys: torch.Tensor, real: list[int], group: int = 8) -> torch.Tensor:
    """`repeat(L_hat) + R_hat` `[B, Hkv, N, D]` written out: per row and head, each group's landmark is the mean of
    its real keys, 4-bit HIGGS round trip; each residual is the sign of its rotated coordinates times their mean
    magnitude (rounded as the fp16 norm is), rotated back."""
    quantizer = HiggsQuantizer(keys.shape[-1], 2)
    dim = keys.shape[-1]
    out = torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2], dim)
    for b, n in enumerate(real):
        for h in range(keys.shape[1]):
            for start in range(0, n, group):
                block = keys[b, h, start : min(start + group, n), 0].float()
                landmark = quantizer.dequantize(quantizer.quantize(block.mean(0)), torch.float32)
                for i, key in enumerate(block):
                    rotated = quantizer.rotate(key - landmark)
                    norm = (rotated.abs().mean() * dim**0.5).half().float()
                    signs = torch.where(rotated >= 0, 1.0, -1.0)
                    out[b, h, start + i] = landmark + quantizer.unrotate(signs * norm / dim**0.5)
    return out


def attention_by_definition(query: torch.Tensor, keys: torch.Tensor, selectable: torch.Tensor, scaling: float):
    """Softmax over selectable tokens per query head and token, summed over tokens, max over the GQA group."""
    batch, hq, t, dim = query.shape
    heads = keys.shape[1]
    q = query.view(batch, heads, hq // heads, t, dim)
    logits = torch.einsum("bhgtd,bhnd->bhgtn", q, keys) * scaling
    logits = logits.masked_fill(~selectable[:, :, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=3).amax(dim=2)


# -- residual landmarks ----------------------------------------------------------------------------------------


def test_residual_scores_equal_the_definition():
    real = [37, 21]
    keys = keys_with_padding(real)
    policy = ResidualLandmarkTopK()
    state = policy.prepare(keys)
    query = torch.randn(2, 4, 3, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    expected_keys = brute_force_keys(keys, real)
    q = query.view(2, 2, 2, 3, HEAD_DIM).flatten(2, 3)
    expected_logits = torch.einsum("bhqd,bhnd->bhqn", q, expected_keys)
    got = policy.logits(query, state)
    for b, n in enumerate(real):
        torch.testing.assert_close(got[b, :, :, :n], expected_logits[b, :, :, :n], rtol=1e-4, atol=1e-4)

    selectable = torch.zeros(2, 2, 37, dtype=torch.bool)
    for b, n in enumerate(real):
        selectable[b, :, :n] = True
    scores = policy.score(query, state, selectable, 0.3)
    torch.testing.assert_close(scores, attention_by_definition(query, expected_keys, selectable, 0.3))
    assert (scores[1, :, 21:] == 0).all()


def test_residual_brings_each_key_closer_than_its_landmark():
    """The 1-bit residual is worth its bit: `repeat(L_hat) + R_hat` is nearer the keys than `repeat(L_hat)`."""
    keys = keys_with_padding([64], seed=3)
    exact = keys[0, :, :, 0]
    with_residual = brute_force_keys(keys, [64])[0]
    quantizer = HiggsQuantizer(HEAD_DIM, 2)
    means = exact.unflatten(1, (8, 8)).mean(2)
    landmarks = quantizer.dequantize(quantizer.quantize(means), torch.float32).repeat_interleave(8, dim=1)
    assert (exact - with_residual).norm() < 0.8 * (exact - landmarks).norm()


@pytest.mark.parametrize("dim", [64, 128])
def test_residual_device_bits_are_the_state_it_keeps(dim):
    """`device_bits_per_value` is what `prepare` keeps per key coordinate (whole groups of 8 keys): fewer bits
    than YAKV's ~2-bit scoring copy."""
    policy = ResidualLandmarkTopK()
    keys = keys_with_padding([64, 64], dim=dim)
    state = policy.prepare(keys)
    bits = 8 * sum(t.numel() * t.element_size() for t in state.values()) / keys.numel()
    assert policy.device_bits_per_value(dim) == pytest.approx(bits)
    assert 1.5 < bits < HiggsQuantizer(dim, QuantizedKeyTopK().grid_dim).bits_per_value


def test_residual_state_bytes_on_the_device(llama):
    cache = ShadowKVCache(llama, policy=ResidualLandmarkTopK(), **small_yakv())
    forward_with(llama, random_prompt(PROMPT, seed=2), cache)
    state = cache.layers[0].prompt.policy_state
    quantised = PROMPT - RECENT
    groups = -(-quantised // 8)
    assert state["landmark_codes"].shape == (1, NUM_KV_HEADS, groups, HEAD_DIM // 2)
    assert state["residual_codes"].shape == (1, NUM_KV_HEADS, quantised, HEAD_DIM // 8)
    assert state["residual_codes"].dtype == torch.uint8 and state["residual_norms"].dtype == torch.float16


# -- the shared budget -----------------------------------------------------------------------------------------


def test_default_select_valid_marks_each_rows_budget():
    policy = QuantizedKeyTopK()
    keys = keys_with_padding([37, 21])
    state = policy.prepare(keys)
    selectable = (keys[:, :, :, 0] != 0).any(-1)
    query = torch.randn(2, 4, 1, HEAD_DIM)
    ids, valid = policy.select_valid(query, state, selectable, 10, 0.25, None, torch.tensor([10, 4]))
    assert torch.equal(ids, policy.select(query, state, selectable, 10, 0.25))
    assert valid.sum(-1).tolist() == [[10, 10], [4, 4]]


@pytest.mark.parametrize("inner", [QuantizedKeyTopK, ResidualLandmarkTopK])
def test_shared_budget_is_the_layers_top_pairs(inner):
    """Row b spends `Hkv*budget[b]` tokens on its best (head, token) pairs by approximate attention; padding and
    other rows' budgets do not leak in; heads end up with different counts."""
    policy = SharedBudgetTopK(inner())
    real = [37, 21]
    keys = keys_with_padding(real, seed=4)
    state = policy.prepare(keys)
    selectable = torch.zeros(2, 2, 37, dtype=torch.bool)
    for b, n in enumerate(real):
        selectable[b, :, :n] = True
    query = torch.randn(2, 4, 1, HEAD_DIM, generator=torch.Generator().manual_seed(5)) * 3
    budget = torch.tensor([6, 3])
    ids, valid = policy.select_valid(query, state, selectable, 6, 0.25, None, budget)
    assert ids.shape == valid.shape == (2, 2, 12)
    assert valid.sum(dim=(1, 2)).tolist() == [12, 6]

    scores = inner().score(query, state, selectable, 0.25).masked_fill(~selectable, float("-inf"))
    counts = []
    for b in range(2):
        chosen = {(h, int(i)) for h in range(2) for i, ok in zip(ids[b, h], valid[b, h]) if ok}
        assert len(chosen) == int(valid[b].sum())  # no token twice in a head
        assert all(selectable[b, h, i] for h, i in chosen)
        top = scores[b].flatten().topk(2 * int(budget[b])).indices
        assert chosen == {(int(j) // 37, int(j) % 37) for j in top}
        # Each head's valid ids come first, best first.
        for h in range(2):
            n = int(valid[b, h].sum())
            assert valid[b, h, :n].all()
            assert (scores[b, h, ids[b, h, :n]].diff() <= 0).all()
        counts.append(valid[b].sum(-1).tolist())
    assert any(c[0] != c[1] for c in counts), "expected the heads to get different counts on these keys"


def test_shared_budget_without_budget_spends_hkv_k():
    policy = SharedBudgetTopK()
    keys = keys_with_padding([40, 40], seed=6)
    state = policy.prepare(keys)
    selectable = torch.ones(2, 2, 40, dtype=torch.bool)
    _, valid = policy.select_valid(torch.randn(2, 4, 1, HEAD_DIM), state, selectable, 5, 0.25)
    assert valid.sum(dim=(1, 2)).tolist() == [10, 10]


# -- through the cache -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_full_budget_matches_dynamic_cache_on_quantised_prompt(llama, name):
    ids = random_prompt(PROMPT, seed=5)
    cache = ShadowKVCache(llama, policy=POLICIES[name](), **yakv())
    out = generate_with(llama, ids, cache, max_new_tokens=STEPS)
    ref_tokens, ref_logits = quantised_reference(llama, ids, STEPS)
    assert torch.equal(out.sequences[:, PROMPT:], ref_tokens)
    assert_logits_close(out.logits, ref_logits)
    record = 2 * HEAD_DIM // 2 + 4
    selected = (PROMPT - RECENT) * NUM_KV_HEADS  # every token, at every step
    for layer in cache.layers:
        assert layer.mode.sparse_steps == STEPS - 1
        if layer.mode.policy.shares_budget:  # fetched afresh at every step (valid entries only)
            assert layer.mode.fetched_bytes == (STEPS - 1) * selected * record
            assert layer.mode.hit_counts() is None
        else:  # fetched once, then held
            assert layer.mode.fetched_bytes == selected * record
            assert layer.mode.hit_counts() == ((STEPS - 2) * selected, (STEPS - 1) * selected)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_padded_rows_match_rows_alone(llama, name):
    rows = [random_prompt(PROMPT, seed=10)[0], random_prompt(200, seed=11)[0], random_prompt(50, seed=12)[0]]
    ids, mask = left_pad(rows)
    together = generate_with(
        llama, ids, ShadowKVCache(llama, policy=POLICIES[name](), **small_yakv()), attention_mask=mask
    )
    for row, prompt in enumerate(rows):
        alone = generate_with(llama, prompt[None], ShadowKVCache(llama, policy=POLICIES[name](), **small_yakv()))
        assert torch.equal(together.sequences[row, ids.shape[1] :], alone.sequences[0, len(prompt) :])
        assert_logits_close([step[row : row + 1] for step in together.logits], alone.logits)


def test_shared_budget_in_the_layer_attends_hkv_k_tokens(llama, monkeypatch):
    """Through a real decode step: the layer masks the unused slots, so each row attends `Hkv*k` prompt tokens."""
    rows = [random_prompt(PROMPT, seed=13)[0], random_prompt(150, seed=14)[0]]
    ids, mask = left_pad(rows)
    cache = ShadowKVCache(llama, policy=SharedBudgetTopK(), **small_yakv())
    seen = []
    original = SharedBudgetTopK.select_valid

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(SharedBudgetTopK, "select_valid", spy)
    generate_with(llama, ids, cache, attention_mask=mask, max_new_tokens=3)
    assert len(seen) == 2 * len(cache.layers)  # two sparse steps per layer
    for ids_sel, valid in seen:
        assert valid.sum(dim=(1, 2)).tolist() == [NUM_KV_HEADS * 24] * 2
        assert ids_sel[1][valid[1]].max() < 150 - RECENT  # row 1's padding slots are never chosen


# -- bad settings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: ResidualLandmarkTopK(group_size=0), ValueError, "group_size"),
        (lambda: ResidualLandmarkTopK(group_size=2.5), ValueError, "group_size"),
        (lambda: ResidualLandmarkTopK(landmark_grid_dim=3), ValueError, "landmark_grid_dim"),
        (lambda: SharedBudgetTopK(LandmarkTopK()), ValueError, "chunk granularity"),
        (lambda: SharedBudgetTopK(SharedBudgetTopK()), ValueError, "cannot be wrapped"),
        (lambda: SharedBudgetTopK("yakv"), TypeError, "SelectionPolicy"),
    ],
)
def test_bad_settings_raise(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_misuse_raises(llama):
    for policy in (ResidualLandmarkTopK(), SharedBudgetTopK()):
        with pytest.raises(ValueError, match="selects by chunk"):
            ShadowKVCache(llama, policy=policy)  # ShadowKV mode selects chunks
    with pytest.raises(NotImplementedError, match="select_valid"):
        SharedBudgetTopK().select(torch.randn(1, 4, 1, HEAD_DIM), {}, torch.ones(1, 2, 8, dtype=torch.bool), 2, 1.0)
    with pytest.raises(ValueError, match="multiple of 8"):
        ResidualLandmarkTopK().prepare(torch.randn(1, 1, 16, 1, 4))
    with pytest.raises(ValueError, match=r"\[B, Hkv, N, 1, D\]"):
        ResidualLandmarkTopK().prepare(torch.randn(1, 2, 4, 8, HEAD_DIM))
    odd = make_tiny_model("llama", head_dim=24)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        ShadowKVCache(odd, mode="yakv", policy=ResidualLandmarkTopK())
