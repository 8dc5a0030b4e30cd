"""Long-run check: many `generate` calls in one process on one model, memory recorded after each.

The calls rotate over the ways a cache is made: a fresh `ShadowKVCache` per call, a fork of one document prefilled at
the start (one row, and a shared batch of questions), a cache loaded from a prefix file saved at the start, and on
CUDA a fresh cache whose one-token steps are captured as CUDA graphs (the other kinds run with `cuda_graphs=False`
there, so both paths are exercised). After each call the process's resident memory (RSS) and, on CUDA, the
allocated and reserved GPU memory are recorded; every 50 calls the live `ShadowKVCache` objects are counted after a
garbage collection (all but the prefilled document should be gone). Memory is "flat" when, after a warm-up, neither
RSS nor allocated GPU memory grows by more than a tolerance between the start and the end of the run.

Writes `<name>.json`, `<name>.md` and `<name>.png` (memory against call number) into `--results-dir`.

    python -m benchmarks.long_run --results-dir /tmp/long_run                          # tiny model, CPU, minutes
    python -m benchmarks.long_run --model smollm2 --device cuda --dtype bfloat16       # the real model on a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch

from benchmarks.results_io import environment, markdown_table
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.prefix import batch_questions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VERDICT_COLUMNS = ["memory", "baseline_mib", "end_mib", "growth_mib", "slope_mib_per_100_calls", "allowed_growth_mib",
                   "flat"]  # fmt: skip
WARMUP = 100  # calls before the baseline: allocator pools, kernel caches and lazy imports settle
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every cache made, to count those still alive


def rss_mib() -> float:
    """Resident memory of this process now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_model(name: str, device: str, dtype: torch.dtype):
    """`(model, vocab size, settings)`: a tiny random Llama (seeded) or the embedded SmolLM2."""
    if name == "tiny":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(
            "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=4096, pad_token_id=0,
            bos_token_id=None, eos_token_id=None, initializer_range=0.15,
        )  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        settings = {"rank": 8, "sparse_budget": 32, "outlier_chunks": 2, "local_window": 16, "min_compress_len": 64}
        return model, 128, settings
    from shadowkv_cache.embedded_models import load_smollm2

    model, tokenizer = load_smollm2(dtype=dtype, device=device)
    model.generation_config.eos_token_id = None  # every call generates exactly --new-tokens
    return model, tokenizer.vocab_size, {"min_compress_len": 1024}


def generate(model, ids: torch.Tensor, cache, new_tokens: int, **kwargs) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        return model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False, **kwargs)


