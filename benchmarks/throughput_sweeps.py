"""The throughput benchmark's measurements: real prefills at batch 1, then batch sweeps of full attention, ShadowKV
and YAKV over synthetic caches, each row added to the run's record as soon as it is measured.

Legend: B batch, S context tokens, L layers, h hit rate. The plan is in `throughput.py`'s docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from transformers import DynamicCache

from benchmarks.bounds import full_attention_step, kv_bytes_per_token, shadowkv_bound, yakv_bound
from benchmarks.fills import fill_dynamic, fill_static
from benchmarks.speed import (
    GiB,
    allocated_gib,
    decode,
    free,
    generate_times,
    hit_rate,
    log,
    peaks,
    prefill_seconds,
    reset_peak,
    residency,
)
from benchmarks.throughput_report import Recorder, variant_label
from shadowkv_cache import LandmarkTopK, ShadowKVCache, ShadowKVConfig
from shadowkv_cache.testing import layer_sizes, pinned_blocks, pinned_bytes, release_pinned, synthetic_cache

GENERATED_FOR_MEMORY = 256


@dataclasses.dataclass
class Run:
    """What every measurement of one run shares."""

    args: argparse.Namespace
    model: torch.nn.Module
    config: ShadowKVConfig
    device: torch.device
    contexts: list[int]
    batches: list[int]
    rec: Recorder
    weights: int  # bytes of the weights a step reads (all but the embedding)
    hbm_bw: float
    total_gpu: int

    @property
    def cfg(self):
        return self.model.config

    @property
    def methods(self) -> list[str]:
        return self.args.methods.split(",")


def gpu_gib_by_device(report) -> str:
    """A cache's device GiB on each device its layers use (several in a model split over GPUs)."""
    return " / ".join(f"{d.device} {d.gpu_bytes / GiB:.2f}" for d in report.per_device.values())


def mode_config(config, mode: str):
    """The run's ShadowKV config in `mode`: YAKV mode takes no rank (its keys are quantised, not factorised) and its own
    budget, so the paper's `rank` and `sparse_budget` of the ShadowKV runs are reset for it."""
    if mode == "yakv":
        return dataclasses.replace(config, mode="yakv", rank="auto", sparse_budget=None)
    return dataclasses.replace(config, mode=mode)


def prefill_runs(run: Run) -> None:
    """1. A real prefill at batch 1 per context and method, and a decode of the compressed caches (their step
    latency, GPU bytes per sequence after 256 generated tokens, and hit rate of random weights)."""
    model, cfg, config, device, args = run.model, run.cfg, run.config, run.device, run.args
    for length in run.contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, length), device=device)
        times = {}
        if device.type == "cuda":  # a server pins its value pool once; prefills then reuse its blocks
            pinned_blocks(cfg.num_hidden_layers, layer_sizes(model, config, length).host_bytes_per_row)
        for method in ("dynamic", "shadowkv", "yakv") if "yakv" in args.methods else ("dynamic", "shadowkv"):
            if method == "dynamic":
                cache = DynamicCache(config=cfg)
            else:
                cache = ShadowKVCache(model, config=mode_config(config, method))
            free(device)
            reset_peak(device)
            times[method] = prefill_seconds(model, cache, ids, device)
            log(f"prefill {length} {method}: {times[method]:.2f} s")
            row = dict(context=length, method=method, fill="real prefill", batch=1, prefill_s=times[method])
            if method != "dynamic":
                row["compress_share"] = (times[method] - times["dynamic"]) / times[method]
                steps = GENERATED_FOR_MEMORY if not args.small else 8
                step = decode(model, cache, 1, 0, steps, device)
                report = cache.memory_report()
                row.update(step_ms=step * 1e3, tok_s=1 / step, hit_rate=report.hit_rate, note=f"{steps} steps, own selection",  # noqa: E501
                           gpu_bytes_per_seq_gib=report.gpu_bytes / GiB, gpu_gib_by_device=gpu_gib_by_device(report),
                           full_kv_per_seq_gib=(length + steps) * kv_bytes_per_token(cfg) / GiB)  # fmt: skip
            if device.type == "cuda":
                row.update(peaks(device))
            run.rec.add(row)
            del cache
            free(device)
    if device.type == "cuda":
        release_pinned()


