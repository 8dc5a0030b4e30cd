"""One layer's chunk selection kernels at ShadowKV's sizes: the top-k, and the temporal scan pairwise or by bitmaps, in
one run.

Legend: B batch, Hkv KV heads, N chunks per head, K selected chunks (slots) per head, h share of the wanted chunks
already held.

At small batches a layer's selection is a few kernels of one block per (row, head): 8 blocks at batch 1 for 132
multiprocessors. This times each variant on the same data, as CUDA graph replays (the way the decode step runs
them), at Llama-3.1-8B's shape at 128K (Hkv = 8, N = 16380, K = 256, h = 0.6) for each batch:

- `topk`: `select_topk`'s kernel of a block per row (checked against its twin);
- `scan pairwise`: `temporal_scan`'s kernel comparing every slot with every wanted chunk in shared memory;
- `scan bitmap`: membership as bits of the N chunks' bitmaps in shared memory.

Both scans are checked against each other on the same inputs before they are timed.

    python -m benchmarks.selection_kernels --device cuda          # an H200 machine, ~20 s
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import free, graph_us, log
from shadowkv_cache.ops.select_topk import select_topk_op, select_topk_reference
from shadowkv_cache.ops.temporal_scan import temporal_scan_op


def scan_case(rows: int, slots: int, units: int, h: float, device: torch.device):
    """Held ids, wanted ids (a share `h` of them held, the rest new) and validity, `[rows, slots]`, distinct ids."""
    order = torch.rand(rows, units, device=device).argsort(dim=-1)
    held = order[:, :slots]
    kept = int(h * slots)
    wanted = torch.cat((held[:, torch.randperm(slots, device=device)[:kept]], order[:, slots : 2 * slots - kept]), -1)
    valid = torch.ones(rows, slots, dtype=torch.bool, device=device)
    return held.contiguous(), wanted.contiguous(), valid


def measure(batch: int, args, device: torch.device) -> list[dict]:
    rows = batch * args.heads
    scores = torch.softmax(torch.randn(rows, args.chunks, device=device) * 3, dim=-1)
    out = []

    got = select_topk_op(scores, args.k)
    same = bool(torch.equal(got.cpu(), select_topk_reference(scores.cpu(), args.k)))
    us = graph_us(lambda: select_topk_op(scores, args.k), device, reps=50)
    out.append(dict(batch=batch, rows=rows, kernel="topk", us=round(us, 2), same=same))
    held, wanted, valid = scan_case(rows, args.k, args.chunks, args.h, device)
    results = {}
    for name, units in (("scan pairwise", 0), ("scan bitmap", args.chunks)):
        ids = held.clone()
        miss = temporal_scan_op(ids, wanted, valid, units)
        results[name] = (ids.clone(), miss.clone())

        def step(ids=ids, units=units):
            ids.copy_(held)  # the same scan each time: from the held ids to the wanted ones
            temporal_scan_op(ids, wanted, valid, units)

        results[name] += (graph_us(step, device, reps=50),)
    copy_us = graph_us(lambda: ids.copy_(held), device, reps=50)
    same = all(torch.equal(a, b) for a, b in zip(results["scan pairwise"][:2], results["scan bitmap"][:2]))
    for name, (_, _, us) in results.items():
        out.append(dict(batch=batch, rows=rows, kernel=name, us=round(us - copy_us, 2), same=same))
    for row in out:
        log(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,2,4,8,16,22,32,44")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--chunks", type=int, default=16380)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--h", type=float, default=0.6)
    p.add_argument("--name", default="selection_kernels_cuda_128k")
    add_results_dir_option(p)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("selection_kernels.py times CUDA kernels: run it on a CUDA device.")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rows += measure(batch, args, device)
        free(device)
    env = environment(str(device), "float32")
    notes = (f"One layer: {args.heads} KV heads per row, {args.chunks} chunks, k = {args.k}, h = {args.h}; µs per "
             "call as CUDA graph replays (the scan's time less the copy that resets its ids). `same`: the top-k gave "
             "its twin's indices; both scans gave the same ids and misses.")  # fmt: skip
    columns = ["batch", "rows", "kernel", "us", "same"]
    plot = {"x": "batch", "y": "us", "series": "kernel", "ylabel": "µs per layer"}
    title = "Chunk selection kernels at 128K: top-k, pairwise or bitmap scan"
    write_results(args.name, title, env, rows, columns, plot, notes)


if __name__ == "__main__":
    main()
