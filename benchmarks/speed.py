"""What the speed benchmarks share (`throughput`, `profile_decode`, `prefix_reuse`): random-weight models of a real
shape, synchronisation, memory figures and decode timing.

Legend: B batch. Speed does not depend on weight values, so the models are built from a config with random weights,
in place on the device (no 16 GB copy through host memory).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.model_shapes import LLAMA_3_1_8B, TINY
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.ops import attend_parts, gather_dequant, gather_values, landmark_logits, rebuild_missed
from shadowkv_cache.placement import attention_devices
from shadowkv_cache.testing import reset_hit_counts

GiB = 2**30


# Random weights give keys a flat spectrum, so rank="auto" would keep its ceiling (3/4 of Hkv*D): the speed benchmarks
# use the paper's Llama-3.1-8B settings instead, as shares that scale to the --small model: rank 160 of 1024 and a
# budget of 1.5625% of the prompt (2048 tokens at 128K).
PAPER_SETTINGS = {"rank": 0.15625, "sparse_budget": 0.015625}


def add_kernel_grid_options(p: argparse.ArgumentParser) -> None:
    """The kernel launch settings `throughput.py` and `profile_decode.py` compare (`apply_kernel_grid_options`)."""
    p.add_argument("--fetch-blocks-per-sm", type=float, default=None,
                   help="the value fetch's grid (FETCH_BLOCKS_PER_SM in ops/gather_values.py), to compare")  # fmt: skip
    p.add_argument("--attend-min-blocks", type=int, default=None,
                   help="blocks per SM the attention kernel must fit (MIN_BLOCKS in ops/attend_parts.py)")  # fmt: skip
    p.add_argument("--native-landmark-rows", type=int, default=None,
                   help="batch x KV heads up to which bf16 landmark logits take the kernel rather than cuBLAS "
                        "(NATIVE_KERNEL_MAX_ROWS in ops/landmark_logits.py; 0: cuBLAS always)")  # fmt: skip
    p.add_argument("--gather-records", type=int, default=None,
                   help="YAKV's record fetch: slots per warp whose loads are issued together (RECORDS_PER_WARP in "
                        "ops/gather_dequant.py)")  # fmt: skip
    p.add_argument("--rebuild-grid", choices=("capped", "full"), default=None,
                   help="the key rebuild's grid: capped at the blocks resident at once (the default) or one block per "
                        "(row, head) (CAP_GRID in ops/rebuild_missed.py)")  # fmt: skip


def apply_kernel_grid_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set what `add_kernel_grid_options` parsed, or exit with the parser's error for a value out of range."""
    if args.fetch_blocks_per_sm is not None:
        if args.fetch_blocks_per_sm <= 0:
            p.error(f"--fetch-blocks-per-sm must be positive, got {args.fetch_blocks_per_sm}")
        gather_values.FETCH_BLOCKS_PER_SM = args.fetch_blocks_per_sm
    if args.attend_min_blocks is not None:
        if not 0 <= args.attend_min_blocks <= 16:
            p.error(f"--attend-min-blocks must be in [0, 16] (0: the compiler's choice), got {args.attend_min_blocks}")
        attend_parts.MIN_BLOCKS = args.attend_min_blocks
    if args.native_landmark_rows is not None:
        if args.native_landmark_rows < 0:
            p.error(f"--native-landmark-rows must be >= 0, got {args.native_landmark_rows}")
        landmark_logits.NATIVE_KERNEL_MAX_ROWS = args.native_landmark_rows
    if args.rebuild_grid is not None:
        rebuild_missed.CAP_GRID = args.rebuild_grid == "capped"
    if args.gather_records is not None:
        if not 1 <= args.gather_records <= 16:
            p.error(f"--gather-records must be in [1, 16], got {args.gather_records}")
        gather_dequant.RECORDS_PER_WARP = args.gather_records


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def gpus(device: torch.device) -> list[torch.device]:
    """The GPUs a run on `device` uses: every visible one for `cuda` without an index (a model split over them with
    `--split`; the others idle otherwise), the one named, or none off CUDA."""
    if device.type != "cuda":
        return []
    if device.index is None:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [device]


def sync(device: torch.device) -> None:
    for gpu in gpus(device):
        torch.cuda.synchronize(gpu)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # every GPU's cached blocks


