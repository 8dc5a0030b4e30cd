"""The usual `generate` features work with a ShadowKV cache: sampling, streaming, stopping
criteria, beam search, several return sequences, multi-turn, `crop`, and the row operations generate uses.

Where a feature has a reference, ShadowKV at full budget and full rank must reproduce `DynamicCache`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_logits_close,
    dynamic_cache,
    full_budget_overrides,
    generate_with,
    left_pad,
    random_prompt,
    small_budget_overrides,
    tiny_model,
)
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from shadowkv_cache import ShadowKVCache

PROMPT = 240


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prompt():
    return random_prompt(PROMPT, seed=50)


def both_caches(model, overrides=None):
    return {
        "dynamic": dynamic_cache(model),
        "shadowkv": ShadowKVCache(model, **(overrides or full_budget_overrides())),
    }


def assert_compressed(cache) -> None:
    assert all(layer.is_compressed for layer in cache.layers)


class CollectingStreamer(BaseStreamer):
    """Collects what generate pushes: first the prompt, then each new token (or accepted run of tokens)."""

    def __init__(self):
        self.pushed: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value):
        self.pushed.append(value.detach().clone().reshape(-1))

    def end(self):
        self.ended += 1


class StopAfter(StoppingCriteria):
    """Stops every row once `n` tokens were generated after a prompt of `prompt_len` tokens."""

    def __init__(self, prompt_len: int, n: int):
        self.prompt_len, self.n = prompt_len, n

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] - self.prompt_len >= self.n
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_with_a_seed_matches_dynamic_cache(model, prompt, seed):
    outs = {}
    for name, cache in both_caches(model).items():
        torch.manual_seed(seed)
        outs[name] = generate_with(model, prompt, cache, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    assert torch.equal(outs["shadowkv"].sequences, outs["dynamic"].sequences)
    assert_logits_close(outs["shadowkv"].logits, outs["dynamic"].logits)


def test_streamer_receives_every_generated_token(model, prompt):
    streamer = CollectingStreamer()
    cache = ShadowKVCache(model, **small_budget_overrides())
    out = generate_with(model, prompt, cache, streamer=streamer, max_new_tokens=10)
    assert streamer.ended == 1
    assert torch.equal(streamer.pushed[0], prompt[0])  # the prompt comes first
    streamed = torch.cat(streamer.pushed[1:])
    assert torch.equal(streamed, out.sequences[0, PROMPT:])
    assert len(streamed) == 10
    assert_compressed(cache)


@pytest.mark.parametrize("overrides", [full_budget_overrides(), small_budget_overrides()], ids=["full", "small"])
def test_stopping_criteria_is_respected(model, prompt, overrides):
    cache = ShadowKVCache(model, **overrides)
    stop = StoppingCriteriaList([StopAfter(PROMPT, 5)])
    out = generate_with(model, prompt, cache, stopping_criteria=stop, max_new_tokens=50)
    assert out.sequences.shape == (1, PROMPT + 5)
    assert len(out.logits) == 5
    assert cache.get_seq_length() == PROMPT + 4
    assert_compressed(cache)


def test_beam_search_matches_dynamic_cache(model, prompt):
    outs = {}
    for name, cache in both_caches(model).items():
        outs[name] = generate_with(model, prompt, cache, num_beams=3, max_new_tokens=8, output_scores=True)
        assert cache.get_seq_length() > PROMPT
    assert torch.equal(outs["shadowkv"].sequences, outs["dynamic"].sequences)
    torch.testing.assert_close(
        outs["shadowkv"].sequences_scores, outs["dynamic"].sequences_scores, rtol=1e-4, atol=1e-5
    )


def test_beam_search_runs_at_a_small_budget(model, prompt):
    cache = ShadowKVCache(model, **small_budget_overrides())
    out = generate_with(model, prompt, cache, num_beams=3, num_return_sequences=2, max_new_tokens=8)
    assert out.sequences.shape == (2, PROMPT + 8)
    assert_compressed(cache)
    assert cache.layers[0].prompt.a.shape[0] == 3  # one row per beam


def test_several_return_sequences_with_sampling(model, prompt):
    outs = {}
    for name, cache in both_caches(model).items():
        torch.manual_seed(3)
        outs[name] = generate_with(model, prompt, cache, do_sample=True, num_return_sequences=2, max_new_tokens=8)
    assert outs["shadowkv"].sequences.shape == (2, PROMPT + 8)
    assert torch.equal(outs["shadowkv"].sequences, outs["dynamic"].sequences)

    # At a small budget too: it runs, and each returned row has its own compressed prompt.
    cache = ShadowKVCache(model, **small_budget_overrides())
    out = generate_with(model, prompt, cache, do_sample=True, num_return_sequences=2, max_new_tokens=8)
    assert out.sequences.shape == (2, PROMPT + 8)
    assert cache.layers[0].prompt.a.shape[0] == 2


def test_repeated_generate_continues_the_conversation(model, prompt):
    cache = ShadowKVCache(model, **small_budget_overrides())
    sequence = prompt
    for turn in range(3):
        out = generate_with(model, sequence, cache, max_new_tokens=4)
        assert out.sequences.shape[1] == sequence.shape[1] + 4
        assert torch.equal(out.sequences[:, : sequence.shape[1]], sequence)
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
        sequence = torch.cat([out.sequences, random_prompt(5, seed=60 + turn)], dim=1)
    for layer in cache.layers:
        assert layer.is_compressed and layer.prompt.slots == PROMPT  # the first fill stays the compressed part


def test_crop_of_generated_tokens_matches_dynamic_cache(model, prompt):
    outs = {}
    for name, cache in both_caches(model).items():
        first = generate_with(model, prompt, cache, max_new_tokens=8)
        assert cache.get_seq_length() == PROMPT + 7
        cache.crop(-4)  # drop the last 4 generated tokens (Transformers 5.24: a negative count to remove)
        assert cache.get_seq_length() == PROMPT + 3
        # Regenerate from the cropped point: generate feeds only the tokens the cache lacks.
        second = generate_with(model, first.sequences[:, : PROMPT + 4], cache, max_new_tokens=6)
        outs[name] = (first, second)
    for out, ref in zip(outs["shadowkv"], outs["dynamic"]):
        assert torch.equal(out.sequences, ref.sequences)
        assert_logits_close(out.logits, ref.logits)


def test_crop_zero_is_a_no_op(model, prompt):
    """`crop(0)` removes nothing (Transformers 5.x calls it, e.g. in assisted decoding when all drafts match)."""
    caches = both_caches(model)
    for cache in caches.values():
        generate_with(model, prompt, cache, max_new_tokens=4)
    caches["dynamic"].crop(0)
    assert caches["dynamic"].get_seq_length() == PROMPT + 3
    caches["shadowkv"].crop(0)
    assert caches["shadowkv"].get_seq_length() == PROMPT + 3


@pytest.mark.parametrize("assisted", [dict(prompt_lookup_num_tokens=3), "assistant_model"])
def test_assisted_decoding_raises_before_any_forward(assisted):
    """Assisted decoding verifies drafts in the prompt's fill, then crops them: not supported, said plainly."""
    model = tiny_model("qwen2")
    kwargs = dict(assistant_model=tiny_model("qwen2")) if assisted == "assistant_model" else assisted
    cache = ShadowKVCache(model, **full_budget_overrides())
    with pytest.raises(NotImplementedError, match="assisted decoding"):
        generate_with(model, random_prompt(PROMPT, seed=51), cache, max_new_tokens=4, **kwargs)
    assert cache.get_seq_length() == 0


