"""Does ShadowKV's value fetch slow the kernels beside it? One layer's key rebuild, value fetch and landmark GEMM, each
alone and side by side, in one run.

Legend: B batch, Hkv KV heads, K selected chunks per head, N chunks per head, h share of the selected chunks held.

The decode step runs each layer's fetch (zero-copy reads of pinned host memory over PCIe, `ops/gather_values.py`) on
a side stream beside the key rebuild, and the fetch is hidden only as far as other kernels run while it waits on PCIe.
Two half-batch forwards on two streams took longer than one forward of the whole batch
(`two_streams_cuda_shadowkv_b44`), so this times, on one layer of a Llama-3.1-8B-shaped synthetic cache at 128K
(each row its own pinned values, the misses a random share 1 - h of the slots), as CUDA graph replays:

- `rebuild`, `fetch` and `gemm` (the landmark GEMM: queries against every chunk's landmark, the step's largest read
  from HBM) alone;
- `rebuild + fetch` and `gemm + fetch`: the fetch on a side stream beside the other, joined at each iteration, as
  the step runs them.

`--fetch-blocks-per-sm` tries the fetch kernel's grid at several sizes. `overlap` is how much of the shorter one the
pair hid: (a + b - pair) / min(a, b); 1 is a perfect overlap, 0 none,
and below 0 each slowed the other.

    python -m benchmarks.fetch_interference --device cuda          # an H200 machine, ~1 min
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.model_shapes import LLAMA_3_1_8B
from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import PAPER_SETTINGS, free, graph_us, log
from shadowkv_cache import LandmarkTopK, ShadowKVConfig
from shadowkv_cache.ops import gather_values as fetch_module
from shadowkv_cache.ops.gather_values import gather_values
from shadowkv_cache.ops.rebuild_keys import rebuild_missed_keys
from shadowkv_cache.testing import layer_sizes, pinned_blocks, synthetic_cache


def side_by_side(main, side_fn, side: torch.cuda.Stream):
    """`main()` on the current stream and `side_fn()` on `side`, forked and joined (as the decode step's fetch)."""

    def both():
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            side_fn()
        main()
        current.wait_stream(side)

    return both


def one_layer(model, batch: int, args, device: torch.device):
    """A synthetic cache of one layer (kept alive by the caller), its mode and prompt, the mode's temporal cache holding
    random chunks, and a random share `1 - h` of its slots missed."""
    config = ShadowKVConfig(min_compress_len=4096, value_format="higgs4", **PAPER_SETTINGS)
    row = layer_sizes(model, config, args.context).host_bytes_per_row
    blocks = pinned_blocks(1, row * batch)
    cache = synthetic_cache(model, batch, args.context, config, LandmarkTopK(), host_blocks=blocks)
    mode = cache.layers[0].mode
    prompt = mode.prompt
    slots, chunks = prompt.max_budget_chunks, prompt.selectable.shape[-1]
    temporal = mode.temporal  # empty, made with the prompt
    heads = temporal.ids.shape[1]
    temporal.ids.copy_(torch.rand(batch, heads, chunks, device=device).argsort(dim=-1)[..., :slots])
    miss = torch.rand(batch, heads, slots, device=device) >= args.h
    return cache, mode, prompt, temporal, miss


def measure(model, batch: int, args, device: torch.device) -> list[dict]:
    cache, mode, prompt, temporal, miss = one_layer(model, batch, args, device)
    landmarks = prompt.policy_state["landmarks"]  # [B, Hkv, C, D]
    query = torch.randn(batch, landmarks.shape[1], 8, landmarks.shape[-1], device=device, dtype=landmarks.dtype)

    def rebuild():
        rebuild_missed_keys(temporal.keys, temporal.ids, miss, prompt.a, prompt.b, prompt.positions, mode.rope)

    def fetch():
        gather_values(temporal.values, temporal.ids, miss, prompt.values)

    def gemm():
        torch.matmul(landmarks, query.transpose(-1, -2))

    side = torch.cuda.Stream(device)
    others = {"rebuild": rebuild, "gemm": gemm}
    alone = {name: graph_us(fn, device) for name, fn in others.items()}
    rows = [dict(batch=batch, run=name, fetch_blocks_per_sm=None, us=round(us, 2), overlap=None)
            for name, us in alone.items()]  # fmt: skip
    default = fetch_module.FETCH_BLOCKS_PER_SM
    try:
        for per_sm in args.fetch_blocks_per_sm:
            fetch_module.FETCH_BLOCKS_PER_SM = per_sm
            b = graph_us(fetch, device)
            rows.append(dict(batch=batch, run="fetch", fetch_blocks_per_sm=per_sm, us=round(b, 2), overlap=None))
            for name, fn in others.items():
                pair = graph_us(side_by_side(fn, fetch, side), device)
                a = alone[name]
                rows.append(dict(batch=batch, run=f"{name} + fetch", fetch_blocks_per_sm=per_sm, us=round(pair, 2),
                                 overlap=round((a + b - pair) / min(a, b), 3)))  # fmt: skip
    finally:
        fetch_module.FETCH_BLOCKS_PER_SM = default
    for r in rows:
        log(r)
    del cache
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batches", default="1,8,22,44")
    p.add_argument("--h", type=float, default=0.6)
    p.add_argument("--fetch-blocks-per-sm", type=lambda v: [float(x) for x in v.split(",")], default=[0.5],
                   help="fetch grids to try (FETCH_BLOCKS_PER_SM in ops/gather_values.py), comma list")  # fmt: skip
    p.add_argument("--name", default="fetch_interference_cuda_128k")
    add_results_dir_option(p)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("fetch_interference.py times kernels on two CUDA streams: run it on a CUDA device.")
    config = AutoConfig.for_model("llama", **{**LLAMA_3_1_8B, "num_hidden_layers": 1, "vocab_size": 1024},
                                  tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rows += measure(model, batch, args, device)
        free(device)
    env = environment(str(device), "bfloat16")
    notes = (f"One layer at {args.context} tokens, h = {args.h}, higgs4 values (each row its own pinned values), µs "
             "per call as CUDA graph replays; a pair runs the fetch on a side stream, joined at each call. `overlap`: "
             "(a + b - pair) / min(a, b).")  # fmt: skip
    columns = ["batch", "run", "fetch_blocks_per_sm", "us", "overlap"]
    title = "The value fetch beside the key rebuild and the landmark GEMM"
    write_results(args.name, title, env, rows, columns, {"x": "batch", "y": "us", "series": "run"}, notes)


if __name__ == "__main__":
    main()
