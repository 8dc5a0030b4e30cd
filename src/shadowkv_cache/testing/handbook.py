"""A generated staff handbook with planted facts: a long document whose answers are known, for demos and needle
benchmarks (`examples/long_document_demo.py`, `benchmarks/demo_needles.py`).

The text is built from seeded templates (nothing is downloaded), so every run sees the same document for a given
tokenizer and length. `FACTS` lists what is planted where and the question that asks for it.
"""

from __future__ import annotations

import random

import torch

__all__ = ["FACTS", "build_document", "prompt_ids"]

# (depth in the document, planted sentence, question, expected answer). Depths spread over the prompt so
# that a cache which only keeps the start or the end of the document would miss at least one.
FACTS = [
    (0.2, "The vault code is 4827.", "What number is the vault code?", "4827"),
    (
        0.5,
        "The head librarian is named Margarethe Olsen.",
        "What is the name of the head librarian?",
        "Margarethe Olsen",
    ),
    (0.8, "The annual meeting is held in Tromsø.", "In which town is the annual meeting held?", "Tromsø"),
]

# Filler: handbook sentences with slots. No names, places or 4-digit numbers, so nothing competes with the
# planted facts; the mix of topics and slot values keeps the text from repeating verbatim.
TOPICS = {
    "Opening hours": [
        "The reading rooms open at {hour} on {day}s and close an hour earlier in {season}.",
        "Staff arrive {minutes} minutes before opening to switch on the lights and empty the returns box.",
        "On public holidays the building stays closed, but the returns box remains available.",
        "During {season} the evening shift is shortened, since fewer visitors come after dark.",
        "If snow blocks the front steps, the side entrance by the {room} is used instead.",
        "The last visitors are reminded quietly fifteen minutes before closing time.",
        "Keys to the side entrance are signed out in the small notebook kept in the office drawer.",
    ],
    "Caring for the collection": [
        "Books with loose spines go to the repair table in the {room}, never back onto the shelves.",
        "The humidity in the {room} is checked every {day} and written in the blue logbook.",
        "Old maps are stored flat in wide drawers and handled only with clean cotton gloves.",
        "Volunteers dust the top shelves once a month, starting from the far end of the {room}.",
        "Damaged {item}s are wrapped in paper and labelled with the date they were found.",
        "Sunlight fades covers quickly, so the blinds in the {room} stay half closed in {season}.",
        "Returned books are left on the trolley for a day before they are shelved again.",
    ],
    "Helping visitors": [
        "Visitors who ask for a book we do not hold can request a loan from another library at the desk.",
        "Children under {age} must be accompanied by an adult in the {room}.",
        "Quiet conversation is welcome in the {room}, but phone calls belong in the entrance hall.",
        "When the printer jams, staff should apologise, reset the tray and offer {n} free copies.",
        "New members receive a card, a short tour and a leaflet about the {item} collection.",
        "Anyone who seems lost among the shelves is offered help, but never hurried.",
        "Lost property is kept in a labelled box under the front desk for {n} weeks.",
    ],
    "Events and programmes": [
        "The reading circle meets every second {day} in the {room} to discuss a novel chosen by vote.",
        "In {season} the children's story hour moves to the garden when the weather allows.",
        "Craft afternoons need at least {n} volunteers, and supplies are kept in the {room} cupboard.",
        "Posters for upcoming talks are pinned to the board by the stairs no later than {day} morning.",
        "Chairs for evening talks are set out in rows of {n}, with a wide aisle for wheelchairs.",
        "After each event the tea urn is emptied and the cups are washed before anyone leaves.",
        "A small exhibition of {item}s from the stacks changes at the start of every {season}.",
    ],
    "Building and safety": [
        "Fire doors must never be propped open, even on warm days in {season}.",
        "The emergency lights are tested on the first {day} of every month.",
        "Anyone who notices a leak in the {room} should move the nearest shelves and call the caretaker.",
        "Bicycles are parked in the yard, not in the corridor beside the {room}.",
        "The first-aid kit hangs behind the front desk and is restocked after every use.",
        "The radiators in the {room} are bled each {season} so that they heat evenly.",
        "Ladders are folded and chained to the wall at the end of each day.",
    ],
    "Working together": [
        "The weekly staff meeting is short: news first, then a look at the week ahead.",
        "Shift swaps are written on the rota by the kettle at least {n} days in advance.",
        "New volunteers shadow an experienced colleague for their first {n} shifts.",
        "Questions that nobody can answer are written in the office book and followed up on {day}.",
        "Breaks are taken in the staff room, and food never goes into the {room}.",
        "Thank-you cards from visitors are pinned up in the staff room for everyone to read.",
        "Everyone is asked to leave the desk tidy for the next shift, with pens back in their cup.",
    ],
}
SLOTS = {
    "hour": ["eight", "nine", "half past nine", "ten"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"],
    "season": ["winter", "spring", "summer", "autumn"],
    "minutes": ["ten", "fifteen", "twenty"],
    "room": [
        "east reading room",
        "archive",
        "children's corner",
        "map room",
        "study hall",
        "periodicals room",
    ],
    "item": ["atlas", "newspaper", "music score", "photograph album", "cookbook", "poetry"],
    "age": ["ten", "eleven", "twelve"],
    "n": ["two", "three", "four", "five"],
}


def build_document(tokenizer, n_tokens: int, seed: int = 0) -> str:
    """Sections of filler paragraphs until about `n_tokens` tokens, with the FACTS planted at their depths."""
    rng = random.Random(seed)
    paragraphs, total, order = [], 0, []
    while total < n_tokens:
        if not order:  # visit every topic once per round, in a shuffled order, before repeating any
            order = rng.sample(list(TOPICS), k=len(TOPICS))
        topic = order.pop()
        pool = rng.sample(TOPICS[topic], k=len(TOPICS[topic]))  # two paragraphs, no sentence twice
        section = [f"Section {sum(p.startswith('Section ') for p in paragraphs) + 1}: {topic}"]
        section += [
            " ".join(s.format(**{k: rng.choice(v) for k, v in SLOTS.items()}) for s in part)
            for part in (pool[:3], pool[3:6])
        ]
        paragraphs += section
        total += sum(len(tokenizer(p, add_special_tokens=False).input_ids) + 2 for p in section)
    # Plant each fact at the end of the paragraph found at its depth, so it reads as part of the text.
    for depth, sentence, _, _ in FACTS:
        i = max(1, int(depth * len(paragraphs)))
        i += paragraphs[i].startswith("Section ")  # not in a heading
        paragraphs[i] = f"{paragraphs[i]} {sentence}"
    return "Staff Handbook of the Harbour Street Library\n\n" + "\n\n".join(paragraphs)


def prompt_ids(tokenizer, document: str, question: str) -> torch.Tensor:
    """`[1, S]` token ids of a chat prompt: the document, then the question (the tokenizer's chat template)."""
    # Wording tuned on full attention (DynamicCache): this 135M model answers all three at 6K tokens with it,
    # and misses some with looser wordings ("What is the vault code?", "in one short sentence").
    content = f"{document}\n\nQuestion: {question}\nAnswer with the exact words from the handbook."
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
