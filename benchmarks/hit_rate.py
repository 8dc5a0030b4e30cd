"""Hit rate `h` of a real model's decode steps, ShadowKV's chunks or YAKV's tokens, against prompt length.

`h` is the share of selected units that were already on the device from the previous step (design.md §3, decode
step 3; §4 for YAKV's held tokens): a ShadowKV miss costs a key rebuild and a host-to-device copy of the chunk's
values, a YAKV miss the copy of the token's quantised record, so `h` sets the bytes a decode step moves and is what
GPU throughput targets hang on (`benchmarks/throughput.py` sets it by hand: `--h-sweep`, `--yakv-h`).
Each length prefills natural text (the Python reference documentation shipped with CPython) once and decodes
greedily; reported are the cumulative hit rate of `cache.memory_report()` (the first step, with an empty
temporal cache, counts as all misses) and the steady-state rate from the second step on.

    OMP_NUM_THREADS=1 python -m benchmarks.hit_rate --model gemma3 --lengths 2048 4096 8192 --steps 128
    python -m benchmarks.hit_rate --mode yakv --model smollm2 --lengths 4096 8192 --budgets default 0.03125

`--budgets` takes `default` (the package's budget at that length) or a `sparse_budget` (tokens, or a share of the
prompt: 0.03125 is YAKV's default share at 128K, where its floor of 512 tokens no longer counts).

Writes benchmarks/results/hit_rate_<model>_<device>.{json,md,png} (ShadowKV), hit_rate_<model>_yakv_<device>.* .
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.accuracy_core import cache_kwarg
from benchmarks.accuracy_runner import MODELS, load_model
from benchmarks.results_io import add_results_dir_option, environment, write_results
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.fidelity import natural_text_ids


def counters(cache: ShadowKVCache) -> tuple[int, int]:
    """(hits, lookups) summed over the compressed layers."""
    counts = [layer.hit_counts() for layer in cache.layers if hasattr(layer, "hit_counts")]
    counts = [c for c in counts if c is not None]
    return sum(h for h, _ in counts), sum(n for _, n in counts)


def budget_option(budget: str) -> tuple[dict, str]:
    """A `--budgets` value (`default`, tokens, or a share of the prompt) as cache overrides and a series label."""
    if budget == "default":
        return {}, "default budget"
    return {"sparse_budget": float(budget) if "." in budget else int(budget)}, f"budget {budget}"


@torch.no_grad()
def measure(model, ids: torch.Tensor, steps: int, **overrides) -> dict:
    """Prefill `ids` (`[1, S]`) into a default `ShadowKVCache`, decode `steps` greedy tokens; the hit rates."""
    cache = ShadowKVCache(model, **overrides)
    kwarg = cache_kwarg(model)
    start = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1, **{kwarg: cache})
    prefill_s = time.perf_counter() - start
    token = out.logits[:, -1:].argmax(-1)
    after_first = None
    start = time.perf_counter()
    for step in range(steps):
        out = model(token, use_cache=True, **{kwarg: cache})
        token = out.logits[:, -1:].argmax(-1)
        if step == 0:
            after_first = counters(cache)
    decode_s = time.perf_counter() - start
    hits, lookups = counters(cache)
    text = model.config.get_text_config()
    sizes = cache.config.resolve(ids.shape[1], text.num_key_value_heads * text.head_dim)
    report = cache.memory_report()
    return {
        "prompt_tokens": ids.shape[1],
        "steps": steps,
        "rank": sizes.rank if cache.config.mode == "shadowkv" else None,
        "budget": sizes.budget_chunks * (cache.config.chunk_size if cache.config.mode == "shadowkv" else 1),
        "outlier_chunks": sizes.outliers,
        "compressed_layers": sum(layer.is_compressed for layer in cache.layers),
        "hit_rate": report.hit_rate,
        "steady_hit_rate": (hits - after_first[0]) / (lookups - after_first[1]),
        "device_ratio": report.ratio,
        "prefill_s": round(prefill_s, 1),
        "decode_ms_per_step": round(1000 * decode_s / steps, 1),
    }


def add_text_run_options(parser: argparse.ArgumentParser) -> None:
    """`--budgets`, `--device`, `--dtype` and `--results-dir`, shared by the scripts that decode natural text (this
    one and `prefetch_study.py`; each adds its own `--model`, `--lengths` and `--steps`)."""
    parser.add_argument("--budgets", nargs="+", default=["default"], help="'default', tokens, or a share in (0, 1)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    add_results_dir_option(parser)


def model_and_text(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, dict]:
    """The model of `args.model` in `args.dtype` on `args.device`, natural text ids `[1, max(args.lengths)]` there, and
    the run's environment record (with the model's name)."""
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    model, tokenizer = load_model(args.model, getattr(torch, dtype), args.device)
    text = natural_text_ids(tokenizer, max(args.lengths)).to(args.device)
    env = environment(args.device, dtype)
    env["model"] = args.model
    return model, text, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="gemma3")
    parser.add_argument("--mode", choices=["shadowkv", "yakv"], default="shadowkv")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=128, help="greedy decode steps per length")
    add_text_run_options(parser)
    args = parser.parse_args()
    model, text, env = model_and_text(args)
    rows = []
    env["mode"] = args.mode
    columns = ["series", "prompt_tokens", "steps", "rank", "budget", "outlier_chunks", "compressed_layers", "hit_rate"]
    columns += ["steady_hit_rate", "device_ratio", "prefill_s", "decode_ms_per_step"]
    name = "ShadowKV" if args.mode == "shadowkv" else "YAKV mode"
    unit = "chunks" if args.mode == "shadowkv" else "tokens"
    for length in args.lengths:
        for budget in args.budgets:
            changes, label = budget_option(budget)
            overrides = {"min_compress_len": min(1024, length // 2), "mode": args.mode, **changes}
            row = measure(model, text[:, :length], args.steps, **overrides)
            rows.append({"series": f"{args.model}, {label}", **row})
            print({k: row[k] for k in ("prompt_tokens", "hit_rate", "steady_hit_rate", "budget", "rank")}, flush=True)
        notes = (
            f"{name} at the package defaults (scaled to the prompt) but for the budgets named in `series`, "
            f"{args.model}, greedy decoding of {args.steps} tokens after a natural-text prompt. `hit_rate`: "
            f"`cache.memory_report().hit_rate` (selected {unit} already on the device / {unit} selected, all steps, "
            "the cold first step included); `steady_hit_rate`: the same from the second step on. `budget`: tokens "
            "selected per KV head and step. `device_ratio`: device bytes / DynamicCache bytes."
        )
        plot = dict(x="prompt_tokens", y="steady_hit_rate", series="series", ylabel="hit rate from step 2 on")
        suffix = "" if args.mode == "shadowkv" else "_yakv"
        write_results(
            f"hit_rate_{args.model}{suffix}_{args.device.split(':')[0]}",
            f"Hit rate of the selection from step to step, {name}, {args.model}",
            env,
            rows,
            columns,
            plot,
            notes=notes,
        )


if __name__ == "__main__":
    main()
