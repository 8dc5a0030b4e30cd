"""How much precision do ShadowKV's landmarks need? Agreement with full attention and the chunks selected, with the
landmarks rounded to fewer bits.

Legend: B batch, Hkv KV heads, C chunks, D head dim, k selected chunks per KV head.

At 128K and batch 32 the landmarks are the largest thing a decode step reads from HBM: 32 MiB per row and layer in
bf16 (Llama-3.1-8B), three quarters of the step's HBM bytes, and their GEMM took 8.4 of 63 ms on an H200
(docs/results.md). Stored in 8 bits they would halve that, if the selection holds. This study rounds the landmarks
once after prefill (what storing them in that format would do), keeps everything else at the package's defaults,
and measures on natural text, teacher-forced against `DynamicCache`:

- `agreement`, `mean_kl`: top-1 agreement and KL(full || cache) of the next-token distributions;
- `same_selection`: the share of the chunks each decode step selects (per row and KV head) that the unrounded
  landmarks would also select.

Formats: `bf16` (what a bf16 model stores today; on a float32 model the reference is its float32 landmarks), and
float8 `e4m3` and `e5m2`, each either cast directly (no scale: landmarks are means of keys, well inside e4m3's range
of ±448 for these models) or with one scale per landmark vector (its largest magnitude mapped to the format's
largest value), plus `int8` with one scale per vector.

    .venv/bin/python -m benchmarks.landmark_precision                         # SmolLM2 fp32 on CPU, 4K and 8K

Writes benchmarks/results/landmark_precision_<model>_<device>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.defaults import compare, load, means_over_windows
from benchmarks.results_io import add_results_dir_option, environment, plot_facets, write_results
from shadowkv_cache import LandmarkTopK, ShadowKVCache
from shadowkv_cache.fidelity import natural_text_ids, teacher_forced_logits
from shadowkv_cache.policies.base import SelectionPolicy

warnings.filterwarnings("ignore", category=FutureWarning)

_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def rounded(landmarks: torch.Tensor, fmt: str) -> torch.Tensor:
    """`landmarks` `[B, Hkv, C, D]` stored in `fmt` and read back in their own dtype."""
    if fmt == "bf16":
        return landmarks.to(torch.bfloat16).to(landmarks.dtype)
    x = landmarks.float()
    name, _, scaled = fmt.partition("/")
    if name == "int8":
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
        return ((x / scale).round().clamp(-127, 127) * scale).to(landmarks.dtype)
    dtype = _FLOAT8[name]
    if not scaled:
        return x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).to(landmarks.dtype)
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / torch.finfo(dtype).max
    return ((x / scale).to(dtype).float() * scale).to(landmarks.dtype)


class RoundedLandmarks(SelectionPolicy):
    """ShadowKV's `LandmarkTopK` on landmarks rounded to `fmt`; counts how many selected chunks the unrounded
    landmarks would select too (`same`, `selected`)."""

    def __init__(self, fmt: str):
        self.inner, self.fmt = LandmarkTopK(), fmt
        self.same = self.selected = 0

    def prepare(self, chunk_keys, recent_queries=None, scaling=None):
        exact = self.inner.prepare(chunk_keys)["landmarks"]
        return {"landmarks": rounded(exact, self.fmt), "exact": exact}

    def score(self, query, state, selectable, scaling):
        return self.inner.score(query, {"landmarks": state["landmarks"]}, selectable, scaling)

    def select(self, query, state, selectable, k, scaling, query_mask=None):
        ids = super().select(query, state, selectable, k, scaling, query_mask)
        exact = self.inner.select(query, {"landmarks": state["exact"]}, selectable, k, scaling, query_mask)
        # Selected chunks that the exact selection holds too, where the slot selects a selectable chunk.
        real = selectable.gather(-1, ids)
        hits = (ids[..., :, None] == exact[..., None, :]).any(-1) & real
        self.same += int(hits.sum())
        self.selected += int(real.sum())
        return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--windows", type=int, default=2, help="text windows per length (different offsets)")
    parser.add_argument("--steps", type=int, default=64, help="teacher-forced continuation tokens per window")
    parser.add_argument(
        "--formats", nargs="+", default=["bf16", "e4m3", "e4m3/scaled", "e5m2", "int8"], help="landmark formats"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    add_results_dir_option(parser)
    args = parser.parse_args()

    model, tokenizer = load(args.model, args.device, getattr(torch, args.dtype))
    corpus = natural_text_ids(tokenizer, max(args.lengths) + args.steps + (args.windows - 1) * 20_000)
    corpus = corpus.to(args.device)
    formats = ["model dtype", *args.formats]
    plan = [(length, w, fmt) for length in args.lengths for w in range(args.windows) for fmt in formats]
    rows, current, reference = [], None, None
    for length, window, fmt in tqdm(plan, desc=f"{args.model} landmark formats"):
        ids = corpus[:, window * 20_000 : window * 20_000 + length + args.steps]
        if current != (length, window):
            reference = teacher_forced_logits(model, ids, length, DynamicCache(config=model.config))
            current = (length, window)
        policy = LandmarkTopK() if fmt == "model dtype" else RoundedLandmarks(fmt)
        start = time.perf_counter()
        cache = ShadowKVCache(model, policy=policy, min_compress_len=min(length, 4096))
        logits = teacher_forced_logits(model, ids, length, cache)
        agreement, kl = compare(reference, logits)
        same = policy.same / policy.selected if fmt != "model dtype" and policy.selected else 1.0
        row = dict(prompt_tokens=length, window=window, landmarks=fmt, agreement=round(agreement, 4),
                   mean_kl=round(kl, 5), same_selection=round(same, 4),
                   budget_tokens=cache.memory_report().layers[0].budget_tokens,
                   seconds=round(time.perf_counter() - start, 1))  # fmt: skip
        rows.append(row)
        tqdm.write(str(row))

    summary = means_over_windows(rows, "landmarks", ("agreement", "mean_kl", "same_selection"))
    name = f"landmark_precision_{args.model}_{args.device}"
    notes = (
        f"{args.model}, {args.dtype} on {args.device}, ShadowKV at its defaults: the landmarks rounded once after "
        f"prefill to each format. Teacher-forced top-1 agreement with DynamicCache and mean KL(full || cache) over "
        f"{args.steps} continuation tokens per window, {args.windows} windows per length (means; per-window rows in "
        "the JSON). `same_selection`: share of the chunks selected with rounded landmarks that the model-dtype "
        "landmarks select too (1 for the model dtype itself). `/scaled`: one scale per landmark vector."
    )
    write_results(
        name,
        title=f"Landmark precision: agreement and selection ({args.model})",
        env=environment(args.device, args.dtype),
        rows=summary,
        columns=["prompt_tokens", "landmarks", "windows", "budget_tokens", "agreement", "mean_kl", "same_selection"],
        plot=None,
        notes=notes,
        extra={"per_window": rows},
    )
    plot_facets(
        name,
        f"Selection kept and agreement by landmark format ({args.model})",
        summary,
        {"facet": "prompt_tokens", "series": "landmarks", "x": "same_selection", "y": "agreement"},
    )


if __name__ == "__main__":
    main()