def full_attention_sweeps(run: Run) -> None:
    """2. DynamicCache over the batch sweep (until the GPU is full) and StaticCache at one point, synthetic fill;
    then the full-attention roofline at Dynamic's best batch and at the largest batch that fits."""
    model, cfg, args = run.model, run.cfg, run.args
    kv = kv_bytes_per_token(cfg)
    best = {}
    for method in [m for m in ("dynamic", "static") if m in run.methods and not (m == "static" and args.no_static)]:
        for length in run.contexts:
            if method == "static" and length != run.contexts[0]:
                continue  # uncompiled StaticCache decodes ~10x slower than DynamicCache: one point shows it
            held = length + args.warm + args.steps + 1
            fits = int((run.total_gpu / 1.02 - run.weights) // (held * kv))
            sweep = sorted({b for b in run.batches if b <= fits} | ({fits} if 0 < fits < run.batches[-1] else set()))
            for batch in sweep if method == "dynamic" else [1]:
                need = run.weights + batch * held * kv * 1.02
                if need > run.total_gpu:
                    log(f"{method} {length} batch {batch}: needs {need / GiB:.0f} GiB > GPU, stop")
                    break

                def build(method=method, batch=batch, length=length):
                    if method == "dynamic":
                        return fill_dynamic(model, batch, length)
                    return fill_static(model, batch, length, args.warm + args.steps + 1)

                try:
                    timed = measure_decode(run, build, batch, f"{method} {length} batch {batch}")
                except Exception as err:  # StaticCache "if it runs"
                    log(f"{method} {length} batch {batch}: failed: {err!r}")
                    run.rec.add(dict(context=length, method=method, batch=batch, note=f"failed: {type(err).__name__}"))
                    break
                if timed is None:
                    break
                step, _, gpu = timed
                row = dict(context=length, method=method, fill="synthetic", batch=batch, tok_s=batch / step,
                           step_ms=step * 1e3, **gpu, gpu_bytes_per_seq_gib=length * kv / GiB)  # fmt: skip
                run.rec.add(row)
                if method == "dynamic" and row["tok_s"] > best.get(length, {}).get("tok_s", 0):
                    best[length] = row
    for length, row in best.items():
        for b in sorted({row["batch"], int((run.total_gpu - run.weights) // (length * kv))}):
            if b < 1:
                continue
            t = full_attention_step(run.weights, b, length, cfg, run.hbm_bw)
            where = " (Dynamic's best batch)" if b == row["batch"] else " (largest batch that fits)"
            run.rec.add(dict(context=length, method="full-attention roofline", batch=b, tok_s=b / t, step_ms=t * 1e3,
                             note="HBM bytes / measured copy bandwidth" + where))  # fmt: skip


def host_blocks(run: Run) -> list[torch.Tensor] | None:
    """On CUDA, one flat pinned block per layer of `--host-gib` in all, pinned once and reused by every synthetic
    cache of the run (pinning is slow); None elsewhere."""
    if run.device.type != "cuda" or not ({"shadowkv", "yakv"} & set(run.methods)):
        return None
    t = time.perf_counter()
    layers = run.cfg.num_hidden_layers
    blocks = pinned_blocks(layers, int(run.args.host_gib * GiB // layers))
    log(f"pinned pool: {pinned_bytes() / GiB:.1f} GiB pinned ({time.perf_counter() - t:.1f} s)")
    return blocks


def measure_decode(run: Run, build, batch: int, what: str) -> tuple[float, float | None, dict] | None:
    """`(seconds per decode step, hit rate, peak GPU memory)` of the cache `build()` makes after the previous one's
    memory is freed, or None (logged) when it does not fit the GPU. Other errors propagate. The cache never leaves
    this function, and its memory is freed before it returns: a cache handed back to the caller stayed alive in the
    returned tuple while the next batch's was built, and that batch ran out of memory that it had."""
    cache = None
    try:
        free(run.device)
        reset_peak(run.device)
        cache = build()
        built = allocated_gib(run.device)
        step = decode(run.model, cache, batch, run.args.warm, run.args.steps, run.device)
        memory = residency(cache, built, allocated_gib(run.device))
        return step, hit_rate(cache), {**peaks(run.device), **memory}
    except torch.OutOfMemoryError:
        log(f"{what}: out of GPU memory")
        return None
    finally:
        del cache
        free(run.device)


def _host_sweep(run: Run, row_host: int, align: int) -> tuple[list[int], int]:
    """The batches of the sweep whose host bytes fit one layer's block (`row_host` per row, `align` bytes of slack),
    with the largest that fits added, and that largest."""
    max_rows = max(1, int((run.args.host_gib * GiB // run.cfg.num_hidden_layers - align) // row_host))
    sweep = [b for b in run.batches if b <= max_rows]
    if max_rows not in sweep and max_rows < run.batches[-1]:
        sweep.append(max_rows)
    return sweep, max_rows


def variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The ShadowKV sweep's (value format, landmark format) pairs, value formats outermost."""
    return [(v, m) for v in args.value_formats.split(",") for m in args.landmark_formats.split(",")]


def shadowkv_sweeps(run: Run, blocks: list[torch.Tensor] | None) -> None:
    """3. Per context and value format: ShadowKV over the batch sweep at the controlled hit rate `--h-sweep`, up to
    the host budget (quantised values fit more rows), then `--extra-h` hit rates at the best batch."""
    model, cfg, device, args = run.model, run.cfg, run.device, run.args
    for length in run.contexts if "shadowkv" in run.methods else []:
        for value_format, landmark_format in variants(args):
            label = variant_label(value_format, landmark_format)
            fmt_config = dataclasses.replace(run.config, value_format=value_format)
            row_host = layer_sizes(model, fmt_config, length, dtype=torch.bfloat16).host_bytes_per_row
            sweep, max_rows = _host_sweep(run, row_host, 256)  # 256 bytes between payload and scales
            log(f"shadowkv {length} {label}: host values {row_host * cfg.num_hidden_layers / GiB:.2f} GiB "
                f"per row, up to {max_rows} rows")  # fmt: skip
            best_row = None
            plan = [(b, args.h_sweep) for b in sweep]
            i = 0
            while i < len(plan):
                batch, h = plan[i]
                i += 1

                def build(batch=batch, h=h, length=length, fmt_config=fmt_config, landmark_format=landmark_format):
                    policy = LandmarkTopK(landmark_format)  # h None: the model's own selection, else wrapped
                    return synthetic_cache(model, batch, length, fmt_config, policy, hit_rate=h, host_blocks=blocks)

                timed = measure_decode(run, build, batch, f"shadowkv {length} {label} batch {batch}")
                if timed is None:
                    if i <= len(sweep):  # larger batches would not fit either: on to the other hit rates
                        sweep, plan = sweep[: i - 1], plan[: i - 1]
                        if best_row is not None:
                            plan += [(best_row["batch"], x) for x in args.extra_h if x != args.h_sweep]
                        i = len(sweep)
                    continue
                step, hr, gpu = timed
                bound, hbm, pcie = shadowkv_bound(model, fmt_config, length, batch, hr or 0.0, run.weights, run.hbm_bw,
                                                  landmark_format)  # fmt: skip
                row = dict(context=length, method="shadowkv", value_format=value_format,
                           landmark_format=landmark_format, fill="synthetic",
                           batch=batch, h_target="own" if h is None else h, hit_rate=hr, tok_s=batch / step,
                           step_ms=step * 1e3, **gpu,
                           host_gib=batch * row_host * cfg.num_hidden_layers / GiB, bound_ms=bound * 1e3,
                           hbm_gb_per_step=hbm / 1e9, pcie_gb_per_step=pcie / 1e9)  # fmt: skip
                run.rec.add(row)
                if h == args.h_sweep and (best_row is None or row["tok_s"] > best_row["tok_s"]):
                    best_row = row
                if i == len(sweep) and best_row is not None:  # sweep done: other hit rates at the best batch
                    plan += [(best_row["batch"], x) for x in args.extra_h if x != args.h_sweep]
            free(device)


def yakv_sweeps(run: Run, blocks: list[torch.Tensor] | None) -> None:
    """4. Per context and device share (`--yakv-device-shares`): YAKV mode over the batch sweep up to the host budget
    (and what GPU memory holds), at the controlled hit rate `--yakv-h`. Every step scores every token from the device
    codes, selects the top k tokens and fetches the 4-bit key and value records of those not held from the previous
    step: from the device mirror for the first `share` of each row's tokens, over PCIe for the others."""
    model, cfg, args = run.model, run.cfg, run.args
    for share in [float(s) for s in args.yakv_device_shares.split(",")]:
        # YAKV keeps no low-rank keys and its own default budget (the same PCIe bytes as ShadowKV's at bf16)
        yakv_config = dataclasses.replace(mode_config(run.config, "yakv"), device_record_share=share)
        label = yakv_label(share)
        for length in run.contexts if "yakv" in run.methods else []:
            row_host = layer_sizes(model, yakv_config, length).host_bytes_per_row
            sweep, max_rows = _host_sweep(run, row_host, 0)
            log(f"yakv {length} ({label}): host records {row_host * cfg.num_hidden_layers / GiB:.2f} GiB per row, "
                f"up to {max_rows} rows")  # fmt: skip
            for batch in sweep:

                def build(batch=batch, length=length, yakv_config=yakv_config):
                    return synthetic_cache(model, batch, length, yakv_config, hit_rate=args.yakv_h, host_blocks=blocks)

                timed = measure_decode(run, build, batch, f"yakv {length} ({label}) batch {batch}")
                if timed is None:
                    break
                step, hr, gpu = timed
                bound, hbm, pcie = yakv_bound(model, yakv_config, length, batch, hr or 0.0, run.weights, run.hbm_bw)
                run.rec.add(dict(context=length, method="yakv", value_format=label, fill="synthetic", batch=batch,
                                 h_target=args.yakv_h, hit_rate=hr, tok_s=batch / step, step_ms=step * 1e3,
                                 **gpu, host_gib=batch * row_host * cfg.num_hidden_layers / GiB,
                                 bound_ms=bound * 1e3, hbm_gb_per_step=hbm / 1e9,
                                 pcie_gb_per_step=pcie / 1e9))  # fmt: skip


def yakv_label(share: float) -> str:
    """The value-format column of a YAKV row: its records, and the share mirrored on the GPU if any."""
    return "higgs4 k+v" if not share else f"higgs4 k+v, {share:g} on GPU"


def generate_runs(run: Run, blocks: list[torch.Tensor] | None) -> None:
    """5. Per context, at batch `--generate-batch`: seconds per step through an unchanged `model.generate` next to raw
    forwards on a like cache, for DynamicCache (if it fits) and ShadowKV at `--h-sweep` (the first value format).
    A generate step adds what a user pays on top of the forward: logits processing, stopping criteria, the
    attention mask and cache-position bookkeeping, and the host synchronisation of the stopping check. Each timing
    takes a fresh cache; a generate step is the mean time between the tokens of the last `steps` steps of one
    `generate` call (a streamer notes when each step's tokens are out; `generate` waits for each step's tokens for
    its stopping check, so these are the steps' wall times), after `warm` steps that include any capture."""
    model, cfg, device, args = run.model, run.cfg, run.device, run.args
    batch = args.generate_batch
    value_format, landmark_format = variants(args)[0]
    fmt_config = dataclasses.replace(run.config, value_format=value_format)
    kv = kv_bytes_per_token(cfg)
    for length in run.contexts if args.generate_batch else []:
        for method in ("dynamic", "shadowkv"):
            if method == "dynamic" and run.weights + batch * (length + args.warm + args.steps + 1) * kv > run.total_gpu:
                log(f"generate {length} dynamic batch {batch}: does not fit")
                continue

            def fresh_cache(method=method, length=length):
                free(device)
                if method == "dynamic":
                    return fill_dynamic(model, batch, length)
                return synthetic_cache(model, batch, length, fmt_config, LandmarkTopK(landmark_format),
                                       hit_rate=args.h_sweep, host_blocks=blocks)  # fmt: skip

            # Forward and generate timings alternate, so that a drift of the machine falls on both; the host work
            # generate adds is ~1 ms a step and moved by half of that between runs, so one pair of timings says little.
            forwards, steps = [], []
            try:
                for _ in range(args.generate_repeats):
                    forwards.append(decode(model, fresh_cache(), batch, args.warm, args.steps, device))
                    steps.append(_generate_step_seconds(model, fresh_cache(), batch, length, args.warm, args.steps,
                                                        device))  # fmt: skip
            except torch.OutOfMemoryError:
                log(f"generate {length} {method} batch {batch}: out of GPU memory")
                free(device)
                continue
            step = statistics.median(steps)
            shadowkv = method == "shadowkv"
            run.rec.add(dict(context=length, method=method, value_format=value_format if shadowkv else None,
                             landmark_format=landmark_format if shadowkv else None, fill="synthetic, generate",
                             batch=batch, h_target=args.h_sweep if method == "shadowkv" else None, tok_s=batch / step,
                             step_ms=step * 1e3, note=generate_note(forwards, steps, batch)))  # fmt: skip
            free(device)


def generate_note(forwards: list[float], steps: list[float], batch: int) -> str:
    """The note of a generate row: the raw forwards' median step, and generate/forward as the median of the ratios of
    the timings made in turn, with each ratio when there are several."""
    forward = statistics.median(forwards)
    ratios = sorted(s / f for s, f in zip(steps, forwards))
    note = (f"raw forwards {forward * 1e3:.2f} ms/step ({batch / forward:.1f} tok/s): "
            f"generate/forward = {statistics.median(ratios):.3f}")  # fmt: skip
    if len(ratios) > 1:
        note += f" (median of {len(ratios)} in turn: {', '.join(f'{r:.3f}' for r in ratios)})"
    return note


def _generate_step_seconds(model, cache, batch: int, length: int, warm: int, steps: int, device) -> float:
    """Mean seconds per step of the last `steps` of `warm + steps` greedy `generate` steps after a cache that holds
    `length` tokens (the first `put` is the prompt, then one per step)."""
    times = generate_times(model, cache, batch, length, warm + steps, device)
    return (times[-1] - times[-1 - steps]) / steps
