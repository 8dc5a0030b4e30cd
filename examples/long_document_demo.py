"""Ask questions about a long document with the embedded SmolLM2-135M-Instruct: DynamicCache vs ShadowKVCache.

A ~6K-token staff handbook is generated (`shadowkv_cache.testing.build_document`; seeded, so every run sees the
same text) with three facts planted at different depths. Each question is answered greedily with Transformers'
`DynamicCache` and with `ShadowKVCache` at its defaults; the script prints the answers, prefill time, decode speed
and cache memory.

    python examples/long_document_demo.py [--tokens 6000] [--max-new-tokens 24] [--device cpu] [--dtype float32]
        [--min-compress-len 4096]

Prompts shorter than `min_compress_len` (4096 tokens by default) stay exact: with `--tokens 2000` ShadowKVCache
then holds what DynamicCache holds, and the script says so; pass `--min-compress-len 1024` to compress it.
"""

import argparse
import inspect
import time

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.utils.logging import is_progress_bar_enabled

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.embedded_models import load_smollm2
from shadowkv_cache.testing import FACTS, build_document, prompt_ids


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
    on_cpu = torch.device(args.device).type == "cpu"
    dtype = getattr(torch, args.dtype or ("float32" if on_cpu else "bfloat16"))
    options = {} if args.min_compress_len is None else {"min_compress_len": args.min_compress_len}

    model, tokenizer = load_smollm2(dtype=dtype, device=args.device)
    limit = model.config.max_position_embeddings - args.max_new_tokens - 100
    if args.tokens > limit:
        parser.error(f"--tokens {args.tokens} does not fit SmolLM2's context; use at most {limit}")
    document = build_document(tokenizer, args.tokens)
    print(
        f"Document text: {len(tokenizer(document).input_ids)} tokens, {len(FACTS)} facts planted (each prompt adds "
        f"the chat template and a question); device {args.device}, {dtype}."
    )
    if on_cpu:
        # What a first run on a laptop shows otherwise puzzles: ShadowKV slower, and "device" plus "host" memory above
        # DynamicCache's, because on CPU both are the same RAM.
        print(
            "On CPU the device and host memory are the same RAM and the kernels run as their PyTorch twins, so "
            "ShadowKV is not faster here: what it saves is GPU memory and GPU time (run with --device cuda on a GPU)."
        )
    print()

    # The defaults: each layer's rank chosen from the prompt (rank="auto"), a budget of max(2048, 1.6% of the prompt)
    # tokens per KV head, at most a quarter of the prompt (1500 at the default 6000 tokens).
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
