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
   pinned host memory) up to the host budget. YAKV keeps no temporal cache: every step fetches every selected
   token's record, so there is no hit rate to set.
Decode tokens/s = B x timed steps / wall time of `model(...)` forwards (no sampling), synchronised at both
ends. Roofline of full attention = HBM bandwidth (measured) / (weights + B x full KV bytes) per step.

    python -m benchmarks.throughput --device cuda        # the H200 run (about 8 minutes)
    python -m benchmarks.throughput --small              # a tiny CPU run that checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache

from benchmarks.model_shapes import LLAMA_3_1_8B, TINY
from benchmarks.results_io import add_results_dir_option, environment, results_dir, write_results
from shadowkv_cache import LandmarkTopK, ShadowKVCache, ShadowKVConfig
from shadowkv_cache.shadowkv.prompt import CompressedPrompt
from shadowkv_cache.stores.pinned_pool import pinned_pool
from shadowkv_cache.stores.quantized_store import QuantizedKVStore, record_bytes
from shadowkv_cache.stores.value_codecs import value_codec
from shadowkv_cache.stores.value_store import HostValueStore
from shadowkv_cache.yakv.prompt import QuantizedPrompt

warnings.filterwarnings("ignore", category=FutureWarning)

PCIE_ZERO_COPY = 50e9  # bytes/s of the zero-copy gather of 2 KiB chunks measured on the H200 (47-51 GB/s)
GENERATED_FOR_MEMORY = 256


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_model(small: bool, device: torch.device):
    config = AutoConfig.for_model("llama", **(TINY if small else LLAMA_3_1_8B), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        )
    return model.eval()


def hbm_bandwidth(device) -> float:
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


class ControlledHitRate(LandmarkTopK):
    """Benchmark-only: scores chunks like LandmarkTopK (same cost), then returns a selection that keeps
    exactly a share `hit_rate` of the previous step's chunks: a window of `k` entries of a fixed random
    permutation of the chunks, sliding by `(1 - h) * k` each step. The step counter lives on the device, so
    the selection also slides when the decode step is replayed as a CUDA graph."""

    def __init__(self, hit_rate: float):
        self.hit_rate, self.steps, self.perms = hit_rate, {}, {}

    def select(self, query, state, selectable, k, scaling, query_mask=None):
        super().select(query, state, selectable, k, scaling, query_mask)  # the real work, result unused
        key = id(state["landmarks"])
        batch, heads, chunks = selectable.shape
        if key not in self.perms:
            self.perms[key] = torch.rand(batch, heads, chunks, device=selectable.device).argsort(dim=-1)
            self.steps[key] = torch.zeros((), dtype=torch.int64, device=selectable.device)
        step = self.steps[key]
        shift = max(1, round((1 - self.hit_rate) * k)) if self.hit_rate < 1 else 0
        window = (step * shift + torch.arange(k, device=selectable.device)) % chunks
        step += 1
        return self.perms[key].gather(-1, window.expand(batch, heads, k))


def kv_bytes_per_token(cfg) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16


def fill_dynamic(model, batch, length, device):
    cfg = model.config
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, device=device, dtype=model.dtype),
                     torch.randn(shape, device=device, dtype=model.dtype), i)  # fmt: skip
    return cache


def fill_static(model, batch, length, device, extra):
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=length + extra)
    shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
    pos = torch.arange(length, device=device)
    for i in range(cfg.num_hidden_layers):
        k = torch.randn(shape, device=device, dtype=model.dtype)
        cache.update(k, torch.randn_like(k), i, {"cache_position": pos})
    return cache


def host_value_bytes_per_row(cfg, config, length) -> int:
    """Host bytes of one row's values in one layer, in `config.value_format` (scales included)."""
    size = config.resolve(length, cfg.num_key_value_heads * cfg.head_dim)
    bits = value_codec(config.value_format, cfg.head_dim).bits_per_value(torch.bfloat16)
    return math.ceil(size.num_chunks * config.chunk_size * cfg.num_key_value_heads * cfg.head_dim * bits / 8)


