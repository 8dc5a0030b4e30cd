"""Variable tracking, RULER-style: chains of assignments hidden in a noise haystack.

A chain starts with "VAR QWERT = 1234567" and continues "VAR ASDFG = VAR QWERT" ...; the question asks for
every variable that ends up holding the first chain's value. Further chains (other values) are distractors.
Score: Jaccard similarity between the variable names in the answer and the chain's names, so that listing
every variable of the text does not score.
"""

from __future__ import annotations

import random
import re
import string

from .common import Sample, Turn, count_tokens, insert_at_depths, noise_sentences, random_value

__all__ = ["generate", "score"]

_NAME = re.compile(r"\b[A-Z]{5}\b")


def generate(seed: int, n_tokens: int, tokenizer, num_chains: int = 2, num_hops: int = 4) -> Sample:
    rng = random.Random(f"variable_tracking/{seed}")
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names.append(name) if name not in names else None
    chains = [names[i * (num_hops + 1) : (i + 1) * (num_hops + 1)] for i in range(num_chains)]
    values = [random_value(rng, "number") for _ in chains]
    statements = []
    for chain, value in zip(chains, values):
        depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)  # a chain reads in order
        lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        statements += list(zip(depths, lines))

    header = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = f"Find all variables that are assigned the value {values[0]} in the text above."
    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, {num_hops + 1} variables "
        f"are assigned the value {values[0]}, they are:"
    )
    room = n_tokens - count_tokens(tokenizer, header + question + prefix) - 60 - 12 * len(statements)
    context = header + "\n\n" + " ".join(insert_at_depths(noise_sentences(tokenizer, room), statements))
    gold = " " + ", ".join(chains[0]) + "."
    turn = Turn(question, prefix, chains[0], gold, max_new_tokens=4 * (num_hops + 1) + 4)
    return Sample("variable_tracking", seed, context, (turn,), {"distractor_chains": chains[1:]})


def score(expected: list[str], answer: str) -> float:
    if not isinstance(answer, str):
        return 0.0
    found, wanted = set(_NAME.findall(answer)), set(expected)
    return len(found & wanted) / len(found | wanted) if wanted else 0.0
