"""Where a decode step spends its time: step times by batch and graph mode, then torch.profiler over a few steps.

ShadowKV mode: every row reads one shared pinned row of values (each row still fetches its own misses over
PCIe), so large batches need no large pinned allocation. YAKV mode (`--mode yakv`): each row has its own pinned
records, as in `throughput.py` (4.4 GiB per row at 128K). In both modes the selection keeps a share `--h` of the
previous step's chunks or tokens (`ControlledHitRate`). `throughput.py` is the benchmark of record.

`--graphs` compares how the one-token step runs, in one run: `step` (the default: the whole step, model layers
included, replayed as one CUDA graph, hf/step_graph.py), `layer` (each layer's attention step as its own graph, the
model's own kernels launched eagerly) and `none` (everything eager). With `--name` the step times are recorded (JSON,
Markdown, plot) with the profiler's top kernels of the last configuration.

python -m benchmarks.profile_decode --context 131072 --batch 1,8,32 --graphs step,layer --name decode_graphs_128k
python -m benchmarks.profile_decode --context 131072 --batch 12 --mode yakv --h 0.55
python -m benchmarks.profile_decode --context 131072 --batch 32 --value-format higgs4 --no-profile \
    --fetch-blocks-per-sm 1
python -m benchmarks.profile_decode --context 131072 --batch 8 --value-format higgs4 --no-profile --generate

`--compile-model-ops on,off` compares the model's norms, MLPs and RoPE compiled for the decode steps (the default,
hf/fused_pieces.py) with the model's own kernels, in one run (a column `fused`).

`--generate` also profiles steps of an unchanged `model.generate` on a fresh cache of the last configuration: per
step its wall time, the host's time in PyTorch ops and CUDA runtime calls (waits for the device apart), the kernel
launches, and the top host ops, to say what `generate` adds to a step (`throughput.py` times it against raw
forwards).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import shadowkv_cache.ops.landmark_logits as landmark_logits
from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import (
    PAPER_SETTINGS,
    add_kernel_grid_options,
    apply_kernel_grid_options,
    build_model,
    decode,
    free,
    generate_times,
    log,
)
from benchmarks.timeline import kernel_intervals, timeline_summary
from shadowkv_cache import LandmarkTopK, ShadowKVConfig
from shadowkv_cache.policies.landmark_topk import LANDMARK_FORMATS
from shadowkv_cache.testing import layer_sizes, pinned_blocks, synthetic_cache

GRAPH_MODES = ("step", "layer", "none")


def make_cache(model, args, batch: int, graphs: str, device: torch.device, fused: bool = True):
    """A synthetic cache of `batch` rows at `args.context` tokens whose one-token steps run as `graphs` says, with the
    model's pieces compiled (`fused`) or not."""
    config = ShadowKVConfig(
        min_compress_len=1024 if args.small else 4096,
        cuda_graphs=graphs != "none",
        compile_model_ops=fused,
        value_format=args.value_format,
        **PAPER_SETTINGS,
    )
    if args.mode == "yakv":
        config = dataclasses.replace(
            config, mode="yakv", rank="auto", sparse_budget=None, device_record_share=args.device_record_share
        )
        blocks = None
        if device.type == "cuda":
            row = layer_sizes(model, config, args.context).host_bytes_per_row
            blocks = pinned_blocks(model.config.num_hidden_layers, row * batch)
        cache = synthetic_cache(model, batch, args.context, config, hit_rate=args.h, host_blocks=blocks)
    else:
        policy = LandmarkTopK(args.landmark_format)
        cache = synthetic_cache(model, batch, args.context, config, policy, hit_rate=args.h, share_stored_row=True)
    cache.step_graphs.enabled = graphs == "step"
    return cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", default="8", help="comma-separated; the last one is profiled")
    p.add_argument("--h", type=float, default=0.6)
    p.add_argument("--small", action="store_true")
    p.add_argument("--graphs", default="step", help=f"comma-separated of {GRAPH_MODES}; the last one is profiled")
    p.add_argument("--no-graphs", action="store_true", help="the same as --graphs none")
    p.add_argument("--compile-model-ops", default="on",
                   help="comma-separated of on, off: the model's pieces compiled (ShadowKVConfig.compile_model_ops); "
                        "the last one is profiled")  # fmt: skip
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--value-format", default="native")
    p.add_argument("--landmark-format", choices=LANDMARK_FORMATS, default="native",
                   help="ShadowKV mode: LandmarkTopK's landmark_format")  # fmt: skip
    p.add_argument("--mode", choices=["shadowkv", "yakv"], default="shadowkv")
    p.add_argument("--device-record-share", type=float, default=0.0, help="YAKV: records also kept on the GPU")
    p.add_argument("--generate", action="store_true", help="also profile steps through model.generate (host time)")
    p.add_argument("--name", default=None, help="record the step times under this name (JSON, Markdown, plot)")
    add_kernel_grid_options(p)
    p.add_argument("--landmark-blocks-per-sm", type=int, default=None,
                   help="the int8 landmark kernel's grid (BLOCKS_PER_SM in ops/landmark_logits.py)")  # fmt: skip
    add_results_dir_option(p)
    args = p.parse_args()
    apply_kernel_grid_options(p, args)
    if args.landmark_blocks_per_sm is not None:
        if args.landmark_blocks_per_sm <= 0:
            p.error(f"--landmark-blocks-per-sm must be positive, got {args.landmark_blocks_per_sm}")
        landmark_logits.BLOCKS_PER_SM = args.landmark_blocks_per_sm
    modes = ["none"] if args.no_graphs else args.graphs.split(",")
    if set(modes) - set(GRAPH_MODES):
        p.error(f"--graphs takes {GRAPH_MODES}, got {args.graphs}")
    switches = args.compile_model_ops.split(",")
    if set(switches) - {"on", "off"}:
        p.error(f"--compile-model-ops takes on, off or both, got {args.compile_model_ops}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.small, device)
    rows = []
    for batch in [int(b) for b in str(args.batch).split(",")]:
        for graphs, switch in [(g, f) for g in modes for f in switches]:
            cache = None  # the previous configuration's memory back first
            free(device)
            cache = make_cache(model, args, batch, graphs, device, fused=switch == "on")
            step = decode(model, cache, batch, 4, args.steps, device)
            hit = cache.memory_report().hit_rate
            values = args.value_format if args.mode == "shadowkv" else "higgs4 k+v"
            if args.mode == "yakv" and args.device_record_share:
                values += f", {args.device_record_share:g} on GPU"
            landmarks = args.landmark_format if args.mode == "shadowkv" else None
            rows.append(dict(context=args.context, batch=batch, mode=args.mode, values=values, landmarks=landmarks,
                             graphs=graphs, fused=switch,
                             h=None if hit is None else round(hit, 3), step_ms=round(step * 1e3, 2),
                             tok_s=round(batch / step, 1), replays=cache.step_graphs.replays))  # fmt: skip
            log(f"step {step * 1e3:.1f} ms ({batch / step:.0f} tok/s) at batch {batch}, context {args.context}, "
                f"mode {args.mode}, h {rows[-1]['h']}, graphs {graphs}, fused {switch}, values {values}, "
                f"landmarks {landmarks}")  # fmt: skip
    kernels, timeline = ([], None) if args.no_profile else profile(model, cache, batch, device)
    if timeline:
        log(f"profiled steps: {timeline['busy_ms']:.2f} ms busy, {timeline['idle_ms']:.2f} ms idle per step, "
            f"{timeline['kernels_per_step']:.0f} kernels per step")  # fmt: skip
    if timeline and timeline["fetch_ms"]:
        log(f"value fetch {timeline['fetch_ms']:.2f} ms per step, {timeline['hidden_ms']:.2f} ms of it beside other "
            f"kernels ({timeline['hidden_share']:.0%} hidden)")  # fmt: skip
    host = None
    if args.generate:
        cache = None
        free(device)
        cache = make_cache(model, args, batch, modes[-1], device, fused=switches[-1] == "on")
        host = profile_generate(model, cache, batch, args.context, device)
        log(f"generate: {host['wall_ms']:.2f} ms per step; host in ops and runtime calls {host['host_ms']:.2f} ms, "
            f"waiting for the device {host['wait_ms']:.2f} ms, {host['launches']:.0f} launches per step")  # fmt: skip
    if args.name:
        env = environment(str(device), "bfloat16" if device.type == "cuda" else "float32")
        title = f"Decode step by graph mode, {args.mode}, context {args.context} (synthetic cache, h={args.h})"
        plot = {"x": "batch", "y": "step_ms", "series": "graphs", "ylabel": "ms per step"}
        columns = ["context", "batch", "mode", "values", "landmarks", "graphs", "fused", "h", "step_ms", "tok_s",
                   "replays"]  # fmt: skip
        notes = (f"Top kernels by CUDA time of the last configuration (batch {batch}, graphs {modes[-1]}, fused "
                 f"{switches[-1]}, 3 steps) "
                 "are in the JSON (`kernels`).") if kernels else ""  # fmt: skip
        t = timeline
        if t:
            notes += (f" On the profiled steps' kernel timeline the device was busy {t['busy_ms']:.2f} ms and idle "
                      f"{t['idle_ms']:.2f} ms per step ({t['kernels_per_step']:.0f} kernels).")  # fmt: skip
        if t and t["fetch_ms"]:
            notes += (f" The value fetch took {t['fetch_ms']:.2f} ms per step, {t['hidden_ms']:.2f} ms of it beside "
                      f"other kernels: {t['hidden_share']:.0%} hidden (`timeline` in the JSON, "
                      "benchmarks/timeline.py).")  # fmt: skip
        if host:
            notes += (f" Through `model.generate` (batch {batch}): {host['wall_ms']:.2f} ms per step, of which the "
                      f"host spent {host['host_ms']:.2f} ms in PyTorch ops and CUDA runtime calls and "
                      f"{host['wait_ms']:.2f} ms waiting for the device; {host['launches']:.0f} launches per step "
                      "(`generate` in the JSON).")  # fmt: skip
        extra = {"kernels": kernels, "timeline": timeline, "generate": host}
        write_results(args.name, title, env, rows, columns, plot, notes, extra=extra)


# CUDA runtime calls in which the host waits for the device: idle host time, not work. `cudaMemcpyAsync` is among
# them because a step's copies are a few tokens each way and the one to pageable host memory (the next tokens for the
# stopping check) blocks until the device is done: its time is the wait, not the copy.
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def host_time(rows: list[tuple[str, float, int]], steps: int, wall_ms: float) -> dict:
    """What the host did per step, from the profiler's host rows `(name, self CPU µs, calls)` over `steps` steps of
    `wall_ms` each: time in PyTorch ops and CUDA runtime calls less the waits for the device (`host_ms`; Python
    between ops is not in it), the waits (`wait_ms`), kernel and graph launches, and the top rows by self time."""
    waits = sum(t for name, t, _ in rows if name in _WAITS)
    busy = [r for r in rows if r[0] not in _WAITS]
    top = sorted(busy, key=lambda r: r[1], reverse=True)[:20]
    per_step = [dict(name=n, ms_per_step=round(t / 1e3 / steps, 4), calls_per_step=c / steps) for n, t, c in top]
    return dict(wall_ms=round(wall_ms, 3), host_ms=round(sum(r[1] for r in busy) / 1e3 / steps, 3),
                wait_ms=round(waits / 1e3 / steps, 3),
                launches=sum(c for name, _, c in rows if name in _LAUNCHES) / steps, top=per_step)  # fmt: skip


def profile_generate(model, cache, batch: int, context: int, device: torch.device, warm: int = 6, steps: int = 3):
    """torch.profiler (host activity) over `steps` greedy `generate` steps after `warm` (captures included), on a
    cache that holds `context` tokens: `host_time` of those steps."""
    schedule = torch.profiler.schedule(wait=warm, warmup=0, active=steps, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
        times = generate_times(model, cache, batch, context, warm + steps + 1, device, on_put=prof.step)
    # put() number i (0: the prompt) ends forward i, and profiler step k spans forward k: the profiled forwards are
    # warm .. warm + steps - 1, from put() number warm - 1 to put() number warm + steps - 1.
    wall_ms = (times[warm + steps - 1] - times[warm - 1]) / steps * 1e3
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.device_type.name == "CPU"]
    return host_time(rows, steps, wall_ms)


def profile(model, cache, batch: int, device: torch.device) -> tuple[list[dict], dict | None]:
    """torch.profiler over 3 steps; prints the tables and returns the top kernels by CUDA time (ms per step) and the
    steps' kernel timeline (`timeline_summary`: busy and idle time, the fetch and the share of it hidden)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    )
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        decode(model, cache, batch, 0, 3, device, reset_counts=False)
        log(f"profiled 3 steps in {(time.perf_counter() - t) * 1e3:.0f} ms")
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40))
    if device.type != "cuda":
        return [], None
    print(events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=40))
    # Kernels only: an operator's own row also carries the device time of the kernels it launched (eager modes).
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    total_ms = sum(e.self_device_time_total for e in on_device) / 1e3 / 3
    launches = sum(e.count for e in on_device) / 3
    log(f"GPU time {total_ms:.2f} ms per step over ~{launches:.0f} device events per step")
    top = sorted(on_device, key=lambda e: e.self_device_time_total, reverse=True)[:30]
    rows = [dict(name=e.key, calls_per_step=e.count / 3, ms_per_step=round(e.self_device_time_total / 1e3 / 3, 3))
            for e in top]  # fmt: skip
    timeline = timeline_summary(kernel_intervals(prof), 3, sample=120)
    return [dict(name="all device time", calls_per_step=launches, ms_per_step=round(total_ms, 3)), *rows], timeline


if __name__ == "__main__":
    main()