def run(args) -> tuple[list[dict], dict]:
    device, dtype = args.device, DTYPES[args.dtype]
    cuda = device.startswith("cuda")
    model, vocab, settings = load_model(args.model, device, dtype)
    gen = torch.Generator().manual_seed(0)
    document = torch.randint(1, vocab, (args.prompt_tokens,), generator=gen)
    questions = [torch.randint(1, vocab, (n,), generator=gen) for n in (5, 9, 3)]
    eager = {**settings, "cuda_graphs": False}
    doc = ShadowKVCache.prefill(model, document, **eager)
    folder = tempfile.TemporaryDirectory()
    path = Path(folder.name) / "document.safetensors"
    doc.save_prefix(path)
    kinds = ["fresh", "fork", "loaded", "shared batch"] + (["cuda graphs"] if cuda else [])

    def one_call(kind: str, i: int) -> None:
        question = questions[i % len(questions)]
        ids = torch.cat([document, question])[None].to(device)
        if kind == "fresh":
            cache = ShadowKVCache(model, **eager)
        elif kind == "cuda graphs":
            cache = ShadowKVCache(model, **settings)
        elif kind == "fork":
            cache = doc.fork()
        elif kind == "loaded":
            cache = ShadowKVCache.load_prefix(model, path)
        else:  # three questions over one shared copy of the document
            batch, mask = batch_questions(document, questions, pad_token_id=0)
            cache = doc.fork(len(questions))
            _LIVE.add(cache)
            generate(model, batch.to(device), cache, args.new_tokens, attention_mask=mask.to(device))
            return
        _LIVE.add(cache)
        generate(model, ids, cache, args.new_tokens)

    rows = []
    start = time.perf_counter()
    for i in range(args.calls):
        kind = kinds[i % len(kinds)]
        began = time.perf_counter()
        one_call(kind, i)
        row = {"call": i + 1, "kind": kind, "seconds": round(time.perf_counter() - began, 4), "rss_mib": rss_mib()}
        if cuda:
            torch.cuda.synchronize()
            row["gpu_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
            row["gpu_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
        if (i + 1) % 50 == 0:
            gc.collect()
            row["live_caches"] = len(_LIVE)  # caches of earlier calls still alive (the document is not counted)
            print(f"call {i + 1}/{args.calls}: rss {row['rss_mib']:.1f} MiB, live caches {row['live_caches']}"
                  + (f", gpu {row['gpu_allocated_mib']:.1f} MiB" if cuda else ""), flush=True)  # fmt: skip
        rows.append(row)
    folder.cleanup()
    return rows, {"wall_s": round(time.perf_counter() - start, 1), "kinds": kinds}


def verdict(rows: list[dict], column: str, tolerance_mib: float, share: float) -> dict:
    """Growth of `column` from the calls just after the warm-up to the last calls (medians of 10% of the run), and a
    least-squares slope over everything after the warm-up; flat when the growth stays within the tolerance."""
    after = [r[column] for r in rows[WARMUP:] if column in r]
    if len(after) < 20:
        return {}
    window = max(10, len(after) // 10)
    base, end = statistics.median(after[:window]), statistics.median(after[-window:])
    xs = list(range(len(after)))
    mx, my = statistics.fmean(xs), statistics.fmean(after)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, after)) / sum((x - mx) ** 2 for x in xs)
    allowed = max(tolerance_mib, share * base)
    return {
        "baseline_mib": round(base, 2),
        "end_mib": round(end, 2),
        "growth_mib": round(end - base, 2),
        "slope_mib_per_100_calls": round(100 * slope, 4),
        "allowed_growth_mib": round(allowed, 2),
        "flat": end - base <= allowed,
    }


def write(args, rows: list[dict], info: dict) -> dict:
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    columns = ["rss_mib"] + (["gpu_allocated_mib", "gpu_reserved_mib"] if "gpu_allocated_mib" in rows[0] else [])
    summary = {c: verdict(rows, c, args.tolerance_mib, 0.02) for c in columns}
    live = [r["live_caches"] for r in rows if "live_caches" in r]
    summary["live_caches"] = {"max": max(live, default=0), "last": live[-1] if live else None}
    env = environment(args.device, args.dtype)
    settings = {k: getattr(args, k) for k in ("model", "calls", "prompt_tokens", "new_tokens")}
    data = {"title": "Long-run memory", "env": env, "settings": settings, **info, "summary": summary, "rows": rows}
    (out / f"{args.name}.json").write_text(json.dumps(data, indent=1))

    table = [{"memory": c, **v} for c, v in summary.items() if c != "live_caches"]
    per_kind = [
        {"kind": k, "calls": len(t), "median s": round(statistics.median(t), 4)}
        for k in info["kinds"]
        if (t := [r["seconds"] for r in rows if r["kind"] == k])
    ]
    window = max(10, (args.calls - WARMUP) // 10)
    lines = [
        f"# Long-run memory: {args.calls} generate calls, {args.model} on {args.device} ({args.dtype})",
        "",
        f"Calls rotate over {', '.join(info['kinds'])}; document {args.prompt_tokens} tokens, {args.new_tokens} new "
        f"tokens per call; {info['wall_s']} s in all. Baseline: the median of the {window} calls after a "
        f"{WARMUP}-call warm-up; end: the median of the last as many. Live caches after a garbage "
        f"collection every 50 calls: at most {summary['live_caches']['max']} (the prefilled document is not counted).",
        "",
        *markdown_table(table, VERDICT_COLUMNS),
        "",
        *markdown_table(per_kind, ["kind", "calls", "median s"]),
        "",
        "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items() if k != "command"),
        "",
        f"Command: `{env['command']}`",
        "",
    ]
    (out / f"{args.name}.md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(columns), 1, figsize=(7, 2.6 * len(columns)), squeeze=False)
    for ax, column in zip(axes[:, 0], columns):
        ax.plot([r["call"] for r in rows], [r[column] for r in rows], lw=0.8)
        ax.axvline(WARMUP, color="grey", ls=":", lw=0.8)
        ax.set_ylabel(column.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("generate call")
    axes[0, 0].set_title(f"{args.model} on {args.device}: memory after each call (dotted: end of warm-up)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{args.name}.png", dpi=120)
    plt.close(fig)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="document tokens (tiny: 300, smollm2: 4096)")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--tolerance-mib", type=float, default=16.0, help="growth allowed besides 2%% of the baseline")
    parser.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    if args.prompt_tokens is None:
        args.prompt_tokens = 300 if args.model == "tiny" else 4096
    args.name = args.name or f"long_run_{args.model}_{args.device.split(':')[0]}"
    rows, info = run(args)
    summary = write(args, rows, info)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
