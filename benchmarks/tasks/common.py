"""What every generated task returns, and the haystacks they share.

Legend: a *sample* is one document (`context`) and one or more *turns*; each turn is a question, a prefix that
starts the assistant's answer (RULER's answer prefix, so short answers come first), the expected answer in the
task's own form, and a perfect answer (`gold`) that continues the prefix.

Generators are seeded (`random.Random(seed)`), so a seed always gives the same sample.
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "NOISE",
    "Sample",
    "Turn",
    "count_tokens",
    "insert_at_depths",
    "noise_sentences",
    "prose_paragraphs",
    "random_key",
    "random_value",
    "recall_score",
]

# RULER's noise haystack: one repeated paragraph of filler sentences.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class Turn:
    question: str
    answer_prefix: str  # the assistant's answer starts with it; the model continues it
    expected: Any  # what the task's `score` compares with (a list of strings, a list of records ...)
    gold: str  # a perfect continuation of `answer_prefix` (used as history in multi-turn runs and in tests)
    max_new_tokens: int


@dataclass(frozen=True)
class Sample:
    task: str
    seed: int
    context: str
    turns: tuple[Turn, ...]
    meta: dict = field(default_factory=dict)


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def noise_sentences(tokenizer, n_tokens: int) -> list[str]:
    """RULER's noise paragraph repeated to about `n_tokens` tokens, as a list of sentences."""
    sentences = [s.strip() + "." for s in NOISE.split(".") if s.strip()]
    per_round = count_tokens(tokenizer, NOISE) + 1
    rounds = max(1, round(n_tokens / per_round))
    return sentences * rounds


@functools.cache
def _prose_text() -> tuple[str, ...]:
    from pydoc_data.topics import topics  # long natural English that every CPython ships

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return tuple(p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 80)


def prose_paragraphs(tokenizer, n_tokens: int, rng: random.Random) -> list[str]:
    """Consecutive paragraphs of the Python reference docs from a random start, about `n_tokens` tokens."""
    paragraphs = _prose_text()
    start = rng.randrange(len(paragraphs) // 2)
    out, total = [], 0
    for p in paragraphs[start:] + paragraphs[:start]:
        cost = count_tokens(tokenizer, p) + 2
        if out and total + cost > n_tokens:
            break
        out.append(p)
        total += cost
    return out


def insert_at_depths(units: list[str], inserts: list[tuple[float, str]]) -> list[str]:
    """Insert each `(depth in [0, 1], text)` between units at that depth; inserts keep their order."""
    out = list(units)
    for depth, text in sorted(inserts, key=lambda x: x[0], reverse=True):  # deepest first: indices stay valid
        out.insert(round(depth * len(units)), text)
    return out


def random_key(rng: random.Random, kind: str = "words") -> str:
    from .words import ADJECTIVES, NOUNS

    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def random_value(rng: random.Random, kind: str) -> str:
    from .words import NOUNS

    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return rng.choice(NOUNS)
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown value kind {kind!r}; use 'number', 'word' or 'uuid'")


def recall_score(expected: list[str], answer: str) -> float:
    """RULER's string match: the share of expected strings found in the answer (case-insensitive, as whole words:
    "cat" is not found in "category", nor 1234567 in 12345678)."""
    if not expected or not isinstance(answer, str):
        return 0.0
    text = answer.lower()
    return sum(re.search(rf"(?<![\w-]){re.escape(e.lower())}(?![\w-])", text) is not None for e in expected) / len(
        expected
    )
