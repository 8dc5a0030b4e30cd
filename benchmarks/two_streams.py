"""Two half-batch forwards on two streams in one CUDA graph, against one forward of the whole batch: how much of a
decode step's PCIe fetch does the other half's compute hide?

Legend: B batch, S context tokens, h hit rate. Llama-3.1-8B shape with random bf16 weights, synthetic caches at S
tokens (`shadowkv_cache.testing.synthetic_cache`), each row with its own pinned host values. Per `MODE:B:H` spec:

- `full`: one cache of B rows through the patched model's whole-step graph (`benchmarks.speed.decode`, as
  `throughput.py` times it);
- `half`: one cache of B/2 rows, the same way;
- `two_stream`: two caches of B/2 rows whose one-token forwards are captured in one CUDA graph on two streams forked
  from the capture stream (each cache's fetch on its own side stream), replayed: both halves' tokens per replay.

A step of the whole batch reads the weights once; two halves read them twice, and hide a fetch only where the GPU
runs one half's kernels beside the other's fetch.

    python -m benchmarks.two_streams --device cuda yakv:22:0.55 shadowkv:44:0.6    # an H200 machine, ~4 min
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import PAPER_SETTINGS, GiB, build_model, decode, free, log, sync
from benchmarks.throughput_sweeps import mode_config
from shadowkv_cache import LandmarkTopK, ShadowKVCache, ShadowKVConfig
from shadowkv_cache.testing import pinned_blocks, synthetic_cache


def two_stream_step(model, caches, batches, context: int, device, steps: int) -> float:
    """Seconds per replay of one graph that steps both `caches` (of `batches` rows) on two streams."""
    for cache in caches:
        cache.step_graphs.enabled = False  # the forwards run inside this capture, each layer's step inline
    ids = [torch.randint(0, model.config.vocab_size, (b, 1), device=device) for b in batches]
    position = torch.full((1, 1), context, dtype=torch.int64, device=device)

    def forward(i: int):
        return model(input_ids=ids[i], past_key_values=caches[i], position_ids=position, use_cache=True,
                     logits_to_keep=1).logits  # fmt: skip

    with torch.no_grad():
        for _ in range(3):  # eager steps: kernels loaded, workspaces and temporal caches made
            for i in range(2):
                forward(i)
        sync(device)
        graph = torch.cuda.CUDAGraph()
        streams = [torch.cuda.Stream(device) for _ in range(3)]
        gc.collect()
        gc.disable()  # a collection inside a capture may destroy a graph, which CUDA refuses while capturing
        try:
            with torch.cuda.graph(graph, stream=streams[2]):
                fork = torch.cuda.current_stream()
                for i in range(2):
                    streams[i].wait_stream(fork)
                    with torch.cuda.stream(streams[i]):
                        forward(i)
                for i in range(2):
                    fork.wait_stream(streams[i])
        finally:
            gc.enable()
        for _ in range(3):
            graph.replay()
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        sync(device)
    return (time.perf_counter() - t) / steps


def measure(model, config, mode: str, batch: int, h: float, args, blocks, device) -> list[dict]:
    """The rows of one spec: `full`, `half` and `two_stream` step times and tokens/s."""
    cfg = config if mode == "shadowkv" else mode_config(dataclasses.replace(config, value_format="native"), mode)
    half = blocks[0].numel() // 2  # each half of the batch reads its own half of every layer's block
    halves = [[block[:half] for block in blocks], [block[half:] for block in blocks]]

    def make(rows: int, host):
        policy = LandmarkTopK() if mode == "shadowkv" else None
        return synthetic_cache(model, rows, args.context, cfg, policy, hit_rate=h, host_blocks=host)

    a, b = batch // 2, batch - batch // 2
    times = {}
    free(device)
    times["full"] = decode(model, make(batch, blocks), batch, 4, args.steps, device)
    free(device)
    times["half"] = decode(model, make(a, halves[0]), a, 4, args.steps, device)
    free(device)
    caches = [make(a, halves[0]), make(b, halves[1])]
    times["two_stream"] = two_stream_step(model, caches, [a, b], args.context, device, args.steps)
    del caches
    free(device)
    rows = []
    for name, step in times.items():
        log(mode, batch, name, f"{step * 1e3:.2f} ms")
        tokens = a if name == "half" else batch
        rows.append(dict(mode=mode, batch=batch, h=h, context=args.context, run=name, step_ms=step * 1e3,
                         tok_s=tokens / step))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", help="MODE:B:H, e.g. yakv:22:0.55 shadowkv:44:0.6")
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--host-gib", type=float, default=92.0, help="pinned host memory for the caches' values")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--name", default="two_streams_cuda")
    add_results_dir_option(p)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("two_streams.py captures CUDA graphs on two streams: run it on a CUDA device.")
    model = build_model(False, device)
    config = ShadowKVConfig(min_compress_len=4096, value_format="higgs4", **PAPER_SETTINGS)
    ShadowKVCache(model, config=config)  # patch once
    t = time.perf_counter()
    blocks = pinned_blocks(model.config.num_hidden_layers, int(args.host_gib * GiB // model.config.num_hidden_layers))
    log(f"pinned {args.host_gib} GiB in {time.perf_counter() - t:.1f} s")
    rows = []
    for spec in args.specs:
        mode, batch, h = spec.split(":")
        rows += measure(model, config, mode, int(batch), float(h), args, blocks, device)
    env = environment(str(device), "bfloat16")
    notes = (
        "`full`: one cache of B rows through the whole-step graph; `half`: B/2 rows the same way; `two_stream`: two "
        "caches of B/2 rows captured in one graph on two streams (each with its own fetch stream), tok/s over B rows."
    )
    columns = ["mode", "batch", "h", "context", "run", "step_ms", "tok_s"]
    plot = {"x": "batch", "y": "tok_s", "series": "run"}
    write_results(args.name, "Two half-batch forwards on two streams against one forward", env, rows, columns, plot,
                  notes)  # fmt: skip
    log("done:", args.name)


if __name__ == "__main__":
    main()
