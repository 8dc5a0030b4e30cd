"""The ids a cache holds (hf/held_ids.py): `generate` makes the cache hold a prefix of its ids (dropping exact tokens
from the first difference on) or refuses ids that differ inside the compressed prompt; a call with other rows is
refused naming the fix; `save_prefix` knows a plain forward's ids. The reference is a fresh cache (or
`DynamicCache`) given the same ids: what `generate` should answer.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
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

from shadowkv_cache import PrefixCacheError, ShadowKVCache
from shadowkv_cache.hf.held_ids import HeldIds

PROMPT = 120  # compressed (min_compress_len 64)
NEW = 5


def answer(model, ids, cache, **kwargs):
    return generate_with(model, ids, cache, max_new_tokens=NEW, **kwargs)


@pytest.mark.parametrize("mode", ["shadowkv", "yakv"])
def test_a_question_asked_of_a_document_that_answered_another_gets_a_fresh_forks_answer(mode):
    model = tiny_model("llama")
    settings = full_budget_overrides() if mode == "shadowkv" else {"mode": "yakv", "min_compress_len": 64}
    doc = random_prompt(PROMPT, seed=1)
    first, second = random_prompt(6, seed=2), random_prompt(9, seed=3)
    cache = ShadowKVCache.prefill(model, doc, **settings)
    answer(model, torch.cat([doc, first], 1), cache.fork())  # the document itself is left as it is
    fresh = cache.fork()
    answer(model, torch.cat([doc, first], 1), cache)
    # The second question does not follow the first answer: the cache drops what came after the document.
    got = answer(model, torch.cat([doc, second], 1), cache)
    want = answer(model, torch.cat([doc, second], 1), fresh)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    again = answer(model, torch.cat([doc, second], 1), cache)  # the same ids again regenerate the answer
    assert torch.equal(again.sequences, want.sequences)


def test_a_conversation_rendered_again_with_other_tokens_gives_dynamic_caches_tokens():
    model = tiny_model("llama")
    doc, question, follow = random_prompt(PROMPT, seed=4), random_prompt(5, seed=5), random_prompt(4, seed=6)
    cache = ShadowKVCache(model, **full_budget_overrides())
    one = answer(model, torch.cat([doc, question], 1), cache)
    rendered = one.sequences.clone()
    rendered[0, -2] = (rendered[0, -2] % 50) + 1  # the answer tokenised otherwise when the chat is rendered again
    ids = torch.cat([rendered, follow], 1)
    got = answer(model, ids, cache)
    want = answer(model, ids, dynamic_cache(model))
    assert torch.equal(got.sequences, want.sequences)


def test_ids_that_differ_inside_the_compressed_prompt_are_refused_and_change_nothing():
    model = tiny_model("llama")
    doc, question = random_prompt(PROMPT, seed=9), random_prompt(5, seed=10)
    cache = ShadowKVCache(model, **small_budget_overrides())
    one = answer(model, torch.cat([doc, question], 1), cache)
    held = cache.get_seq_length()
    other = doc.clone()
    other[0, 30] = (other[0, 30] % 50) + 1
    with pytest.raises(ValueError, match="position 30.*compressed"):  # the question is compressed too
        answer(model, torch.cat([other, question], 1), cache)
    with pytest.raises(ValueError, match=f"first {PROMPT} of the {held} tokens"):
        answer(model, doc, cache)
    assert cache.get_seq_length() == held
    follow = random_prompt(3, seed=11)
    got = answer(model, torch.cat([one.sequences, follow], 1), cache)  # the conversation goes on as if none came
    fresh = ShadowKVCache(model, **small_budget_overrides())
    answer(model, torch.cat([doc, question], 1), fresh)
    want = answer(model, torch.cat([one.sequences, follow], 1), fresh)
    assert torch.equal(got.sequences, want.sequences)


def test_a_call_with_other_rows_is_refused_naming_the_fix_before_anything_changes():
    model = tiny_model("llama")
    ids = random_prompt(PROMPT, batch=2, seed=12)
    cache = ShadowKVCache(model, **small_budget_overrides())
    answer(model, ids, cache)
    held = cache.get_seq_length()
    with pytest.raises(ValueError, match=r"holds 2 row\(s\); the call has 1.*fork"):
        answer(model, ids[:1], cache)
    with pytest.raises(ValueError, match=r"holds 2 row\(s\); the call has 3"):
        forward_with(model, random_prompt(1, batch=3), cache)
    assert cache.get_seq_length() == held


def test_padded_rows_continue_and_unknown_ids_turn_the_checks_off():
    model = tiny_model("llama")
    ids, mask = left_pad([random_prompt(PROMPT, seed=13)[0], random_prompt(PROMPT - 9, seed=14)[0]])
    cache = ShadowKVCache(model, **full_budget_overrides())
    one = answer(model, ids, cache, attention_mask=mask)
    follow = random_prompt(3, batch=2, seed=15)
    two_ids = torch.cat([one.sequences, follow], 1)
    two_mask = torch.cat([mask, torch.ones_like(two_ids[:, mask.shape[1] :])], 1)
    reference = dynamic_cache(model)
    want_one = answer(model, ids, reference, attention_mask=mask)
    want = answer(model, two_ids, reference, attention_mask=two_mask)
    got = answer(model, two_ids, cache, attention_mask=two_mask)
    assert torch.equal(want_one.sequences, one.sequences) and torch.equal(got.sequences, want.sequences)
    # Filled from embeddings, the cache does not know its ids: nothing is checked or dropped.
    embedded = ShadowKVCache(model, **full_budget_overrides())
    forward_with(model, None, embedded, inputs_embeds=model.get_input_embeddings()(ids[:1]))
    assert embedded._held.ids is None
    answer(model, torch.cat([ids[:1], follow[:1]], 1), embedded)


def test_beam_search_then_a_new_turn_is_not_refused():
    model = tiny_model("llama")
    ids = random_prompt(PROMPT, seed=16)
    cache = ShadowKVCache(model, **full_budget_overrides())
    reference = dynamic_cache(model)
    got = answer(model, ids, cache, num_beams=2)
    want = answer(model, ids, reference, num_beams=2)
    assert torch.equal(got.sequences, want.sequences)
    assert cache._held.ids is None  # the beams reordered the rows: no longer followed


def test_held_ids_grow_crop_and_go_back_to_a_checkpoint():
    held = HeldIds()
    held.record(torch.arange(100)[None], 0, 100)
    saved = held.checkpoint()
    for step in range(100, 300):
        held.record(torch.tensor([[step]]), step, step + 1)
    assert torch.equal(held.ids, torch.arange(300)[None])
    held.crop(250)
    assert torch.equal(held.ids, torch.arange(250)[None])
    held.restore(saved)
    assert torch.equal(held.ids, torch.arange(100)[None])
    held.record(torch.arange(5)[None], 90, 95)  # not where the record ends: no longer known
    assert held.ids is None and not held.known
    assert torch.equal(HeldIds(torch.arange(4)[None]).repeated(3).ids, torch.arange(4).expand(3, -1))
    assert held.first_difference(torch.arange(4)[None]) is None
    known = HeldIds(torch.arange(6)[None])
    assert known.first_difference(torch.tensor([[0, 1, 2, 9, 4]])) == 3
    assert known.first_difference(torch.arange(4)[None]) == 4
    assert known.first_difference(torch.arange(9)[None]) == 6


class Disconnect(Exception):
    """A client that goes away while an answer streams."""


class FailingStreamer:
    def __init__(self, after: int):
        self.left = after + 1  # the prompt comes first

    def put(self, value):
        self.left -= 1
        if self.left < 0:
            raise Disconnect

    def end(self):
        pass


@pytest.mark.parametrize("extra", [0, 150], ids=["short-turn", "turn-that-grows-the-record"])
def test_a_call_that_fails_after_dropping_tokens_leaves_a_prefix_that_later_calls_continue(extra):
    model = tiny_model("llama")
    doc, question = random_prompt(PROMPT, seed=20), random_prompt(5, seed=21)
    cache, reference = ShadowKVCache(model, **full_budget_overrides()), dynamic_cache(model)
    one = answer(model, torch.cat([doc, question], 1), cache)
    answer(model, torch.cat([doc, question], 1), reference)
    rendered = one.sequences.clone()
    rendered[0, -2] = (rendered[0, -2] % 50) + 1
    with pytest.raises(Disconnect):  # the cache dropped its last tokens, then the call failed
        answer(model, torch.cat([rendered, random_prompt(3 + extra, seed=22)], 1), cache, streamer=FailingStreamer(2))
    with pytest.raises(ValueError, match="num_return_sequences"):  # refused by generate itself, after the drop
        answer(model, torch.cat([rendered, random_prompt(4, seed=23)], 1), cache, num_return_sequences=2)
    follow = torch.cat([one.sequences, random_prompt(3, seed=24)], 1)  # the conversation as it was
    got, want = answer(model, follow, cache), answer(model, follow, reference)
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize("order", [["sliding_attention", "full_attention"], ["full_attention", "sliding_attention"]])
def test_a_sliding_layer_past_its_window_refuses_before_any_layer_drops_tokens(order):
    model = make_tiny_model("gemma3_text", layer_types=order * 2)
    doc, question = random_prompt(PROMPT, seed=30), random_prompt(5, seed=31)
    cache, reference = ShadowKVCache(model, **full_budget_overrides()), dynamic_cache(model)
    one = answer(model, torch.cat([doc, question], 1), cache)
    answer(model, torch.cat([doc, question], 1), reference)
    lengths = [layer.get_seq_length() for layer in cache.layers]
    rendered = one.sequences.clone()
    rendered[0, -3] = (rendered[0, -3] % 50) + 1
    with pytest.raises(ValueError, match="sliding-window layer keeps only its last"):
        answer(model, torch.cat([rendered, random_prompt(3, seed=32)], 1), cache)
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    follow = torch.cat([one.sequences, random_prompt(3, seed=33)], 1)
    got, want = answer(model, follow, cache), answer(model, follow, reference)
    assert torch.equal(got.sequences, want.sequences)


def test_a_document_advanced_by_a_plain_forward_answers_the_question_generate_gets():
    model = tiny_model("llama")
    doc, fed, asked = random_prompt(PROMPT, seed=40), random_prompt(3, seed=41), random_prompt(6, seed=42)
    document = ShadowKVCache.prefill(model, doc, **full_budget_overrides())
    cache = document.fork()
    forward_with(model, fed, cache)  # a question fed by hand, then generate is asked another
    got = answer(model, torch.cat([doc, asked], 1), cache)
    want = answer(model, torch.cat([doc, asked], 1), document.fork())
    assert torch.equal(got.sequences, want.sequences)


def test_a_refused_first_generate_leaves_an_exact_document_as_it_was():
    model = tiny_model("llama")
    doc, question = random_prompt(40, seed=50), random_prompt(5, seed=51)  # kept exact: every token could be dropped
    document = ShadowKVCache.prefill(model, doc, **full_budget_overrides())
    other = doc.clone()
    other[0, 10] = (other[0, 10] % 50) + 1
    with pytest.raises(PrefixCacheError, match="differs first at token 10"):
        answer(model, torch.cat([other, question], 1), document)
    assert document.get_seq_length() == 40 and torch.equal(document._held.ids, doc)
    document.fork()  # still a document alone


def test_save_prefix_writes_the_ids_the_cache_holds_after_a_crop_and_a_refill(tmp_path):
    model = tiny_model("llama")
    doc, refill = random_prompt(40, seed=52), random_prompt(10, seed=53)
    cache = ShadowKVCache.prefill(model, doc, **full_budget_overrides())
    cache.crop(-10)
    forward_with(model, refill, cache)  # 40 tokens again, the last 10 other than the document's
    cache.save_prefix(tmp_path / "x.safetensors")
    held = torch.cat([doc[:, :30], refill], 1)
    assert torch.equal(ShadowKVCache.load_prefix(model, tmp_path / "x.safetensors").prefix_ids, held[0])
    with pytest.raises(PrefixCacheError, match="not the document this cache holds"):
        cache.save_prefix(tmp_path / "y.safetensors", input_ids=doc)


def test_a_crop_that_one_layer_cannot_make_changes_no_layer():
    model = make_tiny_model("gemma3_text", layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=256)
    cache = ShadowKVCache(model, **full_budget_overrides())
    answer(model, random_prompt(PROMPT, seed=54), cache)
    lengths = [layer.get_seq_length() for layer in cache.layers]
    with pytest.raises(NotImplementedError, match="compressed"):
        cache.crop(-30)  # the sliding layers could, the compressed ones cannot
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    assert cache._held.ids.shape[1] == lengths[0]
