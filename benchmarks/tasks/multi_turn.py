"""Multi-turn needles: several questions asked one after another on the same cache, each needing another needle.

The case that separates offloading from eviction: a cache that dropped tokens at prefill (StreamingLLM) or
kept only what the first question looked at (SnapKV) cannot answer later questions, while an offloading cache
can fetch any chunk at any turn. Keys are single-token nouns, so every row's turns have the same length and
rows can be batched; the history holds the gold answers (teacher-forced), so each turn is scored on its own.
Score of a turn: 1 if its number is in the answer; of a sample: the mean over turns.
"""

from __future__ import annotations

import random

from .common import Sample, Turn, count_tokens, insert_at_depths, noise_sentences, random_value, recall_score
from .words import NOUNS

__all__ = ["generate", "score"]


def _single_token_nouns(tokenizer) -> list[str]:
    return [n for n in NOUNS if count_tokens(tokenizer, f" {n}") == 1 and count_tokens(tokenizer, f"{n}") == 1]


def generate(seed: int, n_tokens: int, tokenizer, num_turns: int = 4) -> Sample:
    rng = random.Random(f"multi_turn/{seed}")
    keys = rng.sample(_single_token_nouns(tokenizer), k=num_turns)
    values = [random_value(rng, "number") for _ in keys]
    needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    depths = [(i + rng.uniform(0.1, 0.9)) / num_turns for i in range(num_turns)]
    order = rng.sample(range(num_turns), k=num_turns)  # asked in a shuffled order
    header = "Some special magic numbers are hidden within the following text. Make sure to memorize them."
    turns = tuple(
        Turn(
            f"What is the special magic number for {keys[i]}?",
            f"The special magic number for {keys[i]} is:",
            [values[i]],
            f" {values[i]}.",
            max_new_tokens=10,
        )
        for i in order
    )
    room = n_tokens - count_tokens(tokenizer, header + " ".join(needles)) - 40 * num_turns - 60
    context = header + "\n\n" + " ".join(insert_at_depths(noise_sentences(tokenizer, room), list(zip(depths, needles))))
    return Sample("multi_turn", seed, context, turns, {"depths": [depths[i] for i in order]})


def score(expected: list[str], answer: str) -> float:
    return recall_score(expected, answer)
