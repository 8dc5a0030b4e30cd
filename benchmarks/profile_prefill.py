"""What compression adds to a prefill: DynamicCache and ShadowKV prefills of one row, timed in turn, then profiled.

The issue's measure of compression's cost is its share of the ShadowKV prefill, `(ShadowKV - DynamicCache) /
ShadowKV` in one run. One timing of each moves by several points between runs (the first prefill of a process also
warms kernels up), so here the two prefills alternate `--repeats` times after one warm-up of each, and the medians
give the share. Then one prefill of each runs under torch.profiler, and the device time by kernel that ShadowKV's
adds over DynamicCache's says what compression spends it on (the factorisation's Gram product and eigensolver, the
copies into the compressed layout, the values' encoding and copy to host memory), beside the idle device time each
prefill leaves (host synchronisations, `benchmarks/timeline.py`).

A layer's compression runs beside the next layers' forwards (hf/background.py); `shadowkv-inline` in `--methods`
adds prefills that compress each layer inline, as before, timed in the same turns.

    python -m benchmarks.profile_prefill --context 131072 --repeats 3 --name prefill_profile_128k
    python -m benchmarks.profile_prefill --context 131072 --repeats 3 --methods dynamic,shadowkv,shadowkv-inline
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from transformers import DynamicCache

from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import PAPER_SETTINGS, build_model, free, log, prefill_seconds
from benchmarks.timeline import kernel_intervals, timeline_summary
from shadowkv_cache import ShadowKVCache, ShadowKVConfig
from shadowkv_cache.hf import background
from shadowkv_cache.testing import layer_sizes, pinned_blocks, release_pinned

METHODS = ("dynamic", "shadowkv", "shadowkv-inline")


def prefill(model, ids: torch.Tensor, method: str, config: ShadowKVConfig, device: torch.device) -> float:
    """Seconds of one prefill of `ids` into a fresh cache of `method` (the cache is dropped after). `shadowkv-inline`
    compresses each layer inline, as before compression ran beside the forward (hf/background.py)."""
    cache = DynamicCache(config=model.config) if method == "dynamic" else ShadowKVCache(model, config=config)
    free(device)
    background.BACKGROUND = method != "shadowkv-inline"
    try:
        return prefill_seconds(model, cache, ids, device)
    finally:
        background.BACKGROUND = True


def profiled(model, ids, method: str, config: ShadowKVConfig, device: torch.device) -> tuple[dict, dict | None]:
    """Device ms by kernel name and the kernel timeline of one profiled prefill."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        prefill(model, ids, method, config, device)
    kernels = kernel_intervals(prof)
    by_name: dict[str, float] = defaultdict(float)
    for name, start, end, _ in kernels:
        by_name[name] += (end - start) / 1e3
    return dict(by_name), timeline_summary(kernels, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--repeats", type=int, default=3, help="timed prefills of each method, in turn")
    p.add_argument("--value-format", default="higgs4")
    p.add_argument(
        "--methods",
        default="dynamic,shadowkv",
        help=f"comma-separated, dynamic first, of {', '.join(METHODS)} (inline: without hf/background.py)",
    )
    p.add_argument("--small", action="store_true", help="a tiny Llama (a check that the script runs)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--name", default=None, help="record under this name (JSON, Markdown, plot)")
    add_results_dir_option(p)
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    methods = args.methods.split(",")
    if methods[0] != "dynamic" or len(methods) < 2 or not set(methods) <= set(METHODS):
        p.error(f"--methods must start with dynamic and name others of {METHODS}, got {args.methods!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.small, device)
    config = ShadowKVConfig(min_compress_len=1024 if args.small else 4096, value_format=args.value_format,
                            **PAPER_SETTINGS)  # fmt: skip
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), device=device)
    if device.type == "cuda":  # a server pins its value pool once; prefills then reuse its blocks
        pinned_blocks(model.config.num_hidden_layers, layer_sizes(model, config, args.context).host_bytes_per_row)
    times: dict[str, list[float]] = {method: [] for method in methods}
    for method in times:  # warm-up: kernels chosen and compiled, the pinned pool touched
        log(f"warm-up prefill {method}: {prefill(model, ids, method, config, device):.2f} s")
    for _ in range(args.repeats):
        for method, seen in times.items():
            seen.append(prefill(model, ids, method, config, device))
            log(f"prefill {args.context} {method}: {seen[-1]:.3f} s")
    median = {method: statistics.median(seen) for method, seen in times.items()}
    share = {m: (median[m] - median["dynamic"]) / median[m] for m in methods[1:]}
    for m in methods[1:]:
        log(f"{m}: compression share {share[m]:.2%} (medians {median[m]:.3f} against {median['dynamic']:.3f} s)")
    rows = [dict(context=args.context, method=method, prefill_s=round(median[method], 4),
                 runs=", ".join(f"{t:.3f}" for t in seen),
                 compress_share=round(share[method], 4) if method in share else "")
            for method, seen in times.items()]  # fmt: skip
    extra, notes = {}, f"Medians of {args.repeats} prefills of each method, in turn, after one warm-up of each."
    if not args.no_profile and device.type == "cuda":
        (dyn, dyn_line), (skv, skv_line) = (profiled(model, ids, m, config, device) for m in methods[:2])
        added = sorted(((name, skv.get(name, 0.0) - dyn.get(name, 0.0)) for name in skv), key=lambda r: -r[1])
        extra = {"added_kernels": [dict(name=n, ms=round(ms, 3)) for n, ms in added[:25]],
                 "timeline": {"dynamic": dyn_line, "shadowkv": skv_line}}  # fmt: skip
        for row, line in zip(rows, (dyn_line, skv_line)):
            row.update(busy_s=round(line["busy_ms"] / 1e3, 4), idle_s=round(line["idle_ms"] / 1e3, 4))
        top = "; ".join(f"{n[:60]} {ms:.0f} ms" for n, ms in added[:6])
        notes += (f" Profiled once each ({methods[1]} against dynamic): ShadowKV's prefill kept the device busy "
                  f"{skv_line['busy_ms']:.0f} ms against "
                  f"{dyn_line['busy_ms']:.0f} ms and left it idle {skv_line['idle_ms']:.0f} against "
                  f"{dyn_line['idle_ms']:.0f} ms; the kernels it adds most device time to: {top} "
                  "(`added_kernels` in the JSON).")  # fmt: skip
        log(notes)
    if device.type == "cuda":
        release_pinned()
    if args.name:
        env = environment(str(device), "bfloat16" if device.type == "cuda" else "float32")
        env["shadowkv_config"] = repr(config)
        title = f"Prefill of one row at {args.context} tokens: what compression adds (Llama-3.1-8B shape, random bf16)"
        columns = ["context", "method", "prefill_s", "compress_share", "busy_s", "idle_s", "runs"]
        plot = {"x": "context", "y": "prefill_s", "series": "method", "ylabel": "s per prefill"}
        write_results(args.name, title, env, rows, columns, plot, notes, extra=extra)


if __name__ == "__main__":
    main()
