"""Where a decode step spends its time: torch.profiler over a few steps of a synthetic cache.

ShadowKV mode: every row reads one shared pinned row of values (each row still fetches its own misses over
PCIe), so large batches need no large pinned allocation. YAKV mode (`--mode yakv`): each row has its own pinned
records, as in `throughput.py` (4.4 GiB per row at 128K). In both modes the selection keeps a share `--h` of the
previous step's chunks or tokens (`ControlledHitRate`). `throughput.py` is the benchmark of record.

python -m benchmarks.profile_decode --context 131072 --batch 8 --h 0.6 [--no-graphs] [--value-format fp8]
python -m benchmarks.profile_decode --context 131072 --batch 12 --mode yakv --h 0.55
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks.speed import PAPER_SETTINGS, build_model, decode, log
from shadowkv_cache import ShadowKVConfig
from shadowkv_cache.testing import layer_sizes, pinned_blocks, synthetic_cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", default="8", help="comma-separated; the last one is profiled")
    p.add_argument("--h", type=float, default=0.6)
    p.add_argument("--small", action="store_true")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--value-format", default="native")
    p.add_argument("--mode", choices=["shadowkv", "yakv"], default="shadowkv")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.small, device)
    config = ShadowKVConfig(
        min_compress_len=1024 if args.small else 4096,
        cuda_graphs=not args.no_graphs,
        value_format=args.value_format,
        **PAPER_SETTINGS,
    )
    if args.mode == "yakv":
        config = dataclasses.replace(config, mode="yakv", rank="auto", sparse_budget=None)
    for batch in [int(b) for b in str(args.batch).split(",")]:
        if args.mode == "yakv":
            blocks = None
            if device.type == "cuda":
                row = layer_sizes(model, config, args.context).host_bytes_per_row
                blocks = pinned_blocks(model.config.num_hidden_layers, row * batch)
            cache = synthetic_cache(model, batch, args.context, config, hit_rate=args.h, host_blocks=blocks)
        else:
            cache = synthetic_cache(model, batch, args.context, config, hit_rate=args.h, share_stored_row=True)
        step = decode(model, cache, batch, 4, args.steps, device)
        hit = cache.memory_report().hit_rate
        log(
            f"step {step * 1e3:.1f} ms ({batch / step:.0f} tok/s) at batch {batch}, context {args.context}, "
            f"mode {args.mode}, h {hit if hit is None else round(hit, 2)}, graphs {not args.no_graphs}, "
            f"values {args.value_format if args.mode == 'shadowkv' else 'higgs4 k+v'}"
        )
    if args.no_profile:
        return
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    )
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        decode(model, cache, batch, 0, 3, device)
        log(f"profiled 3 steps in {(time.perf_counter() - t) * 1e3:.0f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=40))


if __name__ == "__main__":
    main()
