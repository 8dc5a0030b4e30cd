"""Text2JSON-like extraction (after the Text2JSON benchmark of the context-intensive study, seed 004 §3.1).

Records of three types (products, people, films), each with a unique name and two fields, are written as
sentences scattered through filler text; the question asks for every record of one type as a JSON list.
Records of the other types are distractors.

Score (the study's name-anchored soft IoU): predicted and expected records are aligned by exact name (case and
spacing normalised). A matched record scores the share of its two fields that are right; unmatched expected
records are misses, unmatched (or repeated) predicted records are spurious. The sum of matched scores is
divided by matched + missing + spurious. An answer with no parseable record scores 0; a list cut off by the
token limit still counts the records that were completed.
"""

from __future__ import annotations

import json
import random
import re

from .common import Sample, Turn, count_tokens, insert_at_depths, noise_sentences
from .words import ADJECTIVES, CITIES, COLORS, FILM_WORDS, FIRST_NAMES, LAST_NAMES, PRODUCT_KINDS

__all__ = ["RECORD_TYPES", "generate", "parse_records", "score"]

RECORD_TYPES = {
    "product": ("price", "color"),
    "person": ("age", "city"),
    "film": ("year", "director"),
}


def _record(kind: str, rng: random.Random) -> dict:
    if kind == "product":
        name = f"{rng.choice(ADJECTIVES).capitalize()} {rng.choice(PRODUCT_KINDS).capitalize()}"
        return {"name": name, "price": str(rng.randint(10, 990)), "color": rng.choice(COLORS)}
    if kind == "person":
        return {
            "name": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
            "age": str(rng.randint(21, 89)),
            "city": rng.choice(CITIES),
        }
    return {
        "name": f"The {rng.choice(ADJECTIVES).capitalize()} {rng.choice(FILM_WORDS)}",
        "year": str(rng.randint(1950, 2024)),
        "director": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}",
    }


def _sentence(kind: str, r: dict) -> str:
    if kind == "product":
        return f"{r['name']} is a {r['color']} product that sells for {r['price']} dollars."
    if kind == "person":
        return f"{r['name']} is {r['age']} years old and lives in {r['city']}."
    return f"The film {r['name']} was directed by {r['director']} and released in {r['year']}."


def generate(seed: int, n_tokens: int, tokenizer, num_records: int = 3, num_distractors: int = 3) -> Sample:
    rng = random.Random(f"text2json/{seed}")
    kinds = list(RECORD_TYPES)
    target = kinds[seed % len(kinds)]
    records: dict[str, list[dict]] = {k: [] for k in kinds}
    names: set[str] = set()
    plan = [target] * num_records + [rng.choice([k for k in kinds if k != target]) for _ in range(num_distractors)]
    for kind in plan:
        record = _record(kind, rng)
        while record["name"] in names:
            record = _record(kind, rng)
        names.add(record["name"])
        records[kind].append(record)
    sentences = [_sentence(k, r) for k in kinds for r in records[k]]
    rng.shuffle(sentences)
    fields = RECORD_TYPES[target]
    header = "The following text mentions several products, people and films."
    question = (
        f'List every {target} mentioned in the text as a JSON list. Each {target} is an object with the keys "name", '
        f'"{fields[0]}" and "{fields[1]}".'
    )
    prefix = '[{"name": "'
    room = n_tokens - count_tokens(tokenizer, header + question + prefix + " ".join(sentences)) - 60
    depths = [(i + rng.uniform(0.1, 0.9)) / len(sentences) for i in range(len(sentences))]
    context = (
        header + "\n\n" + " ".join(insert_at_depths(noise_sentences(tokenizer, room), list(zip(depths, sentences))))
    )
    expected = records[target]
    gold = json.dumps(expected)[len(prefix) :]
    per_record = max(count_tokens(tokenizer, json.dumps(r)) for r in expected) + 2
    turn = Turn(question, prefix, expected, gold, max_new_tokens=per_record * num_records + 8)
    return Sample("text2json", seed, context, (turn,), {"type": target, "distractors": num_distractors})


def parse_records(answer: str) -> list[dict]:
    """The JSON objects of an answer: the whole list if it parses, else every complete `{...}` object in it."""
    if not isinstance(answer, str):
        return []
    start = answer.find("[")
    if start >= 0:
        try:
            data = json.loads(answer[start : answer.rfind("]") + 1])
            if isinstance(data, list):
                return [d for d in data if isinstance(d, dict)]
        except ValueError:
            pass
    decoder, out, i = json.JSONDecoder(), [], answer.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(answer, i)
        except ValueError:
            i = answer.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            out.append(obj)
        i = answer.find("{", end)
    return out


def _norm(value) -> str:
    text = re.sub(r"\s+", " ", str(value)).strip().lower().strip(".,;:'\"$")
    return text[:-2] if text.endswith(".0") else text


def score(expected: list[dict], answer: str) -> float:
    gold = {_norm(r["name"]): r for r in expected}
    matched, spurious, seen = 0.0, 0, set()
    for rec in parse_records(answer):
        name = _norm(rec.get("name", ""))
        if name in gold and name not in seen:
            seen.add(name)
            fields = [f for f in gold[name] if f != "name"]
            matched += sum(_norm(rec.get(f, "")) == _norm(gold[name][f]) for f in fields) / len(fields)
        else:
            spurious += 1
    total = len(seen) + (len(gold) - len(seen)) + spurious
    return matched / total if total else 0.0