def test_crop_into_the_compressed_prompt_raises_and_changes_nothing(model, prompt):
    cache = ShadowKVCache(model, **full_budget_overrides())
    generate_with(model, prompt, cache, max_new_tokens=4)
    length = cache.get_seq_length()
    with pytest.raises(NotImplementedError, match="compressed"):
        cache.crop(-(length - PROMPT + 1))
    assert cache.get_seq_length() == length
    cache.crop(-(length - PROMPT))  # down to exactly the compressed prompt is fine
    assert cache.get_seq_length() == PROMPT


def test_batch_select_indices_keeps_the_row_consistent(model):
    """Keep row 1 of a 2-row cache and continue decoding: same as continuing row 1 alone."""
    overrides = small_budget_overrides()
    rows = [random_prompt(260, seed=70)[0], random_prompt(190, seed=71)[0]]
    ids, mask = left_pad(rows)

    cache = ShadowKVCache(model, **overrides)
    first = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=5)
    cache.batch_select_indices(torch.tensor([1]))
    seq1 = torch.cat([first.sequences[1:], random_prompt(3, seed=72)], dim=1)
    mask1 = torch.cat([mask[1:], torch.ones((1, seq1.shape[1] - mask.shape[1]), dtype=torch.long)], dim=1)
    cont = generate_with(model, seq1, cache, attention_mask=mask1, max_new_tokens=6)

    alone_cache = ShadowKVCache(model, **overrides)
    alone_first = generate_with(model, rows[1][None], alone_cache, max_new_tokens=5)
    assert torch.equal(alone_first.sequences[0, 190:], first.sequences[1, 260:])
    alone_seq = torch.cat([alone_first.sequences, seq1[:, -3:]], dim=1)
    alone = generate_with(model, alone_seq, alone_cache, max_new_tokens=6)

    assert torch.equal(cont.sequences[0, seq1.shape[1] :], alone.sequences[0, alone_seq.shape[1] :])
    assert_logits_close(cont.logits, alone.logits)
    assert cache.layers[0].prompt.a.shape[0] == 1