def graph_us(fn, device: torch.device, reps: int = 20) -> float:
    """Mean µs per call of `fn()` replayed `reps` times in one CUDA graph (after a warm-up call outside it): kernels
    timed as the decode step runs them, without launch overhead."""
    fn()
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    sync(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    sync(device)
    return start.elapsed_time(end) * 1e3 / reps


def reset_peak(device: torch.device) -> None:
    for gpu in gpus(device):
        torch.cuda.reset_peak_memory_stats(gpu)


def peak_gpu_gib(device: torch.device) -> float | None:
    """Peak GPU memory allocated since the last `reset_peak`, GiB, on the fullest GPU (None off CUDA)."""
    peaks = peak_gpu_gib_by_device(device)
    return max(peaks.values()) if peaks else None


def peak_gpu_gib_by_device(device: torch.device) -> dict[str, float]:
    """`{gpu: peak GiB}` since the last `reset_peak`, for each GPU of the run."""
    return {str(gpu): torch.cuda.max_memory_allocated(gpu) / GiB for gpu in gpus(device)}


def peaks(device: torch.device) -> dict:
    """A row's peak memory fields: `peak_gpu_gib` (the fullest GPU) and, with several GPUs, `peak_by_device`."""
    by_device = peak_gpu_gib_by_device(device)
    row = {"peak_gpu_gib": max(by_device.values()) if by_device else None}
    if len(by_device) > 1:
        row["peak_by_device"] = " / ".join(f"{gpu} {gib:.1f}" for gpu, gib in by_device.items())
    return row


def allocated_gib(device: torch.device) -> float | None:
    """GPU memory allocated now, GiB, on the fullest GPU (None off CUDA)."""
    now = [torch.cuda.memory_allocated(gpu) / GiB for gpu in gpus(device)]
    return max(now) if now else None


def residency(cache, built_gib: float | None, held_gib: float | None) -> dict:
    """Where a decode row's peak GPU memory lies, GiB on the fullest GPU (`allocated_gib` readings; empty off CUDA):
    `built_gpu_gib` allocated once the cache was built (the weights, the cache, what building it left),
    `held_gpu_gib` after the timed steps with the cache alive (plus CUDA-graph pools and the step's lasting buffers),
    and for a `ShadowKVCache` `cache_gpu_gib`, the GPU bytes its `memory_report` counts on all GPUs. The peak less
    `held_gpu_gib` is what a step allocates for a while; `built_gpu_gib` less the weights and `cache_gpu_gib` is what
    the report does not count."""
    if built_gib is None:
        return {}
    row = {"built_gpu_gib": built_gib, "held_gpu_gib": held_gib}
    if isinstance(cache, ShadowKVCache):
        row["cache_gpu_gib"] = cache.memory_report().gpu_bytes / GiB
    return row


def layer_devices(model) -> list[torch.device]:
    """The device each decoder layer's keys and values arrive on (one per layer; several in a split model)."""
    devices = attention_devices(model)
    return [devices[i] for i in range(len(devices))]


def split_map(num_layers: int, count: int) -> dict[str, int]:
    """A device map that spreads the decoder layers evenly over GPUs `0..count-1` as `device_map="auto"` would (the
    embeddings and the rotary module on the first, the final norm and the head on the last)."""
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": count - 1, "lm_head": count - 1}
    device_map.update({f"model.layers.{i}": i * count // num_layers for i in range(num_layers)})
    return device_map


def host_rss() -> int:
    """Resident host memory of this process, bytes (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_model(small: bool, device: torch.device, split: bool = False):
    """Llama-3.1-8B shape (`TINY` if `small`), random weights made on `device`: bf16 on CUDA, fp32 elsewhere.

    `split`: made on the first GPU, then dispatched by accelerate over every visible GPU (`split_map`), as
    `device_map="auto"` places a model that outgrows one GPU."""
    config = AutoConfig.for_model("llama", **(TINY if small else LLAMA_3_1_8B), tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(torch.device("cuda", 0) if split else device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if split:
        from accelerate import dispatch_model

        model = dispatch_model(model, split_map(config.num_hidden_layers, torch.cuda.device_count()))
    return model.eval()


def hbm_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write of 2 GiB, 10 times; NaN off CUDA)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    bw = 2 * a.numel() * 10 / (time.perf_counter() - t)
    del a, b
    return bw


def decode(model, cache, batch: int, warm: int, steps: int, device: torch.device, reset_counts: bool = True) -> float:
    """Seconds per step over `steps` timed forwards after `warm` ones (greedy next token, no sampling); a
    `ShadowKVCache`'s hit counters restart with the timed steps unless `reset_counts` is False (a profiled window
    then holds the steps alone, not the counters' eager fills)."""
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    with torch.no_grad():
        for i in range(warm + steps):
            if i == warm:
                if reset_counts and isinstance(cache, ShadowKVCache):
                    reset_hit_counts(cache)
                sync(device)
                t = time.perf_counter()
            logits = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tokens = logits[:, -1:].argmax(dim=-1)
        sync(device)
    return (time.perf_counter() - t) / steps


def prefill_seconds(model, cache, ids: torch.Tensor, device: torch.device) -> float:
    """Seconds of one prefill of `ids` into `cache`, from an idle device to an idle device."""
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t


def generate_times(model, cache, batch: int, length: int, new_tokens: int, device: torch.device, on_put=None):
    """Host times at which `generate`'s outputs come out (index 0: the prompt, then one per step) over `new_tokens`
    greedy steps of an unchanged `model.generate` on `cache`, which holds `length` tokens per row (random ids,
    `length + 1` of them: `generate` feeds the last one). `on_put` (*optional*) is called after each time is noted."""
    ids = torch.randint(0, model.config.vocab_size, (batch, length + 1), device=device)

    class Clock:  # a streamer: `generate` puts each step's tokens once they are on the host
        def __init__(self):
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())
            if on_put is not None:
                on_put()

        def end(self) -> None:
            pass

    clock = Clock()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       streamer=clock)  # fmt: skip
    sync(device)
    return clock.times


def hit_rate(cache) -> float | None:
    """The hit rate of a `ShadowKVCache` (ShadowKV's temporal cache, YAKV's held tokens); None for other caches."""
    return cache.memory_report().hit_rate if isinstance(cache, ShadowKVCache) else None
