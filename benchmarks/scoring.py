"""YAKV token scoring against HBM bandwidth: the tensor-core kernels against the fp32 kernel, in one run.

Legend: B batch, Hkv KV heads, G query heads per KV head, N prompt tokens, M = D/4 code bytes per token, K selected
tokens per KV head.

Each decode step of YAKV mode scores every prompt token of every KV head from its ~2-bit code (`code_scores`,
`ops/score_codes.py`), then takes the top K. This times one layer's scoring on random codes (Llama-3.1-8B shape:
Hkv = 8, G = 4, D = 128, so 32 code bytes and a 2-byte norm per token and head) with CUDA events, for

- `tensor cores`: one pass over the codes on integer tensor cores (int8 grid points against the query's 24-bit integer
  digits), which writes per-tile softmax states and fp16 exponentials relative to each 16-token group's max, then a
  kernel that turns those into the scores (sm_80+);
- `fp32`: the fp32 kernel, which writes fp32 logits per query head, then `softmax_group_max`;

and reports the rate at which each goes through the codes and norms (`codes_GBps`: their bytes once / time, what
"reads its codes at X% of HBM bandwidth" means) beside the bytes it really moves (`moved_GBps`: the tensor-core
path writes and reads 2 bytes per query head and token and a group max per 16 tokens; the fp32 path writes and reads
4-byte logits), both as shares of the measured copy
bandwidth, and the time of `torch.topk` over the scores at the default budget (3.125% of N). The two kernels'
scores are compared on the same data (`max_rel_diff`, `topk_agree`: each tensor-core row against the fp32 kernel).

    python -m benchmarks.scoring --device cuda          # the H200 run (under a minute)
    python -m benchmarks.scoring --small                # a tiny CPU run of the twin (checks the script)
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import free, hbm_bandwidth, log, sync
from shadowkv_cache.ops import score_codes
from shadowkv_cache.ops.score_codes import code_scores
from shadowkv_cache.quant import HiggsQuantizer

KERNELS = {"tensor cores": True, "fp32": False}


def time_ms(fn, device: torch.device, warm: int = 3, reps: int = 10) -> float:
    """Mean wall time of `fn()` on `device`, ms (CUDA events on a GPU)."""
    for _ in range(warm):
        fn()
    if device.type != "cuda":
        import time

        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    sync(device)
    return start.elapsed_time(end) / reps


def one_layer(
    context: int,
    batch: int,
    heads: int,
    group: int,
    dim: int,
    device: torch.device,
    bandwidth: float,
    grids: list[tuple[int, int]],
):
    """Rows for one (context, batch): each kernel's time and rates, and their agreement. `grids` are the settings of
    D = 128's tensor-core grid to time (`MMA_K8_GRID`), the first one compared with the fp32 kernel."""
    quantizer = HiggsQuantizer(dim, 4)
    m = quantizer.num_subvectors
    gen = torch.Generator(device=device).manual_seed(0)
    codes = torch.randint(0, 256, (batch, heads, context, m), dtype=torch.uint8, device=device, generator=gen)
    norms = (torch.rand(batch, heads, context, device=device, generator=gen) * 4 + 8).half()
    selectable = torch.ones(batch, 1, context, dtype=torch.bool, device=device).expand(-1, heads, -1)
    query = torch.randn(batch, heads * group, 1, dim, device=device, generator=gen).to(torch.bfloat16)
    scaling = dim**-0.5
    k = max(1, round(0.03125 * context))
    once = codes.numel() + norms.numel() * 2 + batch * context  # codes, norms, selectable
    scores_bytes = batch * heads * context * 4
    pairs = -(-group // 2)  # query heads rounded up to even
    exps_bytes = batch * heads * (context * pairs * 4 + -(-context // 16) * 2 * pairs * 4)  # fp16 pairs, group maxima
    moved = {
        "tensor cores": once + 2 * exps_bytes + scores_bytes,  # exponentials written and read again
        "fp32": once + 2 * batch * heads * group * context * 4 + scores_bytes,  # logits written and read again
    }
    rows, outputs = [], []
    kernels = KERNELS if device.type == "cuda" else {"twin": False}
    variants = [(name, cores, grid) for name, cores in kernels.items() for grid in (grids if cores else grids[:1])]
    default = score_codes.MMA_K8_GRID
    try:
        for name, tensor_cores, grid in variants:
            score_codes.MMA_K8_GRID = grid
            run = functools.partial(code_scores, query, codes, norms, selectable, quantizer, scaling, tensor_cores)
            ms = time_ms(run, device)
            scores = run()
            outputs.append(scores)
            topk_ms = time_ms(functools.partial(torch.topk, scores, k, dim=-1), device)
            rows.append(
                {
                    "context": context,
                    "batch": batch,
                    "kernel": name if not tensor_cores or len(grids) == 1 else f"{name} {'x'.join(map(str, grid))}",
                    "ms": round(ms, 4),
                    "codes_GBps": round(once / ms / 1e6, 1),
                    "codes_share_of_hbm": round(once / ms / 1e-3 / bandwidth, 3) if bandwidth == bandwidth else None,
                    "moved_GBps": round(moved.get(name, once) / ms / 1e6, 1),
                    "topk_ms": round(topk_ms, 4),
                    "k": k,
                }
            )
            log("RESULT", rows[-1])
    finally:
        score_codes.MMA_K8_GRID = default
    if "fp32" in kernels:
        # Each tensor-core setting against the fp32 kernel on the same data (the fp32 row is the reference).
        b = outputs[[v[0] for v in variants].index("fp32")]
        for row, a, (name, _, _) in zip(rows, outputs, variants):
            if name == "fp32":
                continue
            rel = ((a - b).abs() / b.abs().clamp_min(1e-30)).where(b > 1e-6 * b.amax(), torch.zeros_like(b))
            # Share of the fp32 kernel's top-k that this top-k also holds (as sets, per row and head).
            picked = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(k, dim=-1).indices, True)
            agree = picked.gather(-1, b.topk(k, dim=-1).indices).float().mean()
            row["max_rel_diff"] = float(f"{rel.max().item():.3g}")
            row["topk_agree"] = round(agree.item(), 4)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny sizes on the CPU (checks the script)")
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--batches", default="1,4,12,23")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--mma-grids", default=None,
                        help="D = 128 tensor-core grids to time, 'blocks:stages:warps,...' (MMA_K8_GRID in "
                             "ops/score_codes.py; default: its value)")  # fmt: skip
    parser.add_argument("--name", default=None)
    add_results_dir_option(parser)
    args = parser.parse_args()
    device = torch.device("cpu" if args.small else args.device)
    contexts = [2048] if args.small else [int(c) for c in args.contexts.split(",")]
    batches = [1, 2] if args.small else [int(b) for b in args.batches.split(",")]
    grids = [score_codes.MMA_K8_GRID]
    if args.mma_grids:
        try:
            grids = [tuple(int(x) for x in g.split(":")) for g in args.mma_grids.split(",")]
            for grid in grids:
                score_codes.check_mma_k8_grid(grid)
        except ValueError as err:
            parser.error(f"--mma-grids takes blocks:stages:warps, e.g. 4:3:4,3:2:8; got {args.mma_grids!r} ({err})")
    bandwidth = hbm_bandwidth(device)
    log(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for context in contexts:
        for batch in batches:
            rows += one_layer(context, batch, args.kv_heads, args.group, args.dim, device, bandwidth, grids)
            free(device)  # one layer's codes at a time
    env = environment(str(device), "bfloat16 queries, uint8 codes")
    env["hbm_copy_bandwidth_GBps"] = round(bandwidth / 1e9, 1) if bandwidth == bandwidth else None
    env["shape"] = f"Hkv={args.kv_heads}, G={args.group}, D={args.dim}, grid dim 4 (one layer)"
    for row in rows:
        row["series"] = f"{row['kernel']}, {row['context'] // 1024}K"
    name = args.name or ("scoring_cpu_small" if args.small else f"scoring_{device.type}")
    notes = (
        "One layer's YAKV token scoring (softmax over tokens from ~2-bit codes, max over the GQA group), random "
        "codes. `codes_GBps`: code, norm and mask bytes once / time; `codes_share_of_hbm`: that over the measured "
        "copy bandwidth; `moved_GBps`: bytes each path really moves / time; `topk_ms`: `torch.topk` of K = 3.125% "
        "of N over the scores."
    )
    columns = ["context", "batch", "kernel", "ms", "codes_GBps", "codes_share_of_hbm", "moved_GBps", "topk_ms"]
    columns += ["max_rel_diff", "topk_agree"]
    title = "YAKV token scoring: tensor cores vs fp32 kernel (one layer, Llama-3.1-8B shape)"
    plot = {"x": "batch", "y": "codes_GBps", "series": "series", "ylabel": "code bytes / time (GB/s)"}
    write_results(name, title, env, rows, columns, plot, notes)
    log(f"done: {name}")


if __name__ == "__main__":
    main()
