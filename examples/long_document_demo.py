"""Ask questions about a long document with the embedded SmolLM2-135M-Instruct: DynamicCache vs ShadowKVCache.

A ~6K-token staff handbook is generated (seeded, so every run sees the same text) with three facts planted
at different depths. Each question is answered greedily with Transformers' `DynamicCache` and with `ShadowKVCache`
at its defaults; the script prints the answers, prefill time, decode speed and cache memory.

    python examples/long_document_demo.py [--tokens 6000] [--max-new-tokens 24] [--device cpu] [--dtype float32]
        [--min-compress-len 4096]

Prompts shorter than `min_compress_len` (4096 tokens by default) stay exact: with `--tokens 2000` ShadowKVCache
then holds what DynamicCache holds, and the script says so; pass `--min-compress-len 1024` to compress it.
"""

import argparse
import inspect
import random
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.utils.logging import is_progress_bar_enabled

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.embedded_models import load_smollm2

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
    # Wording tuned on full attention (DynamicCache): this 135M model answers all three at 6K tokens with it,
    # and misses some with looser wordings ("What is the vault code?", "in one short sentence").
    content = f"{document}\n\nQuestion: {question}\nAnswer with the exact words from the handbook."
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def prefill(model, ids: torch.Tensor, cache) -> float:
    """Run the prompt (minus its last token) through the model into `cache`, with a per-layer progress bar.

    One forward pass covers the whole prompt, so the bar counts decoder layers (forward hooks), which is
    where the time goes. `generate` then sees a cache holding all but the last token and runs only that one.
    """
    layers = model.model.layers
    bar = tqdm(
        total=len(layers),
        desc=f"prefill {ids.shape[1]} tokens",
        unit="layer",
        leave=False,
        disable=not is_progress_bar_enabled(),  # transformers.utils.logging.disable_progress_bar() silences it
    )

    def step(*_):  # returns None: a forward hook that returns a value replaces the layer's output
        bar.update(1)

    hooks = [layer.register_forward_hook(step) for layer in layers]
    try:
        start = time.perf_counter()
        with torch.no_grad():  # logits_to_keep=1: no [T, vocab] logits for a prompt whose output is unused
            model(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
        _sync(ids.device)
        return time.perf_counter() - start
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()


def cache_kwarg(model) -> str:
    # Transformers 5.24 renamed `past_key_values` to `cache` (the old name still works, with a warning);
    # 5.17 knows only the old name.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ask(model, tokenizer, ids: torch.Tensor, cache, max_new_tokens: int) -> dict:
    prefill_s = prefill(model, ids, cache)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **{cache_kwarg(model): cache})
    _sync(ids.device)
    decode_s = time.perf_counter() - start
    new = out[0, ids.shape[1] :]
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    return {"answer": answer, "prefill_s": prefill_s, "tok_per_s": len(new) / decode_s}


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def describe_memory(report, device: str, prompt_tokens: int, min_compress_len: int) -> str:
    """One line about a ShadowKV cache's memory (`MemoryReport`), saying so when the prompt stayed exact."""
    mib = 2**20
    if not any(layer.compressed for layer in report.layers):
        return (
            f"Cache memory: {report.gpu_bytes / mib:.1f} MiB on the {device} device, as DynamicCache: the "
            f"{prompt_tokens}-token prompt stayed exact (shorter than min_compress_len={min_compress_len}; pass "
            "--min-compress-len to compress it); temporal-cache hit rate n/a"
        )
    hit = "n/a" if report.hit_rate is None else f"{report.hit_rate:.0%}"
    return (
        f"Cache memory: {report.gpu_bytes / mib:.1f} MiB on the {device} device "
        f"({report.ratio:.1%} of DynamicCache's {report.dynamic_cache_bytes / mib:.1f} MiB) + "
        f"{report.host_bytes / mib:.1f} MiB of values in host memory; temporal-cache hit rate {hit}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6000, help="document length in SmolLM2 tokens")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="default: float32 on CPU (bf16 is much slower there), bfloat16 on CUDA",
    )
    parser.add_argument(
        "--min-compress-len",
        type=int,
        help="prompts shorter than this stay exact (default 4096); lower it to compress a short --tokens document",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    options = {} if args.min_compress_len is None else {"min_compress_len": args.min_compress_len}

    model, tokenizer = load_smollm2(dtype=dtype, device=args.device)
    limit = model.config.max_position_embeddings - args.max_new_tokens - 100
    if args.tokens > limit:
        parser.error(f"--tokens {args.tokens} does not fit SmolLM2's context; use at most {limit}")
    document = build_document(tokenizer, args.tokens)
    print(
        f"Document: {len(tokenizer(document).input_ids)} tokens, {len(FACTS)} facts planted; "
        f"device {args.device}, {dtype}.\n"
    )

    # The defaults: each layer's rank chosen from the prompt (rank="auto"), a 1024-token budget per KV head.
    caches = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        "ShadowKVCache (defaults)": lambda: ShadowKVCache(model, **options),
    }  # fresh per question: each question is a new request over the document
    for label, make_cache in caches.items():
        print(f"== {label} ==")
        for _, _, question, expected in FACTS:
            ids = prompt_ids(tokenizer, document, question).to(args.device)
            cache = make_cache()
            run = ask(model, tokenizer, ids, cache, args.max_new_tokens)
            mark = "correct" if expected.lower() in run["answer"].lower() else f"WRONG (expected {expected})"
            print(f"Q: {question}\nA: {run['answer']}  [{mark}]")
            print(f"   prefill {run['prefill_s']:.1f} s, decode {run['tok_per_s']:.1f} tokens/s")
        # Memory of the last question's cache (prompt + answer), after decoding.
        if isinstance(cache, DynamicCache):
            print(f"Cache memory: {dynamic_cache_bytes(cache) / 2**20:.1f} MiB (keys + values, all layers)")
        else:
            print(describe_memory(cache.memory_report(), args.device, ids.shape[1], cache.config.min_compress_len))
        print()


if __name__ == "__main__":
    main()
