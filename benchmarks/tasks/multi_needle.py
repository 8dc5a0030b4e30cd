"""Multi-needle retrieval: many needles spread across the context, all asked in one question (context-intensive,
after NeedleBench v2's multi-needle retrieval used by the context-intensive study, seed 004 §3).

`num_needles` (default 10) facts "The special magic number for {key} is: {value}." sit at evenly spread depths
(with jitter) in a noise or prose haystack; the question lists every key and asks for all the values in one
answer: by default the values alone, in the asked order, comma-separated (full attention on SmolLM2 finds
8-9 of 10 at 1K tokens this way, against 5-6 of 10 with "key: value" lines, at a third of the tokens);
`answer="lines"` asks for the lines. Values are 7-digit numbers (or one-token words). Score: the share of the
values found in the answer.
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

__all__ = ["generate", "score"]


def generate(
    seed: int,
    n_tokens: int,
    tokenizer,
    num_needles: int = 10,
    haystack: str = "noise",
    value: str = "number",
    answer: str = "list",
) -> Sample:
    rng = random.Random(f"multi_needle/{seed}")
    keys: list[str] = []
    while len(keys) < num_needles:
        key = random_key(rng)
        keys.append(key) if key not in keys else None
    values: list[str] = []
    while len(values) < num_needles:  # distinct values, so each found value names one needle
        v = random_value(rng, value)
        values.append(v) if v not in values and v not in " ".join(keys) else None
    kind = {"word": "word", "number": "number"}[value]
    needles = [f"The special magic {kind} for {k} is: {v}." for k, v in zip(keys, values)]
    depths = [(i + rng.uniform(0.1, 0.9)) / num_needles for i in range(num_needles)]

    header = f"Some special magic {kind}s are hidden within the following text. Make sure to memorize them."
    if answer == "lines":  # "key: value" lines, the first key given
        ask, prefix = f"Answer with one line per name, in the form name: {kind}.", f"{keys[0]}:"
        gold = f" {values[0]}\n" + "\n".join(f"{k}: {v}" for k, v in zip(keys[1:], values[1:]))
    elif answer == "list":  # the values alone, in the asked order
        ask = f"Answer with the {num_needles} {kind}s only, in this order, separated by commas."
        prefix, gold = f"The special magic {kind}s are:", " " + ", ".join(values) + "."
    else:
        raise ValueError(f"unknown answer form {answer!r}; use 'lines' or 'list'")
    question = f"What are the special magic {kind}s for " + ", ".join(keys) + "? " + ask
    room = n_tokens - count_tokens(tokenizer, header + question + prefix + " ".join(needles)) - 60
    if haystack == "noise":
        units, sep = noise_sentences(tokenizer, room), " "
    elif haystack == "prose":
        units, sep = prose_paragraphs(tokenizer, room, rng), "\n\n"
    else:
        raise ValueError(f"unknown haystack {haystack!r}; use 'noise' or 'prose'")
    context = header + "\n\n" + sep.join(insert_at_depths(units, list(zip(depths, needles))))
    turn = Turn(question, prefix, values, gold, max_new_tokens=count_tokens(tokenizer, gold) + 4)
    return Sample("multi_needle", seed, context, (turn,), {"keys": keys, "depths": depths, "haystack": haystack})


def score(expected: list[str], answer: str) -> float:
    return recall_score(expected, answer)
