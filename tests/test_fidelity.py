"""`shadowkv_cache.fidelity`: full attention's side computed once (`dynamic_cache_reference`) gives the same
measurement as computing it inside `measure_fidelity`, a cache identical to full attention measures as such, and a
reference for another text shape is refused before any forward pass."""

import pytest

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.fidelity import dynamic_cache_reference, measure_fidelity
from tests.helpers import dynamic_cache, random_prompt, small_budget_overrides, tiny_model

PROMPT, STEPS, GREEDY = 384, 12, 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_shared_reference_gives_the_same_measurement(model):
    ids = random_prompt(PROMPT + STEPS)
    make = lambda: ShadowKVCache(model, **small_budget_overrides())  # noqa: E731
    reference = dynamic_cache_reference(model, ids, PROMPT, GREEDY)
    assert reference.logits.shape == (STEPS + 1, model.config.vocab_size)
    assert reference.greedy.shape == (GREEDY,)
    alone = measure_fidelity(model, ids, PROMPT, make, greedy_tokens=GREEDY)
    shared = measure_fidelity(model, ids, PROMPT, make, greedy_tokens=GREEDY, reference=reference)
    assert shared == alone
    assert alone.steps == STEPS + 1


def test_full_attention_measures_as_identical(model):
    ids = random_prompt(PROMPT + STEPS, seed=1)
    fid = measure_fidelity(model, ids, PROMPT, lambda: dynamic_cache(model), greedy_tokens=GREEDY)
    assert (fid.agreement, fid.greedy_match) == (1.0, GREEDY)
    assert abs(fid.mean_kl) < 1e-6


@pytest.mark.parametrize("change", [dict(prompt_len=PROMPT - 8), dict(steps=STEPS + 4), dict(greedy_tokens=GREEDY + 1)])
def test_reference_for_another_measurement_is_refused(model, change):
    ids = random_prompt(PROMPT + STEPS, seed=2)
    reference = dynamic_cache_reference(model, ids, PROMPT, GREEDY)
    prompt_len = change.get("prompt_len", PROMPT)
    ids = random_prompt(prompt_len + change.get("steps", STEPS), seed=2)
    made = []
    with pytest.raises(ValueError, match="dynamic_cache_reference"):
        measure_fidelity(
            model,
            ids,
            prompt_len,
            lambda: made.append(1) or dynamic_cache(model),
            greedy_tokens=change.get("greedy_tokens", GREEDY),
            reference=reference,
        )
    assert not made  # refused before any cache was built
