"""Generated benchmark tasks and their scorers (benchmarks/tasks/): seeded, perfect answers score 1, empty or
malformed answers 0, bad JSON is handled, Text2JSON's IoU gives partial credit.

Generators only count tokens, so most tests use a whitespace tokenizer (every word one token); one test renders
real chat prompts with SmolLM2's tokenizer.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.tasks import TASKS
from benchmarks.tasks.text2json import parse_records
from benchmarks.tasks.text2json import score as text2json_score


class WordTokenizer:
    """Counts words and punctuation as tokens (what the generators need from a tokenizer)."""

    class _Out:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=False):
        return self._Out(list(range(len(re.findall(r"\w+|[^\w\s]", text)))))


TOK = WordTokenizer()
N_TOKENS = 600


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generation_is_deterministic_per_seed(name):
    a, b = TASKS[name].generate(3, N_TOKENS, TOK), TASKS[name].generate(3, N_TOKENS, TOK)
    assert a == b
    other = TASKS[name].generate(4, N_TOKENS, TOK)
    assert (other.context, other.turns) != (a.context, a.turns)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_prompt_is_about_the_asked_length(name):
    sample = TASKS[name].generate(0, N_TOKENS, TOK)
    text = sample.context + " ".join(t.question + t.answer_prefix for t in sample.turns)
    assert 0.7 * N_TOKENS <= len(TOK(text).input_ids) <= 1.15 * N_TOKENS


@pytest.mark.parametrize("name", sorted(TASKS))
def test_perfect_answer_scores_one_and_empty_or_malformed_zero(name):
    task = TASKS[name]
    for seed in range(3):
        for turn in task.generate(seed, N_TOKENS, TOK).turns:
            assert task.score(turn.expected, turn.answer_prefix + turn.gold) == 1.0
            assert task.score(turn.expected, "") == 0.0
            assert task.score(turn.expected, turn.answer_prefix) == 0.0  # the prefix never gives the answer away
            assert task.score(turn.expected, 'I do not know. {[}] ```json\n[{"name": ') == 0.0


@pytest.mark.parametrize("name", sorted(TASKS))
@settings(max_examples=25, deadline=None)
@given(answer=st.text(max_size=200))
def test_scores_stay_in_the_unit_interval_for_any_answer(name, answer):
    turn = TASKS[name].generate(1, 300, TOK).turns[0]
    assert 0.0 <= TASKS[name].score(turn.expected, answer) <= 1.0


def test_needle_answers_must_match_whole_values():
    score = TASKS["niah_single_1"].score
    assert score(["1234567"], "The number is 12345678.") == 0.0
    assert score(["1234567"], "It is 1234567.") == 1.0
    assert TASKS["niah_single_word"].score(["cat"], "a category") == 0.0
    assert TASKS["niah_multivalue"].score(["1111111", "2222222", "3333333", "4444444"], "1111111, 3333333") == 0.5


def test_variable_tracking_does_not_reward_listing_every_variable():
    sample = TASKS["variable_tracking"].generate(0, N_TOKENS, TOK)
    turn = sample.turns[0]
    every = turn.expected + [n for chain in sample.meta["distractor_chains"] for n in chain]
    assert TASKS["variable_tracking"].score(turn.expected, " ".join(every)) == 0.5
    assert TASKS["variable_tracking"].score(turn.expected, " ".join(turn.expected[:2])) == pytest.approx(2 / 5)


def test_multi_turn_turns_ask_for_different_needles():
    sample = TASKS["multi_turn"].generate(0, N_TOKENS, TOK)
    answers = [t.expected[0] for t in sample.turns]
    assert len(sample.turns) == 4 and len(set(answers)) == 4
    assert all(f"is: {a}." in sample.context for a in answers)


def test_multi_needle_spreads_ten_needles_over_the_context():
    sample = TASKS["multi_needle"].generate(0, 2000, TOK)
    values = sample.turns[0].expected
    assert len(values) >= 10
    where = sorted(sample.context.index(f"is: {v}.") / len(sample.context) for v in values)
    assert where[0] < 0.15 and where[-1] > 0.85


# -- Text2JSON ----------------------------------------------------------------------------------------------------

GOLD = [
    {"name": "Quiet Lamp", "price": "120", "color": "red"},
    {"name": "Bold Kettle", "price": "45", "color": "blue"},
    {"name": "Calm Jacket", "price": "300", "color": "green"},
]


def test_text2json_iou_gives_partial_credit():
    # Two matched records (one with one wrong field of two), one missing, one spurious:
    # (1 + 0.5) / (2 matched + 1 missing + 1 spurious).
    answer = json.dumps(
        [
            {"name": "quiet  lamp", "price": 120, "color": "Red"},  # names and values are normalised
            {"name": "Bold Kettle", "price": "46", "color": "blue"},
            {"name": "Made Up", "price": "1", "color": "red"},
        ]
    )
    assert text2json_score(GOLD, answer) == pytest.approx(1.5 / 4)
    assert text2json_score(GOLD, json.dumps(GOLD)) == 1.0
    assert text2json_score(GOLD, json.dumps(GOLD + GOLD[:1])) == pytest.approx(3 / 4)  # a repeat is spurious


def test_text2json_handles_json_that_does_not_parse():
    assert parse_records("not json at all [{]") == []
    assert text2json_score(GOLD, '[{"name": "Quiet Lamp", "price": ') == 0.0
    # A list cut off by the token limit still counts the records that were completed.
    cut = json.dumps(GOLD)[:-30]
    assert [r["name"] for r in parse_records(cut)] == ["Quiet Lamp", "Bold Kettle"]
    assert text2json_score(GOLD, cut) == pytest.approx(2 / 3)
    assert text2json_score(GOLD, json.dumps({"name": "Quiet Lamp"})) == 0.0  # matched, but no field right
    assert text2json_score(GOLD, "[1, 2, null]") == 0.0


def test_text2json_records_are_scattered_and_typed():
    sample = TASKS["text2json"].generate(0, 1500, TOK)
    expected = sample.turns[0].expected
    assert len(expected) == 3
    assert all(r["name"] in sample.context for r in expected)
    assert f"every {sample.meta['type']}" in sample.turns[0].question


# -- rendering with a real chat template ---------------------------------------------------------------------------


@pytest.mark.slow
def test_multi_turn_rendering_puts_gold_answers_in_the_history(smollm2):
    from benchmarks.accuracy_core import render_segments

    _, tokenizer = smollm2
    samples = [TASKS["multi_turn"].generate(seed, 400, tokenizer) for seed in range(3)]
    segments = [render_segments(tokenizer, s) for s in samples]
    for k in range(1, 4):  # later turns have one length across samples, so they batch without padding
        assert len({len(seg[k]) for seg in segments}) == 1
    text = tokenizer.decode(sum(segments[0], []))
    for turn in samples[0].turns[:-1]:
        assert turn.answer_prefix + turn.gold + "<|im_end|>" in text
    assert text.endswith(samples[0].turns[-1].answer_prefix)
