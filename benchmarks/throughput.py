"""Decode throughput and memory: ShadowKVCache against full attention (DynamicCache + sdpa) in one run.

Legend: B batch, S context tokens, L layers, Hkv KV heads, D head dim, K selected chunks, c chunk size, h hit rate.

Llama-3.1-8B shape with random bf16 weights built on the GPU. Per context:
1. a real prefill at batch 1 with DynamicCache and with ShadowKVCache (prefill time, compression share =
   (ShadowKV - Dynamic) / ShadowKV, including the copy to host), then 256 decode steps of the ShadowKV cache
   (batch-1 step latency, GPU bytes per sequence at 256 generated tokens, hit rate of random weights);
2. batch sweeps with a synthetic fill (random K/V at the target length for DynamicCache; random factors,
   landmarks, outliers and pinned host values for ShadowKV), until GPU or host memory runs out. With random
   weights the hit rate is meaningless and it sets the PCIe bytes, so the ShadowKV sweep runs a query stream
   whose selection keeps a share h of the previous step's chunks by construction (h = 0.6 by default, about
   what SmolLM2 measured), and the best batch is rerun at h = 0, 0.8 and with the model's own selection.
3. with `--methods ...,yakv`, YAKV mode too: a real prefill at batch 1 (its quantisation share), then a batch
   sweep with a synthetic fill (random 2-bit scoring codes on the GPU, random 4-bit key and value records in
   pinned host memory) up to the host budget. As for ShadowKV, the selection keeps a share of the previous step's
   tokens by construction (`--yakv-h`), which sets the records a step fetches.
4. at batch `--generate-batch` (8; 0 skips it): DynamicCache and ShadowKV through an unchanged `model.generate`
   next to raw forwards on a like cache, `--generate-repeats` times in turn (fill "synthetic, generate"; the median
   is recorded, the note gives the ratio and its spread).
Decode tokens/s = B x timed steps / wall time of `model(...)` forwards (no sampling), synchronised at both
ends. A sweep row's GPU memory (fullest GPU): `peak_gpu_gib` since the cache's build began; `built_gpu_gib` allocated
once it was built; `held_gpu_gib` after the timed steps (with CUDA-graph pools and lasting step buffers); and
`cache_gpu_gib`, what the cache's `memory_report()` counts (`speed.residency` says what each difference means).
Roofline of full attention = HBM bandwidth (measured) / (weights + B x full KV bytes) per step.

    python -m benchmarks.throughput --device cuda        # the H200 run (about 8 minutes)
    python -m benchmarks.throughput --split              # the model's layers spread over every visible GPU
    python -m benchmarks.throughput --small              # a tiny CPU run that checks the script

With `--split` accelerate dispatches the layers over all visible GPUs (`speed.split_map`, what `device_map="auto"`
does to a model that outgrows one GPU); every cache keeps each layer on its layer's GPU (design.md §11), rows
record the peak memory of each GPU (`peak_by_device`, and `peak_gpu_gib` the fullest) and the compressed caches'
bytes per GPU (`gpu_gib_by_device`). The GPUs run one after the other: the second one adds memory (larger batches),
not compute in parallel; each fetches its own layers' values over its own host link, but the links take turns.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from benchmarks.results_io import add_results_dir_option, environment, results_dir
from benchmarks.speed import (
    PAPER_SETTINGS,
    GiB,
    add_kernel_grid_options,
    apply_kernel_grid_options,
    build_model,
    hbm_bandwidth,
    layer_devices,
    log,
)
from benchmarks.throughput_report import Recorder, add_summary, replot
from benchmarks.throughput_sweeps import (
    Run,
    full_attention_sweeps,
    generate_runs,
    host_blocks,
    prefill_runs,
    shadowkv_sweeps,
    variants,
    yakv_sweeps,
)
from shadowkv_cache import ShadowKVCache, ShadowKVConfig
from shadowkv_cache.policies.landmark_topk import LANDMARK_FORMATS
from shadowkv_cache.testing import pinned_huge_pages

# The YAKV sweep's hit rate: between what Gemma 3 (0.50-0.52) and SmolLM2 (0.59-0.79) measured at YAKV's 128K budget
# share, 4K-16K tokens of natural text (benchmarks/hit_rate.py, results/hit_rate_*_yakv_cpu.md).
YAKV_H = 0.55

warnings.filterwarnings("ignore", category=FutureWarning)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--split", action="store_true", help="spread the layers over every visible GPU (device_map)")
    p.add_argument("--small", action="store_true", help="tiny model and contexts (checks the script on CPU)")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths")
    p.add_argument("--batches", default="1,2,4,6,8,12,16,24,32,48,64")
    p.add_argument("--warm", type=int, default=8, help="untimed steps (>= 3: the CUDA-graph capture is the third)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--h-sweep", type=float, default=0.6, help="hit rate of the ShadowKV batch sweep")
    p.add_argument("--yakv-h", type=float, default=YAKV_H, help="hit rate of the YAKV batch sweep (tokens)")
    p.add_argument(
        "--yakv-device-shares",
        default="0",
        help="YAKV sweeps' device_record_share values (comma-separated): records also kept on the GPU",
    )
    p.add_argument("--host-gib", type=float, default=96.0, help="host memory the ShadowKV sweep may pin")
    p.add_argument("--value-formats", default="native,fp8", help="host value formats of the ShadowKV sweep")
    p.add_argument(
        "--landmark-formats",
        default="native",
        help="landmark formats of the ShadowKV sweep (LandmarkTopK's landmark_format: native, int8)",
    )
    p.add_argument("--extra-h", default="0,0.8,own", help="hit rates rerun at the best batch ('own': the model's)")
    p.add_argument("--methods", default="dynamic,static,shadowkv", help="which sweeps to run (also: yakv)")
    p.add_argument("--generate-batch", type=int, default=8, help="batch of the generate-vs-forward runs (0: none)")
    p.add_argument("--generate-repeats", type=int, default=3,
                   help="interleaved forward and generate timings per method; the median is recorded")  # fmt: skip
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--no-static", action="store_true")
    p.add_argument("--name", default=None)
    add_kernel_grid_options(p)
    p.add_argument("--huge-pages", action="store_true",
                   help="pinned host blocks on 2 MiB pages (testing.pinned_huge_pages), to compare")  # fmt: skip
    p.add_argument("--replot", metavar="NAME", help="recompute the summary and plot of results/NAME.json, no run")
    p.add_argument("--note", help="with --replot: a note stored in the record's environment")
    add_results_dir_option(p)
    args = p.parse_args()
    apply_kernel_grid_options(p, args)
    pinned_huge_pages(args.huge_pages)
    return args


def main() -> None:
    args = parse_args()
    if args.generate_repeats < 1:
        raise SystemExit(f"--generate-repeats must be at least 1, got {args.generate_repeats}.")
    if args.replot:
        replot(args.replot, args.h_sweep, args.note)
        return
    args.extra_h = [None if x == "own" else float(x) for x in args.extra_h.split(",") if x]
    bad = [f for f in args.landmark_formats.split(",") if f not in LANDMARK_FORMATS]
    if bad:
        raise SystemExit(f"--landmark-formats: unknown {bad}; use a comma-separated list of {LANDMARK_FORMATS}.")
    device = torch.device(args.device)
    if args.split:
        if not torch.cuda.is_available():
            raise SystemExit("--split spreads the model over GPUs; this machine has none (drop --split).")
        device = torch.device("cuda")  # no index: every visible GPU (benchmarks.speed.gpus)
    count = torch.cuda.device_count() if args.split else 1
    contexts = [int(x) for x in (args.contexts or ("2048,4096" if args.small else "32768,65536,131072")).split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if args.small:
        batches = [b for b in batches if b <= 4]
        args.warm, args.steps = min(args.warm, 2), min(args.steps, 4)
    config = ShadowKVConfig(min_compress_len=1024 if args.small else 4096, **PAPER_SETTINGS)
    env = environment(str(device), "bfloat16" if device.type == "cuda" else "float32")
    env["fill"] = (
        "real prefill at batch 1 per context; synthetic random K/V (Dynamic) and random compressed prompts (ShadowKV) for batch sweeps"  # noqa: E501
    )
    name = args.name or ("throughput_small" if args.small else f"throughput_{device.type}")
    if args.split:
        name = args.name or f"{name}_split{count}"
        env.update(gpus=count, gpu_names=[torch.cuda.get_device_name(i) for i in range(count)])
    rec = Recorder(name, env)
    if args.split:  # per-GPU figures in the Markdown table too
        rec.COLUMNS = [*rec.COLUMNS[:-1], "peak_by_device", "gpu_gib_by_device", rec.COLUMNS[-1]]
    log("ENV", env)  # the log alone then holds the whole record

    log("building model", "tiny" if args.small else "Llama-3.1-8B shape", "on", device)
    model = build_model(args.small, device, split=args.split)
    if args.split:
        placed = {}
        for layer, on in enumerate(layer_devices(model)):
            placed.setdefault(str(on), []).append(layer)
        env["layers_by_device"] = {on: f"{layers[0]}-{layers[-1]}" for on, layers in placed.items()}
        log("layers by device:", env["layers_by_device"])
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    hbm_bw = hbm_bandwidth(device)
    # A split run's full-attention sweep may fill every GPU: their memory adds up.
    gpu = count * torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    env.update(hbm_copy_bandwidth_GBps=round(hbm_bw / 1e9, 1), weight_gib=round(weights / GiB, 2),
               gpu_memory_gib=round(gpu / GiB, 1) if gpu else None, shadowkv_config=str(config))  # fmt: skip
    log(f"weights {weights / GiB:.1f} GiB, HBM copy {hbm_bw / 1e9:.0f} GB/s")
    ShadowKVCache(model, config=config)  # patch once: Dynamic runs through the same (sdpa) attention path
    run = Run(args, model, config, device, contexts, batches, rec, weights, hbm_bw, gpu or 64 << 30)

    if not args.no_prefill:
        prefill_runs(run)
    full_attention_sweeps(run)
    blocks = host_blocks(run)
    shadowkv_sweeps(run, blocks)
    yakv_sweeps(run, blocks)
    generate_runs(run, blocks)
    add_summary(rec, contexts, variants(args), args.h_sweep)
    rec.write(plot=True)
    log("done:", results_dir() / f"{name}.md")


if __name__ == "__main__":
    main()
