"""Prefill a long document once, then answer questions about it from a saved prefix (SmolLM2-135M-Instruct).

The first run builds the demo's ~6K-token staff handbook (three facts planted at different depths),
prefills it into a `ShadowKVCache`, saves the compressed prefix to a safetensors file and answers the
questions. A second run loads that file instead of prefilling and answers all questions in one batch that
shares the document (one copy of its values in host memory), printing the time saved.

    python examples/document_qa.py            # first run: prefill + save, then answer
    python examples/document_qa.py            # second run: load + answer, with the time saved
    python examples/document_qa.py --fresh    # prefill and save again
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_document_demo import FACTS, build_document, cache_kwarg  # noqa: E402

from shadowkv_cache import ShadowKVCache  # noqa: E402
from shadowkv_cache.embedded_models import cache_dir, load_smollm2  # noqa: E402
from shadowkv_cache.prefix import batch_questions  # noqa: E402

# min_compress_len is below the document so that it really is compressed. The question comes after the compressed
# document as one multi-token step, which reads every chunk (`dense_multi_token_steps`, the default); answer
# tokens are then decoded sparsely at the demo's budget. sparse_budget may also be changed when loading:
# load_prefix(..., sparse_budget=...).
SETTINGS = dict(rank=96, sparse_budget=1024, min_compress_len=1024)
_SPLIT = "\x00QUESTION\x00"


def chat_parts(tokenizer, document: str, questions: list[str]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chat prompt cut into the part every question shares (template opening + document) and each
    question's own part, as token ids: `[S]` and a list of `[Q]`."""
    content = f"{document}\n\nQuestion:{_SPLIT}\nAnswer with the exact words from the handbook."
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    head, tail = rendered.split(_SPLIT)
    document_ids = tokenizer(head, add_special_tokens=False, return_tensors="pt").input_ids[0]
    question_ids = [
        tokenizer(f" {q}{tail}", add_special_tokens=False, return_tensors="pt").input_ids[0] for q in questions
    ]
    return document_ids, question_ids


def answer(model, tokenizer, cache: ShadowKVCache, question_ids: list[torch.Tensor], max_new_tokens: int):
    """All questions in one batch over the shared document: `[document][left-padded question]` rows."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = batch_questions(cache.prefix_ids, question_ids, pad_token_id=pad)
    device = model.device
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **{cache_kwarg(model): cache.fork(len(question_ids))},  # rows share the document
        )
    _sync(device)
    answers = [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True).strip() for row in out]
    return answers, time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=Path, default=cache_dir() / "examples" / "handbook_prefix.safetensors")
    parser.add_argument("--tokens", type=int, default=6000, help="document length in SmolLM2 tokens")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--fresh", action="store_true", help="prefill and save even if the prefix file exists")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))

    model, tokenizer = load_smollm2(dtype=dtype, device=args.device)
    document = build_document(tokenizer, args.tokens)
    questions = [q for _, _, q, _ in FACTS]
    document_ids, question_ids = chat_parts(tokenizer, document, questions)
    timing_file = args.prefix.with_suffix(".timing.json")  # the first run's prefill time, for the comparison

    if args.fresh or not args.prefix.exists():
        print(f"Prefilling the {len(document_ids)}-token document ({args.device}, {dtype}) ...")
        start = time.perf_counter()
        doc = ShadowKVCache.prefill(model, document_ids, progress=True, **SETTINGS)
        _sync(model.device)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        doc.save_prefix(args.prefix)
        save_s = time.perf_counter() - start
        timing_file.write_text(json.dumps({"prefill_s": prefill_s, "tokens": len(document_ids)}))
        size = args.prefix.stat().st_size / 2**20
        print(f"Prefill {prefill_s:.1f} s; saved {size:.1f} MiB to {args.prefix} in {save_s:.2f} s.")
        print("Run the script again to load the prefix instead of prefilling.\n")
    else:
        start = time.perf_counter()
        doc = ShadowKVCache.load_prefix(model, args.prefix)
        _sync(model.device)
        load_s = time.perf_counter() - start
        size = args.prefix.stat().st_size / 2**20
        print(f"Loaded the {len(doc.prefix_ids)}-token prefix ({size:.1f} MiB) from {args.prefix} in {load_s:.2f} s.")
        if timing_file.exists():
            prefill_s = json.loads(timing_file.read_text())["prefill_s"]
            print(
                f"Prefilling it took {prefill_s:.1f} s: {prefill_s - load_s:.1f} s saved ({prefill_s / load_s:.0f}x)."
            )
        print()

    answers, answer_s = answer(model, tokenizer, doc, question_ids, args.max_new_tokens)
    for (_, _, question, expected), got in zip(FACTS, answers):
        mark = "correct" if expected.lower() in got.lower() else f"WRONG (expected {expected})"
        print(f"Q: {question}\nA: {got}  [{mark}]")
    report = doc.fork(len(questions)).memory_report()
    print(
        f"\n{len(questions)} questions in one batch in {answer_s:.1f} s, sharing one copy of the document: "
        f"{report.host_bytes / 2**20:.1f} MiB of values in host memory, {report.gpu_bytes / 2**20:.1f} MiB on "
        f"the {args.device} device (a DynamicCache would hold {report.dynamic_cache_bytes / 2**20:.1f} MiB)."
    )


if __name__ == "__main__":
    main()
