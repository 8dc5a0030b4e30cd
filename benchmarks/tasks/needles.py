"""Needle in a haystack, RULER-style (Hsieh et al., "RULER", COLM 2024, https://arxiv.org/abs/2404.06654).

A needle is "One of the special magic {kind} for {key} is: {value}." hidden in a haystack; the question asks
for the value(s) of one or more keys. Variants (RULER's names, plus a word-valued one):

| variant            | haystack | needles                                   | values  |
|--------------------|----------|-------------------------------------------|---------|
| niah_single_1      | noise    | 1                                         | number  |
| niah_single_2      | prose    | 1                                         | number  |
| niah_single_3      | prose    | 1                                         | uuid    |
| niah_single_word   | noise    | 1                                         | word    |
| niah_multikey_1    | noise    | 1 asked + 3 distractor keys               | number  |
| niah_multikey_2    | needles  | 1 asked; the haystack is other needles    | number  |
| niah_multikey_3    | needles  | as above, keys and values are UUIDs       | uuid    |
| niah_multivalue    | noise    | 4 values for the asked key                | number  |
| niah_multiquery    | noise    | 4 keys, all asked in one question         | number  |

"noise" is RULER's repeated filler paragraph, "prose" the Python reference documentation (natural text),
"needles" a haystack made of needles for other keys. Numbers have 7 digits. Score: the share of expected values
found in the answer (RULER's string match).
"""

from __future__ import annotations

import random

from .common import (
    Sample,
    Turn,
    count_tokens,
    insert_at_depths,
    noise_sentences,
    prose_paragraphs,
    random_key,
    random_value,
    recall_score,
)

__all__ = ["VARIANTS", "generate", "score"]

VARIANTS: dict[str, dict] = {
    "niah_single_1": dict(haystack="noise", value="number"),
    "niah_single_2": dict(haystack="prose", value="number"),
    "niah_single_3": dict(haystack="prose", value="uuid"),
    "niah_single_word": dict(haystack="noise", value="word"),
    "niah_multikey_1": dict(haystack="noise", value="number", distractors=3),
    "niah_multikey_2": dict(haystack="needles", value="number"),
    "niah_multikey_3": dict(haystack="needles", value="uuid", key="uuid"),
    "niah_multivalue": dict(haystack="noise", value="number", values=4),
    "niah_multiquery": dict(haystack="noise", value="number", queries=4),
}
_KIND = {"number": "numbers", "word": "words", "uuid": "uuids"}
_VALUE_TOKENS = {"number": 9, "word": 4, "uuid": 40}  # answer tokens per value, with separators


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def generate(seed: int, n_tokens: int, tokenizer, variant: str = "niah_single_1") -> Sample:
    """One sample of about `n_tokens` prompt tokens (haystack, needles and question)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown needle variant {variant!r}; choose from {sorted(VARIANTS)}")
    spec = VARIANTS[variant]
    rng = random.Random(f"{variant}/{seed}")
    value_kind, key_kind = spec["value"], spec.get("key", "words")
    kind = _KIND[value_kind]
    n_values, n_queries = spec.get("values", 1), spec.get("queries", 1)

    keys: list[str] = []
    while len(keys) < n_queries + spec.get("distractors", 0):  # distinct keys
        key = random_key(rng, key_kind)
        keys.append(key) if key not in keys else None
    asked = keys[:n_queries]
    values = {k: [random_value(rng, value_kind) for _ in range(n_values if k in asked else 1)] for k in keys}
    needles = [_needle(kind, k, v) for k in keys for v in values[k]]

    header = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards."
    )
    query = asked[0] if n_queries == 1 else ", ".join(asked[:-1]) + " and " + asked[-1]
    if n_values == 1 and n_queries == 1:
        question = f"What is the special magic {kind[:-1]} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind[:-1]} for {query} mentioned in the provided text is:"
    else:
        question = f"What are all the special magic {kind} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {query} mentioned in the provided text are:"
    expected = [v for k in asked for v in values[k]]

    room = (
        n_tokens
        - count_tokens(tokenizer, header + question + prefix)
        - 60
        - sum(count_tokens(tokenizer, n) for n in needles)
    )
    haystack = spec["haystack"]
    if haystack == "noise":
        units, sep = noise_sentences(tokenizer, room), " "
    elif haystack == "prose":
        units, sep = prose_paragraphs(tokenizer, room, rng), "\n\n"
    else:  # a haystack of needles for other keys
        per = count_tokens(tokenizer, _needle(kind, random_key(rng, key_kind), random_value(rng, value_kind))) + 1
        units, sep = [], " "
        while len(units) * per < room:
            key = random_key(rng, key_kind)
            if key not in keys:
                units.append(_needle(kind, key, random_value(rng, value_kind)))
    depths = [rng.uniform(0.05, 0.95) for _ in needles]
    context = header + "\n\n" + sep.join(insert_at_depths(units, list(zip(depths, needles))))
    gold = " " + ", ".join(expected) + "."
    turn = Turn(question, prefix, expected, gold, max_new_tokens=_VALUE_TOKENS[value_kind] * len(expected) + 2)
    return Sample(variant, seed, context, (turn,), {"depths": depths, "haystack": haystack})


def score(expected: list[str], answer: str) -> float:
    return recall_score(expected, answer)
