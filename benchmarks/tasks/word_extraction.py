"""Common-word and frequent-word extraction, RULER-style (aggregation tasks: the answer needs the whole context).

- common words (cwe): a numbered list of words in which a few words occur many times and the rest a few times
  each; "what are the N most common words?"
- frequent words (fwe): a "coded text" of random 5-letter words drawn from a Zipf distribution; "what are the
  three most frequently appearing coded words?"

Score: the share of expected words named in the answer (whole words, case-insensitive).
"""

from __future__ import annotations

import random
import string

from .common import Sample, Turn, count_tokens, recall_score
from .words import COMMON_WORDS

__all__ = ["generate_common", "generate_frequent", "score"]


def generate_common(
    seed: int, n_tokens: int, tokenizer, num_common: int = 5, common_share: float = 0.5, rare_freq: int = 2
) -> Sample:
    """`num_common` words fill `common_share` of the list; every other word appears `rare_freq` times."""
    rng = random.Random(f"common_words/{seed}")
    header = "Below is a numbered list of words. In these words, some appear more often than others."
    question = f"What are the {num_common} most common words in the above list?"
    prefix = f"Answer: The top {num_common} words that appear most often in the list are:"
    per_item = count_tokens(tokenizer, " 123. lantern") + 0.3
    items = int((n_tokens - count_tokens(tokenizer, header + question + prefix) - 60) / per_item)
    words = rng.sample(COMMON_WORDS, k=len(COMMON_WORDS))
    common, rare_pool = words[:num_common], words[num_common:]
    common_freq = max(rare_freq + 3, round(items * common_share / num_common))
    num_rare = min(len(rare_pool), max(1, (items - common_freq * num_common) // rare_freq))
    bag = common * common_freq + rare_pool[:num_rare] * rare_freq
    rng.shuffle(bag)
    context = header + "\n\n" + " ".join(f"{i + 1}. {w}" for i, w in enumerate(bag))
    gold = " " + ", ".join(common) + "."
    turn = Turn(question, prefix, common, gold, max_new_tokens=3 * num_common + 4)
    return Sample("common_words", seed, context, (turn,), {"common_freq": common_freq, "rare_freq": rare_freq})


def generate_frequent(seed: int, n_tokens: int, tokenizer, alpha: float = 2.0, vocab: int = 300) -> Sample:
    """Coded words sampled with probability proportional to `rank ** -alpha` (RULER uses alpha 2)."""
    rng = random.Random(f"frequent_words/{seed}")
    coded: list[str] = []
    while len(coded) < vocab:
        word = "".join(rng.choices(string.ascii_lowercase, k=5))
        coded.append(word) if word not in coded else None
    header = "Read the following coded text and track the frequency of each coded word."
    question = "What are the three most frequently appearing coded words in the above coded text?"
    prefix = "Answer: According to the coded text above, the three most frequently appearing words are:"
    per_word = count_tokens(tokenizer, " ".join(coded[:50])) / 50
    n_words = int((n_tokens - count_tokens(tokenizer, header + question + prefix) - 60) / per_word)
    weights = [(r + 1) ** -alpha for r in range(vocab)]
    text = rng.choices(coded, weights=weights, k=n_words)
    room = n_tokens - count_tokens(tokenizer, header + question + prefix) - 60
    text = text[: int(n_words * room / count_tokens(tokenizer, " ".join(text)))]  # trim to the measured length
    counts = {w: text.count(w) for w in coded[:5]}
    top = sorted(counts, key=lambda w: -counts[w])[:3]  # Zipf: the first ranks, by their real counts
    context = header + "\n\n" + " ".join(text)
    turn = Turn(question, prefix, top, " " + ", ".join(top) + ".", max_new_tokens=16)
    return Sample("frequent_words", seed, context, (turn,), {"counts": counts})


def score(expected: list[str], answer: str) -> float:
    return recall_score(expected, answer)
