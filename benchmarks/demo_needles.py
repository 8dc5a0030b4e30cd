"""Needle QA on the demo's ~6K-token handbook (SmolLM2-135M-Instruct): which ShadowKV settings keep the
answers full attention gives. Sweeps rank x sparse budget; one line per setting.

    .venv/bin/python -m benchmarks.demo_needles --device cuda --dtype bfloat16
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


def answers(model, tokenizer, prompts, make_cache, max_new_tokens=16) -> list[str]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, **{cache_kwarg(model): make_cache()}
            )
        out.append(tokenizer.decode(seq[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[32, 64, 96, 192])
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
        columns=["method", "rank", "budget", "correct", "answers"],
        plot={"x": "budget", "y": "correct", "series": "rank", "ylabel": f"questions answered (of {len(FACTS)})"},
    )


if __name__ == "__main__":
    main()