def test_reorder_cache_swaps_rows(model):
    """`reorder_cache` (beam search's row shuffle) moves every per-row tensor with its row."""
    overrides = small_budget_overrides()
    rows = [random_prompt(260, seed=80)[0], random_prompt(230, seed=81)[0]]
    ids, mask = left_pad(rows)
    straight, swapped = ShadowKVCache(model, **overrides), ShadowKVCache(model, **overrides)
    first = generate_with(model, ids, straight, attention_mask=mask, max_new_tokens=4)
    generate_with(model, ids, swapped, attention_mask=mask, max_new_tokens=4)
    swapped.reorder_cache(torch.tensor([1, 0]))

    turn = random_prompt(2, batch=2, seed=82)
    seq = torch.cat([first.sequences, turn], dim=1)
    mask = torch.cat([mask, torch.ones((2, seq.shape[1] - mask.shape[1]), dtype=torch.long)], dim=1)
    a = generate_with(model, seq, straight, attention_mask=mask, max_new_tokens=6)
    b = generate_with(model, seq.flip(0), swapped, attention_mask=mask.flip(0), max_new_tokens=6)
    assert torch.equal(a.sequences, b.sequences.flip(0))
    assert_logits_close([step.flip(0) for step in b.logits], a.logits)


def test_batch_repeat_interleave_copies_a_compressed_row(model, prompt):
    """Repeating a compressed row (e.g. several questions over one prefilled document) gives equal rows."""
    overrides = small_budget_overrides()
    cache = ShadowKVCache(model, **overrides)
    first = generate_with(model, prompt, cache, max_new_tokens=4)
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].prompt.a.shape[0] == 2
    # Rows share the host values instead of copying them.
    assert cache.layers[0].prompt.values.data.shape[0] == 1
    seq = torch.cat([first.sequences, random_prompt(3, seed=83)], dim=1)
    both = generate_with(model, seq.expand(2, -1), cache, max_new_tokens=5)

    alone_cache = ShadowKVCache(model, **overrides)
    generate_with(model, prompt, alone_cache, max_new_tokens=4)
    alone = generate_with(model, seq, alone_cache, max_new_tokens=5)
    for row in range(2):
        assert torch.equal(both.sequences[row], alone.sequences[0])
        assert_logits_close([step[row : row + 1] for step in both.logits], alone.logits)


def test_reset_cache_is_reusable_for_a_new_prompt(model, prompt):
    overrides = small_budget_overrides()
    cache = ShadowKVCache(model, **overrides)
    generate_with(model, prompt, cache, max_new_tokens=4)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert not any(layer.is_compressed for layer in cache.layers)
    other = random_prompt(200, seed=84)
    reused = generate_with(model, other, cache, max_new_tokens=8)
    fresh = generate_with(model, other, ShadowKVCache(model, **overrides), max_new_tokens=8)
    assert torch.equal(reused.sequences, fresh.sequences)
    assert_logits_close(reused.logits, fresh.logits)
    assert all(layer.prompt.slots == 200 for layer in cache.layers)