def synthetic_store(codec, rows, stored, shape, device, dtype, block: torch.Tensor | None) -> HostValueStore:
    """A pinned store of `stored` rows `[stored, Hkv, C, c, D]` in `codec`'s format, read by `rows` cache rows
    (`rows > stored`: every row reads stored row 0), carved from the flat pinned `block` if given. One row is
    encoded from random values and copied to the others (the content does not change the speed)."""
    _, hkv, n, c, d = shape
    payload_dtype = codec.payload_dtype or dtype
    payload_shape, scale_shape = (stored, hkv, n, c, codec.payload_dim), (stored, hkv, n, c)
    payload_bytes = math.prod(payload_shape) * payload_dtype.itemsize
    if block is not None:
        payload = block[:payload_bytes].view(payload_dtype).view(payload_shape)
    else:
        payload = pinned_pool().allocate(payload_shape, payload_dtype)
    scales = None
    if codec.scale_dtype is not None:
        offset = -(-payload_bytes // 256) * 256
        scale_bytes = math.prod(scale_shape) * codec.scale_dtype.itemsize
        if block is not None:
            scales = block[offset : offset + scale_bytes].view(codec.scale_dtype).view(scale_shape)
        else:
            scales = pinned_pool().allocate(scale_shape, codec.scale_dtype)
    codes, row_scales = codec.encode(torch.randn(1, hkv, n, c, d, device=device, dtype=dtype))
    for r in range(stored):
        payload[r].copy_(codes[0])
        if scales is not None:
            scales[r].copy_(row_scales[0])
    row_map = torch.zeros(rows, dtype=torch.int64) if stored < rows else torch.arange(rows)
    store = HostValueStore(payload, row_map, scales, codec)
    store.device_row_map(device)  # copied now, not in a timed step
    codec.prepare(device)
    return store


def fill_shadowkv(
    model, cache: ShadowKVCache, batch, length, device, host_blocks: list[torch.Tensor] | None, share_host_row=False
):
    """Synthetic compressed prompts for every layer; host values are carved from `host_blocks[layer]` (flat pinned
    bytes) if given, in the cache's value format.

    `share_host_row` (profiling only): every row reads one pinned row of values, so a large batch needs no
    large pinned allocation; each row still fetches its own misses over PCIe."""
    cfg, config = model.config, cache.config
    hkv, d, dtype = cfg.num_key_value_heads, cfg.head_dim, model.dtype
    size = config.resolve(length, hkv * d)
    c, n, o, w, k = config.chunk_size, size.num_chunks, size.outliers, size.local, size.budget_chunks
    codec = value_codec(config.value_format, d)
    for i, layer in enumerate(cache.layers):
        selectable = torch.ones(batch, hkv, n, dtype=torch.bool, device=device)
        selectable[..., :o] = False
        stored = 1 if share_host_row else batch
        if device.type == "cuda":
            block = host_blocks[i] if host_blocks is not None else None
            store = synthetic_store(codec, batch, stored, (stored, hkv, n, c, d), device, dtype, block)
        else:
            store = HostValueStore.offload(
                torch.randn(batch, hkv, n, c, d, dtype=dtype), pin=False, value_format=config.value_format
            )
        prompt = CompressedPrompt(
            a=torch.randn(batch, n * c, size.rank, device=device, dtype=dtype),
            b=torch.randn(batch, size.rank, hkv, d, device=device, dtype=dtype) / size.rank**0.5,
            positions=torch.arange(n * c, device=device).expand(batch, -1).contiguous(),
            policy_state={"landmarks": torch.randn(batch, hkv, n, d, device=device, dtype=dtype)},
            selectable=selectable,
            budget_chunks=torch.full((batch,), k, dtype=torch.int64, device=device),
            outlier_keys=torch.randn(batch, hkv, o * c, d, device=device, dtype=dtype),
            outlier_values=torch.randn(batch, hkv, o * c, d, device=device, dtype=dtype),
            outlier_valid=torch.ones(batch, o * c, dtype=torch.bool, device=device),
            local_keys=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
            local_values=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
            local_valid=torch.ones(batch, w, dtype=torch.bool, device=device),
            values=store,
            chunk_size=c,
            slots=length,
            max_budget_chunks=k,
        )
        empty = torch.empty(batch, hkv, 0, d, device=device, dtype=dtype)
        layer.set_prefix(prompt, empty, empty)
    return cache


def yakv_host_bytes_per_row(cfg, config, length) -> int:
    """Host bytes of one row's quantised keys and values in one layer (YAKV mode)."""
    size = config.resolve(length, cfg.num_key_value_heads * cfg.head_dim)
    return size.num_chunks * cfg.num_key_value_heads * record_bytes(cfg.head_dim // config.host_grid_dim)


def fill_yakv(model, cache: ShadowKVCache, batch, length, device, host_blocks: list[torch.Tensor] | None):
    """Synthetic YAKV prompts for every layer: random ~2-bit scoring codes on the device and random ~4-bit
    records in pinned host memory (carved from `host_blocks[layer]` if given), one per row. Codes are uniform
    random grid indices and norms ~sqrt(D), so dequantised keys and values are well-formed vectors; their
    content does not change the work of a step (every step scores every token and fetches the top k)."""
    cfg, config = model.config, cache.config
    hkv, d, dtype = cfg.num_key_value_heads, cfg.head_dim, model.dtype
    size = config.resolve(length, hkv * d)
    n, k, w = size.num_chunks, size.budget_chunks, size.local
    e, m = record_bytes(d // config.host_grid_dim), d // config.score_grid_dim
    norm = torch.tensor([d**0.5], dtype=torch.float16).view(torch.uint8)  # its two bytes
    one_row = torch.randint(0, 256, (hkv, n, e), dtype=torch.uint8)
    one_row[..., 0:2], one_row[..., 2:4] = norm, norm  # key and value norms: a finite fp16, not random bits
    for i, layer in enumerate(cache.layers):
        shape = (batch, hkv, n, e)
        if host_blocks is not None:
            data = host_blocks[i][: math.prod(shape)].view(shape)
        else:
            data = torch.empty(shape, dtype=torch.uint8)
        data.copy_(one_row.expand(shape))
        store = QuantizedKVStore(data, torch.arange(batch))
        store.device_row_map(device)  # copied now, not in a timed step
        prompt = QuantizedPrompt(
            policy_state={
                "codes": torch.randint(0, 256, (batch, hkv, n, m), dtype=torch.uint8, device=device),
                "norms": torch.full((batch, hkv, n), d**0.5, dtype=torch.float16, device=device),
            },
            real=torch.ones(batch, n, dtype=torch.bool, device=device),
            budget_tokens=torch.full((batch,), k, dtype=torch.int64, device=device),
            budget_host=torch.full((batch,), k, dtype=torch.int64),
            local_keys=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
            local_values=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
            local_valid=torch.ones(batch, w, dtype=torch.bool, device=device),
            store=store,
            slots=length,
            max_budget_tokens=k,
        )
        empty = torch.empty(batch, hkv, 0, d, device=device, dtype=dtype)
        layer.set_prefix(prompt, empty, empty)
    return cache


def yakv_bound(cfg, config, length, batch, weights, hbm_bw):
    """Seconds per step that bytes alone allow in YAKV mode: HBM (weights, scoring codes and norms, attended
    set) + PCIe (every selected token's record, each step: YAKV keeps no temporal cache)."""
    size = config.resolve(length, cfg.num_key_value_heads * cfg.head_dim)
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    scoring = size.num_chunks * hkv * (d // config.score_grid_dim + 2)
    attended = (size.budget_chunks + size.local + 64) * hkv * d * 2 * 2  # K and V, bf16
    hbm = weights + batch * cfg.num_hidden_layers * (scoring + 3 * attended)  # dequant write, cat write/read
    pcie = batch * cfg.num_hidden_layers * hkv * size.budget_chunks * record_bytes(d // config.host_grid_dim)
    return hbm / hbm_bw + pcie / PCIE_ZERO_COPY, hbm, pcie


def decode(model, cache, batch, warm, steps, device):
    """Seconds per step over `steps` timed forwards after `warm` ones (greedy next token, no sampling)."""
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    with torch.no_grad():
        for i in range(warm + steps):
            if i == warm:
                if isinstance(cache, ShadowKVCache):
                    for layer in cache.layers:
                        temporal = getattr(getattr(layer, "mode", None), "temporal", None)
                        if temporal is not None:  # YAKV keeps no temporal cache
                            temporal.hits.zero_()
                            temporal.lookups.zero_()
                sync(device)
                t = time.perf_counter()
            logits = model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tokens = logits[:, -1:].argmax(dim=-1)
        sync(device)
    return (time.perf_counter() - t) / steps


def hit_rate(cache) -> float | None:
    if not isinstance(cache, ShadowKVCache):
        return None
    return cache.memory_report().hit_rate


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Recorder:
    COLUMNS = ["context", "method", "value_format", "fill", "batch", "h_target", "hit_rate", "tok_s", "step_ms",
               "peak_gpu_gib", "host_gib", "gpu_bytes_per_seq_gib", "prefill_s", "compress_share", "bound_ms",
               "note"]  # fmt: skip

    def __init__(self, name, env):
        self.name, self.env, self.rows = name, env, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        log("RESULT", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
        self.write(plot=False)

    def write(self, plot=True) -> None:
        try:
            title = "Decode throughput: ShadowKV vs full attention (Llama-3.1-8B shape, random bf16)"
            write_results(self.name, title, self.env, self.rows, self.COLUMNS, None)
            if plot:
                self.plot(title)
        except Exception as err:  # never lose a run to a plotting problem
            log("could not write results:", err)

    def plot(self, title) -> None:
        """Best decode tokens/s per method and context (ShadowKV at each hit rate), log scale."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series: dict[str, dict[int, float]] = {}
        for r in self.rows:
            if (
                not isinstance(r.get("tok_s"), (int, float))
                or r["method"] == "summary"
                or r.get("fill") == "real prefill"
            ):
                continue
            label = r["method"] + (f" {r.get('value_format')} h={r['h_target']}" if r["method"] == "shadowkv" else "")
            best = series.setdefault(label, {})
            best[r["context"]] = max(best.get(r["context"], 0.0), r["tok_s"])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, pts in sorted(series.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s at best batch")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(results_dir() / f"{self.name}.png", dpi=120)
        plt.close(fig)


def shadowkv_bound(cfg, config, length, batch, h, weights, hbm_bw):
    """Seconds per step that bytes alone allow: HBM (weights, landmarks, attended set) + PCIe (missed values)."""
    size = config.resolve(length, cfg.num_key_value_heads * cfg.head_dim)
    per_head = cfg.num_key_value_heads * cfg.head_dim * 2
    attended = (size.outliers + size.budget_chunks) * config.chunk_size + size.local + 64
    per_layer = size.num_chunks * per_head + 3 * 2 * attended * per_head  # landmarks + cat write/read + attend
    hbm = weights + batch * cfg.num_hidden_layers * per_layer
    pcie = (
        batch
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * size.budget_chunks
        * (1 - h)
        * (config.chunk_size * per_head / cfg.num_key_value_heads)
    )
    pcie *= value_codec(config.value_format, cfg.head_dim).bits_per_value(torch.bfloat16) / 16
    return hbm / hbm_bw + pcie / PCIE_ZERO_COPY, hbm, pcie


def add_summary(rec: Recorder, contexts: list[int], value_formats: list[str], h_sweep: float) -> None:
    """Summary rows: each method's best tokens/s per context as ratios to this run's baselines (the best
    DynamicCache batch, the full-attention roofline, and for YAKV the best ShadowKV batch per value format)."""
    rec.rows = [r for r in rec.rows if r["method"] != "summary"]
    for length in contexts:
        dynamic = [
            r
            for r in rec.rows
            if r["context"] == length
            and r["method"] == "dynamic"
            and r.get("fill") == "synthetic"
            and isinstance(r.get("tok_s"), float)
        ]
        dyn = max(dynamic, key=lambda r: r["tok_s"], default=None)
        roof = [r for r in rec.rows if r["context"] == length and r["method"] == "full-attention roofline"]
        roof_best = max(roof, key=lambda r: r["tok_s"], default=None)  # its best batch: the largest that fits
        tops = {}
        for method, value_format in [("shadowkv", f) for f in value_formats] + [("yakv", None)]:
            rows = [
                r
                for r in rec.rows
                if r["context"] == length
                and r["method"] == method
                and r.get("fill") == "synthetic"
                and (method == "yakv" or (r.get("value_format") == value_format and r.get("h_target") == h_sweep))
            ]
            if not rows:
                continue
            top = tops[(method, value_format)] = max(rows, key=lambda r: r["tok_s"])
            notes = []
            if dyn:
                notes.append(f"x{top['tok_s'] / dyn['tok_s']:.2f} vs DynamicCache best")
                notes[-1] += f" ({dyn['tok_s']:.1f} tok/s at batch {dyn['batch']})"
            if roof_best:
                notes.append(f"x{top['tok_s'] / roof_best['tok_s']:.2f} vs roofline at its best batch")
                notes[-1] += f" ({roof_best['tok_s']:.1f})"
            if method == "yakv":
                notes += [f"x{top['tok_s'] / t['tok_s']:.2f} vs ShadowKV {f} best ({t['tok_s']:.1f})"
                          for (m, f), t in tops.items() if m == "shadowkv"]  # fmt: skip
            if notes:
                rec.add(dict(context=length, method="summary", value_format=top.get("value_format"),
                             batch=top["batch"], h_target=top.get("h_target"), tok_s=top["tok_s"],
                             note=f"{method}: " + "; ".join(notes)))  # fmt: skip


def replot(name: str, h_sweep: float, note: str | None) -> None:
    """Summary rows and plot of a stored run from its rows alone (a run cut short never wrote them)."""
    import json

    stored = json.loads((results_dir() / f"{name}.json").read_text())
    env = stored["env"]
    if note:
        env["note"] = note
    rec = Recorder(name, env)
    rec.rows = stored["rows"]
    contexts = sorted({r["context"] for r in rec.rows})
    formats = list(
        dict.fromkeys(r["value_format"] for r in rec.rows if r["method"] == "shadowkv" and "value_format" in r)
    )
    add_summary(rec, contexts, formats, h_sweep)
    rec.write(plot=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny model and contexts (checks the script on CPU)")
    p.add_argument("--contexts", default=None, help="comma-separated context lengths")
    p.add_argument("--batches", default="1,2,4,6,8,12,16,24,32,48,64")
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--h-sweep", type=float, default=0.6, help="hit rate of the ShadowKV batch sweep")
    p.add_argument("--host-gib", type=float, default=96.0, help="host memory the ShadowKV sweep may pin")
    p.add_argument("--value-formats", default="native,fp8", help="host value formats of the ShadowKV sweep")
    p.add_argument("--extra-h", default="0,0.8,own", help="hit rates rerun at the best batch ('own': the model's)")
    p.add_argument("--methods", default="dynamic,static,shadowkv", help="which sweeps to run (also: yakv)")
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--no-static", action="store_true")
    p.add_argument("--name", default=None)
    p.add_argument("--replot", metavar="NAME", help="recompute the summary and plot of results/NAME.json, no run")
    p.add_argument("--note", help="with --replot: a note stored in the record's environment")
    add_results_dir_option(p)
    args = p.parse_args()
    if args.replot:
        replot(args.replot, args.h_sweep, args.note)
        return
    args.extra_h = [None if x == "own" else float(x) for x in args.extra_h.split(",") if x]

    device = torch.device(args.device)
    contexts = [int(x) for x in (args.contexts or ("2048,4096" if args.small else "32768,65536,131072")).split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    if args.small:
        batches = [b for b in batches if b <= 4]
        args.warm, args.steps = min(args.warm, 2), min(args.steps, 4)
    config = ShadowKVConfig(min_compress_len=1024 if args.small else 4096)
    env = environment(str(device), "bfloat16" if device.type == "cuda" else "float32")
    env["fill"] = (
        "real prefill at batch 1 per context; synthetic random K/V (Dynamic) and random compressed prompts (ShadowKV) for batch sweeps"  # noqa: E501
    )
    name = args.name or ("throughput_small" if args.small else f"throughput_{device.type}")
    rec = Recorder(name, env)
    log("ENV", env)  # the log alone then holds the whole record

    log("building model", "tiny" if args.small else "Llama-3.1-8B shape", "on", device)
    model = build_model(args.small, device)
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    hbm_bw = hbm_bandwidth(device)
    env.update(hbm_copy_bandwidth_GBps=round(hbm_bw / 1e9, 1), weight_gib=round(weights / 2**30, 2),
               gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
               if device.type == "cuda" else None, shadowkv_config=str(config))  # fmt: skip
    log(f"weights {weights / 2**30:.1f} GiB, HBM copy {hbm_bw / 1e9:.0f} GB/s")
    ShadowKVCache(model, config=config)  # patch once: Dynamic runs through the same (sdpa) attention path
    total_gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 64 << 30

    # 1. Real prefill at batch 1 and a 256-step decode of the compressed cache.
    if not args.no_prefill:
        for length in contexts:
            ids = torch.randint(0, cfg.vocab_size, (1, length), device=device)
            times = {}
            # A server pins its value pool once; prefills then reuse it (stores/pinned_pool.py).
            if device.type == "cuda":
                size = config.resolve(length, cfg.num_key_value_heads * cfg.head_dim)
                shape = (1, cfg.num_key_value_heads, size.num_chunks, config.chunk_size, cfg.head_dim)
                warm_pool = [pinned_pool().allocate(shape, model.dtype) for _ in range(cfg.num_hidden_layers)]
                del warm_pool
            for method in ("dynamic", "shadowkv", "yakv") if "yakv" in args.methods else ("dynamic", "shadowkv"):
                if method == "dynamic":
                    cache = DynamicCache(config=cfg)
                else:
                    cache = ShadowKVCache(model, config=dataclasses.replace(config, mode=method))
                free(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                sync(device)
                t = time.perf_counter()
                with torch.no_grad():
                    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                sync(device)
                times[method] = time.perf_counter() - t
                log(f"prefill {length} {method}: {times[method]:.2f} s")
                row = dict(context=length, method=method, fill="real prefill", batch=1, prefill_s=times[method])
                if method != "dynamic":
                    row["compress_share"] = (times[method] - times["dynamic"]) / times[method]
                    steps = GENERATED_FOR_MEMORY if not args.small else 8
                    step = decode(model, cache, 1, 0, steps, device)
                    report = cache.memory_report()
                    row.update(step_ms=step * 1e3, tok_s=1 / step, hit_rate=report.hit_rate, note=f"{steps} steps, own selection",  # noqa: E501
                               gpu_bytes_per_seq_gib=report.gpu_bytes / 2**30,
                               full_kv_per_seq_gib=(length + steps) * kv_bytes_per_token(cfg) / 2**30)  # fmt: skip
                if device.type == "cuda":
                    row["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                rec.add(row)
                del cache
                free(device)
        if device.type == "cuda":
            pinned_pool().release_cached()

    # 2. Full attention sweeps (synthetic fill).
    best = {}
    methods = args.methods.split(",")
    for method in [m for m in ("dynamic", "static") if m in methods and not (m == "static" and args.no_static)]:
        for length in contexts:
            if method == "static" and length != contexts[0]:
                continue  # uncompiled StaticCache decodes ~10x slower than DynamicCache: one point shows it
            fits = int(
                (total_gpu / 1.02 - weights) // ((length + args.warm + args.steps + 1) * kv_bytes_per_token(cfg))
            )
            sweep = sorted({b for b in batches if b <= fits} | ({fits} if 0 < fits < batches[-1] else set()))
            for batch in sweep if method == "dynamic" else [1]:
                need = weights + batch * (length + args.warm + args.steps + 1) * kv_bytes_per_token(cfg) * 1.02
                if need > total_gpu:
                    log(f"{method} {length} batch {batch}: needs {need / 2**30:.0f} GiB > GPU, stop")
                    break
                cache = None
                try:
                    free(device)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    if method == "dynamic":
                        cache = fill_dynamic(model, batch, length, device)
                    else:
                        cache = fill_static(model, batch, length, device, args.warm + args.steps + 1)
                    step = decode(model, cache, batch, args.warm, args.steps, device)
                except torch.OutOfMemoryError:
                    log(f"{method} {length} batch {batch}: out of GPU memory")
                    del cache
                    free(device)
                    break
                except Exception as err:  # StaticCache "if it runs"
                    log(f"{method} {length} batch {batch}: failed: {err!r}")
                    rec.add(dict(context=length, method=method, batch=batch, note=f"failed: {type(err).__name__}"))
                    del cache
                    free(device)
                    break
                row = dict(context=length, method=method, fill="synthetic", batch=batch, tok_s=batch / step,
                           step_ms=step * 1e3, peak_gpu_gib=torch.cuda.max_memory_allocated(device) / 2**30
                           if device.type == "cuda" else None, gpu_bytes_per_seq_gib=length * kv_bytes_per_token(cfg) / 2**30)  # fmt: skip  # noqa: E501
                rec.add(row)
                del cache
                free(device)
                if method == "dynamic" and row["tok_s"] > best.get(length, {}).get("tok_s", 0):
                    best[length] = row
    for length, row in best.items():
        for b in sorted({row["batch"], int((total_gpu - weights) // (length * kv_bytes_per_token(cfg)))}):
            if b < 1:
                continue
            t = (weights + b * length * kv_bytes_per_token(cfg)) / hbm_bw
            rec.add(dict(context=length, method="full-attention roofline", batch=b, tok_s=b / t, step_ms=t * 1e3,
                         note="HBM bytes / measured copy bandwidth" + (" (Dynamic's best batch)" if b == row["batch"] else " (largest batch that fits)")))  # fmt: skip  # noqa: E501

    # 3. ShadowKV sweeps (synthetic fill, controlled hit rate) per value format, then h = 0 / 0.8 / own selection
    # at the best batch. The host budget bounds the batch: quantised values fit more rows into it.
    host_budget = args.host_gib * 2**30
    host_blocks = None
    if device.type == "cuda" and (
        "shadowkv" in methods or "yakv" in methods
    ):  # pinned once for every context and format: one flat block per layer, reused
        t = time.perf_counter()
        host_blocks = [pinned_pool().allocate((int(host_budget // cfg.num_hidden_layers),), torch.uint8)
                       for _ in range(cfg.num_hidden_layers)]  # fmt: skip
        log(f"pinned pool: {pinned_pool().pinned_bytes / 2**30:.1f} GiB pinned ({time.perf_counter() - t:.1f} s)")
    for length in contexts if "shadowkv" in methods else []:
        for value_format in args.value_formats.split(","):
            fmt_config = dataclasses.replace(config, value_format=value_format)
            row_host = host_value_bytes_per_row(cfg, fmt_config, length)
            # 256 bytes per layer of alignment between the payload and the scales
            max_rows = max(1, int((host_budget // cfg.num_hidden_layers - 256) // row_host))
            sweep = [b for b in batches if b <= max_rows]
            if max_rows not in sweep and max_rows < batches[-1]:
                sweep.append(max_rows)
            log(f"shadowkv {length} {value_format}: host values {row_host * cfg.num_hidden_layers / 2**30:.2f} GiB "
                f"per row, up to {max_rows} rows")  # fmt: skip
            best_row = None
            plan = [(b, args.h_sweep) for b in sweep]
            i = 0
            while i < len(plan):
                batch, h = plan[i]
                i += 1
                policy = LandmarkTopK() if h is None else ControlledHitRate(h)
                cache = None
                try:
                    free(device)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    cache = ShadowKVCache(model, config=fmt_config, policy=policy)
                    fill_shadowkv(model, cache, batch, length, device, host_blocks)
                    step = decode(model, cache, batch, args.warm, args.steps, device)
                except torch.OutOfMemoryError:
                    log(f"shadowkv {length} {value_format} batch {batch}: out of GPU memory")
                    del cache
                    free(device)
                    if i <= len(sweep):  # larger batches would not fit either: on to the other hit rates
                        sweep, plan = sweep[: i - 1], plan[: i - 1]
                        if best_row is not None:
                            plan += [(best_row["batch"], x) for x in args.extra_h if x != args.h_sweep]
                        i = len(sweep)
                    continue
                hr = hit_rate(cache)
                bound, hbm, pcie = shadowkv_bound(cfg, fmt_config, length, batch, hr or 0.0, weights, hbm_bw)
                row = dict(context=length, method="shadowkv", value_format=value_format, fill="synthetic",
                           batch=batch, h_target="own" if h is None else h, hit_rate=hr, tok_s=batch / step,
                           step_ms=step * 1e3, peak_gpu_gib=torch.cuda.max_memory_allocated(device) / 2**30
                           if device.type == "cuda" else None,
                           host_gib=batch * row_host * cfg.num_hidden_layers / 2**30, bound_ms=bound * 1e3,
                           hbm_gb_per_step=hbm / 1e9, pcie_gb_per_step=pcie / 1e9)  # fmt: skip
                rec.add(row)
                del cache
                free(device)
                if h == args.h_sweep and (best_row is None or row["tok_s"] > best_row["tok_s"]):
                    best_row = row
                if i == len(sweep) and best_row is not None:  # sweep done: other hit rates at the best batch
                    plan += [(best_row["batch"], x) for x in args.extra_h if x != args.h_sweep]
            free(device)

    # 4. YAKV mode (synthetic fill): every step scores every token from the device codes and fetches the top
    # k tokens' 4-bit key and value records; no temporal cache, so no hit rate to control.
    yakv_config = dataclasses.replace(config, mode="yakv")
    for length in contexts if "yakv" in methods else []:
        row_host = yakv_host_bytes_per_row(cfg, yakv_config, length)
        max_rows = max(1, int((host_budget // cfg.num_hidden_layers) // row_host))
        sweep = [b for b in batches if b <= max_rows]
        if max_rows not in sweep and max_rows < batches[-1]:
            sweep.append(max_rows)
        log(f"yakv {length}: host records {row_host * cfg.num_hidden_layers / 2**30:.2f} GiB per row, "
            f"up to {max_rows} rows")  # fmt: skip
        for batch in sweep:
            cache = None
            try:
                free(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                cache = ShadowKVCache(model, config=yakv_config)
                fill_yakv(model, cache, batch, length, device, host_blocks)
                step = decode(model, cache, batch, args.warm, args.steps, device)
            except torch.OutOfMemoryError:
                log(f"yakv {length} batch {batch}: out of GPU memory")
                del cache
                free(device)
                break
            bound, hbm, pcie = yakv_bound(cfg, yakv_config, length, batch, weights, hbm_bw)
            rec.add(dict(context=length, method="yakv", value_format="higgs4 k+v", fill="synthetic", batch=batch,
                         tok_s=batch / step, step_ms=step * 1e3, peak_gpu_gib=torch.cuda.max_memory_allocated(device)
                         / 2**30 if device.type == "cuda" else None,
                         host_gib=batch * row_host * cfg.num_hidden_layers / 2**30, bound_ms=bound * 1e3,
                         hbm_gb_per_step=hbm / 1e9, pcie_gb_per_step=pcie / 1e9))  # fmt: skip
            del cache
            free(device)

    add_summary(rec, contexts, args.value_formats.split(","), args.h_sweep)
    rec.write(plot=True)
    log("done:", results_dir() / f"{name}.md")


if __name__ == "__main__":
    main()
