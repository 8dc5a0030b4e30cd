"""Generated long-context tasks with their scorers (our own templates and code, seeded; nothing is downloaded).

`TASKS` maps a task name to `(generate, score)`: `generate(seed, n_tokens, tokenizer) -> Sample` and
`score(expected, answer) -> float in [0, 1]`, where `answer` is the assistant's whole answer (the turn's
`answer_prefix` followed by what the model wrote).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from . import multi_needle, multi_turn, needles, text2json, variable_tracking, word_extraction
from .common import Sample, Turn

__all__ = ["TASKS", "Sample", "Task", "Turn"]


class Task(NamedTuple):
    generate: Callable[..., Sample]  # (seed, n_tokens, tokenizer) -> Sample
    score: Callable[[object, str], float]  # (expected, answer) -> [0, 1]
    context_intensive: bool  # needs many facts from the context (not one needle)


TASKS: dict[str, Task] = {
    **{
        name: Task(functools.partial(needles.generate, variant=name), needles.score, name == "niah_multiquery")
        for name in needles.VARIANTS
    },
    "variable_tracking": Task(variable_tracking.generate, variable_tracking.score, False),
    "common_words": Task(word_extraction.generate_common, word_extraction.score, True),
    "frequent_words": Task(word_extraction.generate_frequent, word_extraction.score, True),
    "multi_needle": Task(multi_needle.generate, multi_needle.score, True),
    "text2json": Task(text2json.generate, text2json.score, True),
    "multi_turn": Task(multi_turn.generate, multi_turn.score, False),
}
