"""Needle QA on the demo's ~6K-token handbook (SmolLM2-135M-Instruct): which ShadowKV settings keep the
answers full attention gives. First the package defaults (`ShadowKVCache(model)`, what `make demo` runs, with its
device memory against DynamicCache), then a sweep of rank x sparse budget; one line per setting.

    .venv/bin/python -m benchmarks.demo_needles --device cuda --dtype bfloat16
    .venv/bin/python -m benchmarks.demo_needles --device cuda --dtype bfloat16 --ranks  # the defaults only
"""

from __future__ import annotations

import argparse
import warnings

import torch
from transformers import DynamicCache

from benchmarks.accuracy_core import cache_kwarg
from benchmarks.results_io import add_results_dir_option, environment, write_results
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.embedded_models import load_smollm2
from shadowkv_cache.testing import FACTS, build_document, prompt_ids

warnings.filterwarnings("ignore", category=FutureWarning)


def answers(model, tokenizer, prompts, make_cache, max_new_tokens=16, caches=None) -> list[str]:
    """The greedy answer to each prompt, each with a fresh cache from `make_cache` (appended to `caches` if given)."""
    out = []
    for ids in prompts:
        cache = make_cache()
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **{cache_kwarg(model): cache})
        out.append(tokenizer.decode(seq[0, ids.shape[1] :], skip_special_tokens=True).strip())
        if caches is not None:
            caches.append(cache)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--ranks", type=int, nargs="*", default=[32, 64, 96, 192], help="none: the defaults only")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 10**6])
    add_results_dir_option(parser)
    args = parser.parse_args()

    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    document = build_document(tokenizer, args.tokens)
    prompts = [prompt_ids(tokenizer, document, q).to(args.device) for _, _, q, _ in FACTS]
    expected = [a for *_, a in FACTS]

    def score(got):
        return sum(e.lower() in g.lower() for e, g in zip(expected, got))

    full = answers(model, tokenizer, prompts, lambda: DynamicCache(config=model.config))
    rows = [{"method": "full attention", "rank": 192, "budget": "all", "correct": score(full), "answers": full}]
    print(rows[-1], flush=True)
    caches = []
    got = answers(model, tokenizer, prompts, lambda: ShadowKVCache(model), caches=caches)
    report = caches[-1].memory_report()  # the last question's cache, after its answer
    rows.append(
        {"method": "shadowkv, defaults", "rank": "auto", "budget": "default", "correct": score(got), "answers": got,
         "device_ratio": round(report.ratio, 4), "device_mib": round(report.gpu_bytes / 2**20, 1),
         "host_mib": round(report.host_bytes / 2**20, 1)}
    )  # fmt: skip
    print(rows[-1], flush=True)
    for rank in args.ranks:
        for budget in args.budgets:
            got = answers(
                model, tokenizer, prompts, lambda r=rank, b=budget: ShadowKVCache(model, rank=r, sparse_budget=b)
            )
            rows.append({"method": "shadowkv", "rank": rank, "budget": budget, "correct": score(got), "answers": got})
            print(rows[-1], flush=True)
    write_results(
        "demo_needles_" + args.device.split(":")[0],
        title=f"Needle QA on the ~{args.tokens}-token demo handbook, SmolLM2-135M-Instruct ({args.dtype})",
        env=environment(args.device, args.dtype),
        rows=rows,
        columns=["method", "rank", "budget", "correct", "device_ratio", "device_mib", "host_mib", "answers"],
        plot={"x": "budget", "y": "correct", "series": "rank", "ylabel": f"questions answered (of {len(FACTS)})"},
    )


if __name__ == "__main__":
    main()
