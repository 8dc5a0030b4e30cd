"""One layer's selection kernels at ShadowKV's and YAKV's sizes: the top-k (against torch.topk), and the temporal scan
pairwise or by bitmaps, in one run.

Legend: B batch, Hkv KV heads, N chunks per head, K selected chunks (slots) per head, h share of the wanted chunks
already held.

At small batches a layer's selection is a few kernels of one block per (row, head): 8 blocks at batch 1 for 132
multiprocessors. This times each variant on the same data, as CUDA graph replays (the way the decode step runs
them), at Llama-3.1-8B's shape at 128K (Hkv = 8, N = 16380, K = 256, h = 0.6) for each batch:

- `topk`: `select_topk`'s kernel of a block per row (checked against its twin), beside `torch.topk` on the same
  scores;
- `topk tokens`: YAKV's token rows (`--tokens` scores per KV head, `--token-k` selected): the split kernels, which
  spread each row over many blocks (checked against the twin), beside `torch.topk`;
- `scan pairwise`: `temporal_scan`'s kernel comparing every slot with every wanted chunk in shared memory;
- `scan bitmap`: membership as bits of the N chunks' bitmaps in shared memory;
- `logits kernel` and `logits cuBLAS`: bf16 landmark logits of the G = 4 query heads of each KV head (the query scaled
  first, as `LandmarkTopK` does), by the tensor-core kernel or by cuBLAS's GEMM with the query rows padded to 8
  (`vs_torch`: cuBLAS's time over the kernel's; `same`: equal within a bf16 rounding). `LandmarkTopK` takes the kernel
  up to `NATIVE_KERNEL_MAX_ROWS` rows (batch x KV heads), chosen from these rows.

Both scans are checked against each other on the same inputs before they are timed.

    python -m benchmarks.selection_kernels --device cuda          # an H200 machine, ~1 min
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.speed import free, graph_us, log
from shadowkv_cache.ops.landmark_logits import landmark_logits_native_op
from shadowkv_cache.ops.select_topk import select_topk_op, select_topk_reference
from shadowkv_cache.ops.temporal_scan import temporal_scan_op
from shadowkv_cache.policies.base import grouped_query
from shadowkv_cache.policies.landmark_topk import landmark_logits


def scan_case(rows: int, slots: int, units: int, h: float, device: torch.device):
    """Held ids, wanted ids (a share `h` of them held, the rest new) and validity, `[rows, slots]`, distinct ids."""
    order = torch.rand(rows, units, device=device).argsort(dim=-1)
    held = order[:, :slots]
    kept = int(h * slots)
    wanted = torch.cat((held[:, torch.randperm(slots, device=device)[:kept]], order[:, slots : 2 * slots - kept]), -1)
    valid = torch.ones(rows, slots, dtype=torch.bool, device=device)
    return held.contiguous(), wanted.contiguous(), valid


def topk_rows(batch: int, rows: int, scores: torch.Tensor, k: int, name: str) -> list[dict]:
    """The kernel (checked against the twin) and torch.topk on the same `[rows, N]` scores."""
    got = select_topk_op(scores, k)
    same = bool(torch.equal(got.cpu(), select_topk_reference(scores.cpu(), k)))
    kernel_us = graph_us(lambda: select_topk_op(scores, k), scores.device, reps=50)
    torch_us = graph_us(lambda: scores.topk(k, dim=-1), scores.device, reps=50)
    common = dict(batch=batch, rows=rows, n=scores.shape[-1], k=k)
    return [
        dict(**common, kernel=name, us=round(kernel_us, 2), same=same, vs_torch=round(torch_us / kernel_us, 2)),
        dict(**common, kernel=f"torch.topk ({name})", us=round(torch_us, 2), same="", vs_torch=1.0),
    ]


def measure(batch: int, args, device: torch.device) -> list[dict]:
    rows = batch * args.heads
    scores = torch.softmax(torch.randn(rows, args.chunks, device=device) * 3, dim=-1)
    out = []

    out += topk_rows(batch, rows, scores, args.k, "topk")
    if args.tokens:
        tokens = torch.randn(rows, args.tokens, device=device) * 4  # YAKV's scores: query-key logits
        out += topk_rows(batch, rows, tokens, args.token_k, "topk tokens")
        del tokens
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
        out.append(dict(batch=batch, rows=rows, n=args.chunks, k=args.k, kernel=name, us=round(us - copy_us, 2),
                        same=same, vs_torch=""))  # fmt: skip
    out += logits_rows(batch, args, device)
    for row in out:
        log(row)
    return out


def logits_rows(batch: int, args, device: torch.device) -> list[dict]:
    """bf16 landmark logits of one layer (`[B, Hkv, N, D]` landmarks, `G` query heads per KV head) by the kernel and
    by cuBLAS, each with the query's scaling as `LandmarkTopK` applies it."""
    heads, group, dim, scaling = args.heads, 4, 128, 128**-0.5
    landmarks = torch.randn(batch, heads, args.chunks, dim, device=device, dtype=torch.bfloat16)
    query = torch.randn(batch, heads * group, 1, dim, device=device, dtype=torch.bfloat16)

    def kernel():
        return landmark_logits_native_op(grouped_query(query * scaling, heads), landmarks)

    def cublas():
        return landmark_logits(grouped_query(query * scaling, heads), landmarks)

    got, want = kernel().transpose(2, 3).unsqueeze(3).float(), cublas().float()
    same = bool(torch.allclose(got, want, rtol=2**-7, atol=1e-3))
    kernel_us = graph_us(kernel, device, reps=50)
    cublas_us = graph_us(cublas, device, reps=50)
    common = dict(batch=batch, rows=batch * heads, n=args.chunks, k="")
    return [
        dict(
            **common,
            kernel="logits kernel",
            us=round(kernel_us, 2),
            same=same,
            vs_torch=round(cublas_us / kernel_us, 2),
        ),
        dict(**common, kernel="logits cuBLAS", us=round(cublas_us, 2), same="", vs_torch=1.0),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,2,4,8,16,22,32,44")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--chunks", type=int, default=16380)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--h", type=float, default=0.6)
    p.add_argument("--tokens", type=int, default=131072, help="YAKV's token rows: scores per KV head (0: none)")
    p.add_argument("--token-k", type=int, default=4096, help="YAKV's selected tokens per KV head")
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
    notes = (f"One layer: {args.heads} KV heads per row, {args.chunks} chunks, k = {args.k}, h = {args.h}; YAKV's "
             f"token rows {args.tokens} scores, k = {args.token_k}. µs per call as CUDA graph replays (the scan's time "
             "less the copy that resets its ids). `same`: the top-k gave its twin's indices; both scans gave the same "
             "ids and misses. `vs_torch`: torch.topk's time over the kernel's on the same scores.")  # fmt: skip
    columns = ["batch", "rows", "n", "k", "kernel", "us", "vs_torch", "same"]
    plot = {"x": "batch", "y": "us", "series": "kernel", "ylabel": "µs per layer"}
    title = ("Selection kernels at 128K: top-k of chunks and of YAKV's tokens (against torch.topk), the temporal scan, "
             "landmark logits (kernel against cuBLAS)")  # fmt: skip
    write_results(args.name, title, env, rows, columns, plot, notes)


if __name__ == "__main__":
    main()
