"""Fidelity of ShadowKV against full attention on the embedded SmolLM2-135M-Instruct (natural long text).

Teacher-forced next-token agreement, mean KL(full || ShadowKV) and the matching greedy length, at the
default configuration (scaled to the model and prompt) and a few budgets. Rerun:

    .venv/bin/python -m benchmarks.fidelity            # CPU, ~15 min on 2 cores
    .venv/bin/python -m benchmarks.fidelity --device cuda --dtype bfloat16

Writes benchmarks/results/fidelity_smollm2.{json,md,png}. Full attention's side is computed once per prompt length
and shared by every setting, so a row's `seconds` time the cache's side alone.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from tqdm import tqdm

from benchmarks.results_io import add_results_dir_option, environment, write_results
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.embedded_models import load_smollm2
from shadowkv_cache.fidelity import dynamic_cache_reference, measure_fidelity, natural_text_ids

warnings.filterwarnings("ignore", category=FutureWarning)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--steps", type=int, default=64, help="teacher-forced continuation tokens")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024], help="extra sparse_budget values")
    parser.add_argument("--ranks", type=int, nargs="*", default=[], help="extra rank values (at the default budget)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="fidelity_smollm2")
    add_results_dir_option(parser)
    args = parser.parse_args()

    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    key_dim = model.config.num_key_value_heads * model.config.head_dim
    settings = [{}] + [{"sparse_budget": b} for b in args.budgets] + [{"rank": r} for r in args.ranks]
    rows = []
    references = {}  # full attention's side, once per prompt length (it does not depend on the setting)
    for length, extra in tqdm([(s, e) for s in args.lengths for e in settings], desc="fidelity"):
        ids = natural_text_ids(tokenizer, length + args.steps).to(args.device)
        overrides = {"min_compress_len": min(length, 4096), **extra}
        probe = ShadowKVCache(model, **overrides)
        sizes = probe.config.resolve(length, key_dim)
        if length not in references:
            references[length] = dynamic_cache_reference(model, ids, length)
        start = time.perf_counter()
        make = lambda o=overrides: ShadowKVCache(model, **o)  # noqa: E731
        fid = measure_fidelity(model, ids, length, make, reference=references[length])
        rows.append(
            {
                "prompt_tokens": length,
                "config": ", ".join(f"{k}={v}" for k, v in extra.items()) or "default",
                "rank": sizes.rank,
                "budget_tokens": sizes.budget_chunks * probe.config.chunk_size,
                "outlier_chunks": sizes.outliers,
                "local_tokens": sizes.local,
                "series": f"S={length}, rank={sizes.rank}",
                **fid.as_dict(),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        tqdm.write(str(rows[-1]))

    columns = [
        "prompt_tokens",
        "config",
        "rank",
        "budget_tokens",
        "outlier_chunks",
        "agreement",
        "mean_kl",
        "greedy_match",
        "steps",
    ]
    write_results(
        args.out,
        title="ShadowKV fidelity on SmolLM2-135M-Instruct (teacher-forced, natural text)",
        env=environment(args.device, args.dtype),
        rows=rows,
        columns=columns,
        plot={
            "x": "budget_tokens",
            "y": "agreement",
            "series": "series",
            "ylabel": "top-1 agreement with full attention",
        },
    )


if __name__ == "__main__":
    main()
