"""The default rank and budget against the alternatives: teacher-forced agreement with full attention against the
device bytes each setting holds per prompt token, on natural text (the Python reference documentation).

Rank rules compared at the default budget: the old fixed share of `Hkv*D` (the paper's 160/1024, scaled), other
fixed shares, `rank="auto"` at several relative logit-error tolerances (`auto_rank_error`; 0.075 is the default)
and attention-weighted ones (`auto_rank_shift`, in nats; with it off, the relative bound alone), and exact keys;
the old defaults (fixed share, 256-token budget floor) for reference; and budgets around the default one for
`rank="auto"`. Each setting prefills the window itself (the same path `generate` takes) and is then fed the same
continuation as `DynamicCache`, one token per step. Rerun:

    .venv/bin/python -m benchmarks.defaults                                   # SmolLM2 fp32 on CPU, 4K and 8K
    python -m benchmarks.defaults --device cuda --dtype bfloat16              # SmolLM2 bf16, an H200 machine
    python -m benchmarks.defaults --model gemma3 --lengths 8192 16384 32000 --device cuda --dtype bfloat16

Writes benchmarks/results/defaults_<model>_<device>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import torch
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.results_io import add_results_dir_option, environment, plot_facets, write_results
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.fidelity import natural_text_ids, teacher_forced_logits

warnings.filterwarnings("ignore", category=FutureWarning)

OLD_RANK_SHARE = 0.15625  # the default before rank="auto": 160 of Llama-3.1-8B's 1024 key dims, scaled
OLD_BUDGET_FLOOR = 256


def load(name: str, device: str, dtype: torch.dtype):
    from shadowkv_cache.embedded_models import load_gemma3_270m, load_smollm2

    return (load_gemma3_270m if name == "gemma3" else load_smollm2)(dtype=dtype, device=device)


def settings(key_dim: int, length: int) -> list[dict]:
    """`(rule, label, overrides)` of every setting compared at one prompt length."""
    old_rank = math.ceil(OLD_RANK_SHARE * key_dim / 8) * 8
    old_budget = max(OLD_BUDGET_FLOOR, math.ceil(0.015625 * length))
    out = [{"rule": "old defaults", "label": f"rank {old_rank}, budget {old_budget}", "rank": old_rank,
            "sparse_budget": old_budget}]  # fmt: skip
    for share in (0.125, 0.25, 0.375, 0.5):
        out.append({"rule": "fixed share", "label": f"rank {share:g}*Hkv*D", "rank": share})
    for error in (0.2, 0.1, 0.075, 0.05):
        out.append({"rule": "auto", "label": f"auto, error {error:g}", "auto_rank_error": error})
    # The attention-weighted bound at other values, and off (the relative bound alone, the rule before it).
    for shift in (0.2, 0.5, math.inf):
        label = "auto, relative bound only" if shift == math.inf else f"auto, shift {shift:g}"
        out.append({"rule": "auto", "label": label, "auto_rank_shift": 1e9 if shift == math.inf else shift})
    out.append({"rule": "exact keys", "label": "rank Hkv*D", "rank": key_dim})
    for budget in (1024, 4096):
        out.append({"rule": f"auto, budget {budget}", "label": f"auto, budget {budget}", "sparse_budget": budget})
    return out


@torch.no_grad()
def compare(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(full || cache)) of teacher-forced logits `[N, V]`."""
    agreement = (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
    return agreement, (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def run_setting(model, ids: torch.Tensor, length: int, reference: torch.Tensor, setting: dict) -> dict:
    overrides = {k: v for k, v in setting.items() if k not in ("rule", "label")}
    cache = ShadowKVCache(model, min_compress_len=min(length, 4096), **overrides)
    start = time.perf_counter()
    logits = teacher_forced_logits(model, ids, length, cache)
    report = cache.memory_report()
    compressed = [m for m in report.layers if m.compressed]
    agreement, kl = compare(reference, logits)
    return {
        "rule": setting["rule"],
        "setting": setting["label"],
        "agreement": round(agreement, 4),
        "mean_kl": round(kl, 5),
        "mean_rank": round(sum(m.rank for m in compressed) / len(compressed), 1),
        "ranks": [m.rank for m in compressed],
        "budget_tokens": compressed[0].budget_tokens,
        # The compressed layers only: their device bytes (factors, landmarks, outliers, local window, temporal
        # slots, the buffer of generated tokens) per prompt token, and against DynamicCache's full K/V.
        "device_bytes_per_token": round(sum(m.gpu_bytes for m in compressed) / length, 1),
        "device_ratio": round(sum(m.gpu_bytes for m in compressed) / sum(m.dynamic_cache_bytes for m in compressed), 4),
        "whole_cache_ratio": round(report.ratio, 4),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--windows", type=int, default=2, help="text windows per length (different offsets)")
    parser.add_argument("--steps", type=int, default=64, help="teacher-forced continuation tokens per window")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None, help="result name (default defaults_<model>_<device>)")
    add_results_dir_option(parser)
    args = parser.parse_args()

    model, tokenizer = load(args.model, args.device, getattr(torch, args.dtype))
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    key_dim = text.num_key_value_heads * head_dim
    longest = max(args.lengths) + args.steps
    corpus = natural_text_ids(tokenizer, longest + (args.windows - 1) * 20_000).to(args.device)
    rows = []
    plan = [(length, w, s) for length in args.lengths for w in range(args.windows) for s in settings(key_dim, length)]
    bar = tqdm(plan, desc=f"{args.model} settings")
    current, reference = None, None
    for length, window, setting in bar:
        start = window * 20_000  # windows far apart in the text
        ids = corpus[:, start : start + length + args.steps]
        if current != (length, window):
            reference = teacher_forced_logits(model, ids, length, DynamicCache(config=model.config))
            current = (length, window)
        row = {"prompt_tokens": length, "window": window, **run_setting(model, ids, length, reference, setting)}
        rows.append(row)
        tqdm.write(str({k: row[k] for k in ("prompt_tokens", "window", "setting", "agreement", "mean_kl",
                                            "mean_rank", "device_ratio")}))  # fmt: skip

    summary = summarise(rows)
    name = args.out or f"defaults_{args.model}_{args.device}"
    columns = ["prompt_tokens", "rule", "setting", "windows", "agreement", "mean_kl", "mean_rank", "budget_tokens",
               "device_bytes_per_token", "device_ratio"]  # fmt: skip
    notes = (
        f"{args.model}, {args.dtype} on {args.device}: teacher-forced top-1 agreement with DynamicCache and mean "
        f"KL(full || cache) over {args.steps} continuation tokens per window, {args.windows} windows per length "
        "(means over windows; per-window rows in the JSON). `device_ratio`: device bytes of the compressed layers "
        "(factors, landmarks, outliers, local window, temporal slots, generated-token buffer) over DynamicCache's "
        "K/V of the same layers and tokens; values live in host memory. `auto` is `rank='auto'` at the given "
        "`auto_rank_error` (relative) or `auto_rank_shift` (attention-weighted, nats), the other at its default; "
        "natural text rarely needs the second bound (needle tasks do: the accuracy results); the default budget is "
        "max(2048, 1.5625% of the prompt), at most a quarter of it."
    )
    write_results(
        name,
        title=f"Default rank and budget: agreement against device bytes ({args.model})",
        env=environment(args.device, args.dtype),
        rows=summary,
        columns=columns,
        plot=None,
        notes=notes,
        extra={"per_window": rows},
    )
    plot_facets(
        name,
        f"Agreement with full attention against device bytes per token ({args.model})",
        summary,
        {"facet": "prompt_tokens", "series": "rule", "x": "device_bytes_per_token", "y": "agreement"},
    )


def summarise(rows: list[dict]) -> list[dict]:
    """Means over windows of each (length, setting)."""
    averaged = ("agreement", "mean_kl", "mean_rank", "device_bytes_per_token", "device_ratio")
    return means_over_windows(rows, "setting", averaged, carried=("rule",))


def means_over_windows(
    rows: list[dict], by: str, averaged: tuple[str, ...], carried: tuple[str, ...] = ()
) -> list[dict]:
    """One row per (prompt length, `rows[by]`): the `averaged` fields' means over its windows, with the group's
    first `carried` fields and budget (the same in every window)."""
    out = []
    for key in dict.fromkeys((r["prompt_tokens"], r[by]) for r in rows):
        group = [r for r in rows if (r["prompt_tokens"], r[by]) == key]
        first = group[0]
        mean = {k: round(sum(r[k] for r in group) / len(group), 4) for k in averaged}
        out.append({"prompt_tokens": key[0], **{k: first[k] for k in carried}, by: key[1], "windows": len(group),
                    "budget_tokens": first["budget_tokens"], **mean})  # fmt: skip
    return out


if __name__ == "__main__":
    main()
