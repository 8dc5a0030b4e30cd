"""Prefill a long document once, then answer questions about it from a saved prefix (SmolLM2-135M-Instruct).

The first run prefills the document into a `ShadowKVCache`, saves the compressed prefix to a safetensors file and
answers the questions; later runs load that file instead of prefilling. All questions are answered in one batch
that shares the document (one copy of its values in host memory). For comparison the same questions are answered
with Transformers' `DynamicCache` the same way (the document prefilled once, then one batch of questions), and the
script prints both end-to-end times (prefill or load, plus answering), and, labelled as such, the time a load
takes against a prefill of the same document.

Without `--document` it uses the demo's ~6K-token staff handbook (three facts planted at different depths) and
its three questions, and marks each answer correct or wrong.

    python examples/document_qa.py                          # first run: prefill + save, then answer
    python examples/document_qa.py                          # later runs: load + answer
    python examples/document_qa.py --fresh                  # prefill and save again
    python examples/document_qa.py --document DOCUMENT --question "Who signed the lease?" --question "When?"
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from long_document_demo import cache_kwarg  # the example beside this one (a script's folder is on sys.path)
from transformers import DynamicCache

from shadowkv_cache import PrefixCacheError, ShadowKVCache
from shadowkv_cache.embedded_models import cache_dir, load_smollm2
from shadowkv_cache.prefix import batch_questions
from shadowkv_cache.testing import FACTS, build_document

# min_compress_len is below the document so that it really is compressed. The question comes after the compressed
# document as one multi-token step, which reads every chunk (`dense_multi_token_steps`, the default); answer
# tokens are then decoded sparsely at the default budget. sparse_budget may also be changed when loading:
# load_prefix(..., sparse_budget=...).
SETTINGS = dict(min_compress_len=1024)
_SPLIT = "\x00QUESTION\x00"


def chat_parts(
    tokenizer, document: str, questions: list[str], noun: str = "handbook"
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chat prompt cut into the part every question shares (template opening + document) and each
    question's own part, as token ids: `[S]` and a list of `[Q]`."""
    content = f"{document}\n\nQuestion:{_SPLIT}\nAnswer with the exact words from the {noun}."
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    head, tail = rendered.split(_SPLIT)
    document_ids = tokenizer(head, add_special_tokens=False, return_tensors="pt").input_ids[0]
    question_ids = [
        tokenizer(f" {q}{tail}", add_special_tokens=False, return_tensors="pt").input_ids[0] for q in questions
    ]
    return document_ids, question_ids


def answer(model, tokenizer, document_ids, cache, question_ids: list[torch.Tensor], max_new_tokens: int):
    """All questions in one batch over the document held by `cache` (one row, shared by every question):
    `[document][left-padded question]` rows. Returns the answers and the seconds it took."""
    ids, mask = batch_questions(document_ids, question_ids, pad_token_id=tokenizer.pad_token_id)  # pads are masked
    device = model.device
    start = time.perf_counter()
    if isinstance(cache, ShadowKVCache):
        cache = cache.fork(len(question_ids))  # rows share one copy of the document
    else:
        cache.batch_repeat_interleave(len(question_ids))  # DynamicCache: a copy of the document's K/V per row
    with torch.no_grad():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            **{cache_kwarg(model): cache},
        )
    _sync(device)
    answers = [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True).strip() for row in out]
    return answers, time.perf_counter() - start


