"""Where a ShadowKV decode step spends its time: torch.profiler over a few steps of a synthetic cache.

python benchmarks/profile_decode.py --context 131072 --batch 8 --h 0.6
"""

from __future__ import annotations

import argparse
import time

import torch
from throughput import ControlledHitRate, build_model, decode, fill_shadowkv, log

from shadowkv_cache import ShadowKVCache, ShadowKVConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--h", type=float, default=0.6)
    p.add_argument("--small", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.small, device)
    config = ShadowKVConfig(min_compress_len=1024 if args.small else 4096)
    cache = ShadowKVCache(model, config=config, policy=ControlledHitRate(args.h))
    fill_shadowkv(model, cache, args.batch, args.context, device, None)
    step = decode(model, cache, args.batch, 4, 8, device)
    log(f"step {step * 1e3:.1f} ms at batch {args.batch}, context {args.context}, h {args.h}")
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    )
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        decode(model, cache, args.batch, 0, 3, device)
        log(f"profiled 3 steps in {(time.perf_counter() - t) * 1e3:.0f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=40))


if __name__ == "__main__":
    main()
