"""Can a layer's fetch start before its own query exists? Cross-layer speculation for ShadowKV, measured on a real
model.

Legend: B batch, Hq/Hkv query/KV heads, K selected chunks per KV head, L layers, h hit rate.

A ShadowKV decode step can fetch layer l's missed chunks only after layer l's query selects them, so the fetch
waits behind selection (issue "decode at the bytes bound", item 3). Residual streams change little from one layer
to the next, so layer l's *input* run through layer l+1's norm, query projection and RoPE gives a speculative
query for layer l+1 one layer early: its top-K chunks could be fetched while layer l computes. This script
measures, per decode step, compressed layer and KV head, against the chunks layer l+1 really selects:

- `spec_recall`: the share of the real selection that the speculative selection holds;
- `miss_coverage`: the share of the real misses (selected chunks not held from the previous step, which the temporal
  cache would fetch) that the speculative selection holds, i.e. the fetches that could start one layer early;
- `wasted`: speculative chunks that are neither selected nor held, per selected chunk (extra PCIe bytes);
- `hit_rate`: the temporal cache's share, for scale (selected chunks held from the previous step).

Greedy decoding after a natural-text prompt, ShadowKV at its defaults but for `--budgets`; the selections are
recomputed here with the cache's own policy, landmarks and selectable chunks. Llama-like attention only (query
projection, optional query norm, rotate-half RoPE from the model's own module).

    OMP_NUM_THREADS=1 python -m benchmarks.prefetch_study --model smollm2 --lengths 4096 8192 --steps 64 \
        --budgets default 0.015625

`--budgets`: `default` (the package's budget at that length) or a `sparse_budget` (tokens, or a share of the prompt:
0.015625 is the default's share at 128K, where its 2048-token floor no longer counts).

Writes benchmarks/results/prefetch_<model>_<device>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.accuracy_core import cache_kwarg
from benchmarks.accuracy_runner import MODELS
from benchmarks.hit_rate import add_text_run_options, budget_option, model_and_text
from benchmarks.results_io import write_results
from shadowkv_cache import ShadowKVCache


class LayerInputs:
    """Forward pre-hooks that keep each decoder layer's input hidden states and RoPE tables of the last call."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.hidden: dict[int, torch.Tensor] = {}
        self.rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = [
            layer.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, layer in enumerate(layers)
        ]

    def _hook(self, index: int):
        def keep(module, args, kwargs):
            self.hidden[index] = args[0] if args else kwargs["hidden_states"]
            self.rope[index] = kwargs["position_embeddings"]

        return keep

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def query_from(layer: torch.nn.Module, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Layer `layer`'s post-RoPE query `[B, Hq, T, D]` for input `hidden` `[B, T, H]`, as its attention computes it."""
    attn = layer.self_attn
    batch, steps, _ = hidden.shape
    query = attn.q_proj(layer.input_layernorm(hidden)).view(batch, steps, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):
        query = attn.q_norm(query)
    query = query.transpose(1, 2)
    apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    cos, sin = rope
    query, _ = apply_rope(query, query, cos, sin)
    return query


def as_sets(ids: torch.Tensor) -> list[set[int]]:
    """`[B, Hkv, K]` -> one set per (row, head)."""
    return [set(row.tolist()) for row in ids.flatten(0, 1)]


@torch.no_grad()
def measure(model, ids: torch.Tensor, steps: int, **overrides) -> dict:
    cache = ShadowKVCache(model, **overrides)
    kwarg = cache_kwarg(model)
    decoder = model.model.layers
    token = model(ids, use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits[:, -1:].argmax(-1)
    inputs = LayerInputs(decoder)
    held: dict[int, list[set[int]]] = {}
    totals = dict(selected=0, spec_hits=0, misses=0, covered=0, wasted=0, hits=0, sets=0, same=0)
    layers_measured = set()
    try:
        for _ in range(steps):
            token = model(token, use_cache=True, **{kwarg: cache}).logits[:, -1:].argmax(-1)
            for i in range(1, len(decoder)):
                layer = cache.layers[i]
                if not getattr(layer, "is_compressed", False):
                    continue
                prompt, scaling = layer.prompt, decoder[i].self_attn.scaling
                k = prompt.max_budget_chunks

                def select(query, prompt=prompt, scaling=scaling, k=k):
                    return cache.policy.select(query, prompt.policy_state, prompt.selectable, k, scaling)

                real = as_sets(select(query_from(decoder[i], inputs.hidden[i], inputs.rope[i])))
                # The recomputed selection against what the cache's step really holds now (a check of this script).
                cached = [{c for c in row if c >= 0} for row in as_sets(layer.mode.temporal.ids)]
                totals["sets"] += len(real)
                totals["same"] += sum(r == c for r, c in zip(real, cached))
                spec = as_sets(select(query_from(decoder[i], inputs.hidden[i - 1], inputs.rope[i])))
                before = held.get(i)
                if before is not None:  # the first step holds nothing: every chunk is a miss, no scale to compare
                    layers_measured.add(i)
                    for r, s, h in zip(real, spec, before):
                        missed = r - h
                        totals["selected"] += len(r)
                        totals["spec_hits"] += len(r & s)
                        totals["misses"] += len(missed)
                        totals["covered"] += len(missed & s)
                        totals["wasted"] += len(s - r - h)
                        totals["hits"] += len(r & h)
                held[i] = real
    finally:
        inputs.remove()
    selected = max(totals["selected"], 1)
    return {
        "prompt_tokens": ids.shape[1],
        "steps": steps,
        "budget": k * cache.config.chunk_size,
        "layers": len(layers_measured),
        "hit_rate": totals["hits"] / selected,
        "spec_recall": totals["spec_hits"] / selected,
        "miss_coverage": totals["covered"] / max(totals["misses"], 1),
        "wasted": totals["wasted"] / selected,
        "matches_cache": totals["same"] / max(totals["sets"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--steps", type=int, default=64, help="greedy decode steps per length")
    add_text_run_options(parser)
    args = parser.parse_args()
    model, text, env = model_and_text(args)
    rows = []
    columns = ["series", "prompt_tokens", "steps", "budget", "layers", "hit_rate", "spec_recall", "miss_coverage"]
    columns += ["wasted", "matches_cache"]
    for length in args.lengths:
        for budget in args.budgets:
            changes, label = budget_option(budget)
            overrides = {"min_compress_len": min(1024, length // 2), **changes}
            row = {"series": f"{args.model}, {label}", **measure(model, text[:, :length], args.steps, **overrides)}
            rows.append(row)
            print({k: row[k] for k in columns}, flush=True)
        notes = (
            f"ShadowKV at the package defaults (scaled to the prompt) but for the budgets in `series`, {args.model}, "
            f"greedy decoding of {args.steps} tokens after a natural-text prompt. For each compressed "
            "layer l+1 (not the first) and KV head, from the second step on: the chunks its real query selects, "
            "against those a speculative query (layer l's input through layer l+1's norm, query projection and RoPE) "
            "selects. `hit_rate`: real selection held from the previous step; `spec_recall`: real selection the "
            "speculation holds; `miss_coverage`: real misses the speculation holds (fetches that could start a layer "
            "early); `wasted`: speculative chunks neither selected nor held, per selected chunk; `matches_cache`: "
            "share of (layer, head, step) selections recomputed here that equal what the cache's temporal cache holds "
            "after the step (1 = the study measures the cache's own selection)."
        )
        write_results(
            f"prefetch_{args.model}_{args.device.split(':')[0]}",
            f"Cross-layer speculation of ShadowKV's selection, {args.model}",
            env,
            rows,
            columns,
            dict(x="prompt_tokens", y="miss_coverage", series="series", ylabel="misses covered one layer early"),
            notes=notes,
        )


if __name__ == "__main__":
    main()