def prefill_dynamic(model, document_ids: torch.Tensor) -> tuple[DynamicCache, float]:
    """The document in a one-row `DynamicCache` (one forward, no logits kept but the last) and the seconds it took."""
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    with torch.no_grad():
        model(
            input_ids=document_ids[None].to(model.device),
            use_cache=True,
            logits_to_keep=1,
            **{cache_kwarg(model): cache},
        )
    _sync(model.device)
    return cache, time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--document", type=Path, help="a text file (default: the demo's generated handbook)")
    parser.add_argument("--question", action="append", help="a question about --document (repeat for several)")
    parser.add_argument("--prefix", type=Path, help="the prefix file (default: beside the document, or in the cache)")
    parser.add_argument("--tokens", type=int, default=6000, help="length of the demo handbook in SmolLM2 tokens")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--fresh", action="store_true", help="prefill and save even if the prefix file exists")
    parser.add_argument("--no-baseline", action="store_true", help="skip the DynamicCache comparison")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    if args.question and not args.document:
        parser.error("--question needs --document (without it the demo handbook's own questions are asked)")
    if args.document and not args.question:
        parser.error("pass at least one --question about --document")

    model, tokenizer = load_smollm2(dtype=dtype, device=args.device)
    if args.document:
        document = args.document.read_text()
        questions, expected = args.question, [None] * len(args.question)
        prefix_file = args.prefix or args.document.with_name(args.document.name + ".qa.shadowkv.safetensors")
    else:
        document = build_document(tokenizer, args.tokens)
        questions, expected = [q for _, _, q, _ in FACTS], [a for _, _, _, a in FACTS]
        prefix_file = args.prefix or cache_dir() / "examples" / f"handbook_{args.tokens}.shadowkv.safetensors"
    document_ids, question_ids = chat_parts(tokenizer, document, questions, "document" if args.document else "handbook")
    timing_file = prefix_file.with_suffix(".timing.json")  # the prefill time of the run that saved the file
    print(f"Document: {len(document_ids)} tokens; {len(questions)} questions; {args.device}, {dtype}.\n")

    doc = None
    if prefix_file.exists() and not args.fresh:
        start = time.perf_counter()
        try:
            doc = ShadowKVCache.load_prefix(model, prefix_file)
            if not torch.equal(doc.prefix_ids, document_ids):
                raise PrefixCacheError("it holds another document")
        except PrefixCacheError as err:
            print(f"Not using {prefix_file}: {err}; prefilling instead.")
            doc = None
        _sync(model.device)
        load_s = time.perf_counter() - start
    if doc is not None:
        size = prefix_file.stat().st_size / 2**20
        print(f"ShadowKVCache: loaded the document ({size:.1f} MiB) from {prefix_file} in {load_s:.2f} s.")
        ready_s, ready = load_s, "load"
        prefill_s = json.loads(timing_file.read_text())["prefill_s"] if timing_file.exists() else None
    else:
        start = time.perf_counter()
        doc = ShadowKVCache.prefill(model, document_ids, progress=True, **SETTINGS)
        _sync(model.device)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        prefix_file.parent.mkdir(parents=True, exist_ok=True)
        doc.save_prefix(prefix_file)
        save_s = time.perf_counter() - start
        timing_file.write_text(json.dumps({"prefill_s": prefill_s, "tokens": len(document_ids)}))
        size = prefix_file.stat().st_size / 2**20
        print(f"ShadowKVCache: prefilled the document in {prefill_s:.1f} s; saved {size:.1f} MiB to {prefix_file}")
        print(f"in {save_s:.2f} s (not counted below). Run the script again to load it instead of prefilling.")
        ready_s, ready = prefill_s, "prefill"
        load_s = None

    answers, answer_s = answer(model, tokenizer, document_ids, doc, question_ids, args.max_new_tokens)
    print_answers(questions, answers, expected)
    report = doc.fork(len(questions)).memory_report()
    print(
        f"{len(questions)} questions in one batch in {answer_s:.1f} s, sharing one copy of the document: "
        f"{report.host_bytes / 2**20:.1f} MiB of values in host memory, {report.gpu_bytes / 2**20:.1f} MiB on "
        f"the {args.device} device (a DynamicCache would hold {report.dynamic_cache_bytes / 2**20:.1f} MiB).\n"
    )

    if not args.no_baseline:
        cache, dynamic_prefill_s = prefill_dynamic(model, document_ids)
        dynamic_answers, dynamic_answer_s = answer(
            model, tokenizer, document_ids, cache, question_ids, args.max_new_tokens
        )
        print(
            f"DynamicCache: prefilled the document in {dynamic_prefill_s:.1f} s, answered in {dynamic_answer_s:.1f} s."
        )
        print_answers(questions, dynamic_answers, expected)

    dynamic = (dynamic_prefill_s, dynamic_answer_s) if not args.no_baseline else None
    print("\n".join(summary(len(questions), ready, ready_s, answer_s, dynamic, load_s, prefill_s)))


def summary(
    questions: int,
    ready: str,
    ready_s: float,
    answer_s: float,
    dynamic: tuple[float, float] | None,
    load_s: float | None,
    prefill_s: float | None,
) -> list[str]:
    """The closing lines: both end-to-end times, their ratio, and (labelled apart) a load against a prefill."""
    shadow_s = ready_s + answer_s
    lines = [
        f"Summary (end to end: prefill or load, then answering the {questions} questions)",
        f"  ShadowKVCache: {ready} {ready_s:.1f} s + answers {answer_s:.1f} s = {shadow_s:.1f} s",
    ]
    if dynamic is not None:
        dynamic_s = sum(dynamic)
        lines += [
            f"  DynamicCache:  prefill {dynamic[0]:.1f} s + answers {dynamic[1]:.1f} s = {dynamic_s:.1f} s",
            f"  end to end, ShadowKVCache is {relative(shadow_s, dynamic_s)} than DynamicCache",
        ]
    if load_s is not None and prefill_s is not None:
        lines.append(
            f"  load vs prefill of ShadowKV's document alone: {load_s:.2f} s vs {prefill_s:.1f} s (the prefill timed "
            "by the run that saved the file): the time a load saves, not a speed-up of answering"
        )
    return lines


def relative(ours: float, theirs: float) -> str:
    return f"{theirs / ours:.1f}x faster" if ours <= theirs else f"{ours / theirs:.1f}x slower"


def print_answers(questions: list[str], answers: list[str], expected: list[str | None]) -> None:
    for question, got, want in zip(questions, answers, expected):
        mark = "" if want is None else "  [correct]" if want.lower() in got.lower() else f"  [WRONG: expected {want}]"
        print(f"Q: {question}\nA: {got}{mark}")


if __name__ == "__main__":
    main()
