"""Accuracy benchmark: what ShadowKV costs in quality, where it holds and where it breaks.

Generated tasks (RULER-style needles, variable tracking, common/frequent words, multi-needle retrieval, a
Text2JSON-like extraction, multi-turn needles; `benchmarks/tasks/`), fidelity against full attention on natural
text, and the selection probe (share of the exact attention mass held by the selected chunks, against the oracle
top-k), for full attention (`DynamicCache`) and every selection policy at equal token budgets:

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.accuracy --mode cpu      # small sample, ~10 min on 2 cores
    python -m benchmarks.accuracy --mode gpu --device cuda --dtype bfloat16  # full sample, ~6-7 min on an H200
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.accuracy --mode selection  # mass covered vs bytes per step

(`--tasks`, `--length`, `--samples`, `--budgets`, `--methods`, `--no-sweeps`, `--sweep-ranks`, `--sweep-chunks`,
`--fidelity-rows`, `--fidelity-lengths` change the plan; `--model` picks the model: `smollm2`, or `gemma3` = Gemma 3
270M, extra `gemma`.) The `selection` plan measures selection alone on natural text (the probe's share of the exact
attention mass, against the chunk and token oracles) for ShadowKV, YAKV and the study's two YAKV extensions, over a
budget sweep, and adds `_bytes.png`: mass covered against host-to-device bytes per step. Gemma 3 on CPU, ~20 min:

    OMP_NUM_THREADS=1 python -m benchmarks.accuracy --model gemma3 --length 4096 --samples 1 --budgets 64 256 \
        --no-sweeps --fidelity-rows 1 --fidelity-lengths 8192 \
        --tasks fidelity niah_single_1 niah_multikey_2 multi_needle multi_turn

Writes benchmarks/results/accuracy_<model>_<mode>.{json,md,png} (and `_recall.png`, selection recall against
budget). Every method runs in the same ShadowKVCache (same low-rank keys, outliers, local window and host value
store); only the policy and the budget change. Methods that share a prefill (same rank and chunk size) are
forked from one prefill (benchmarks/methods.py), so a sample is prefilled once per (rank, chunk size).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import DynamicCache

from benchmarks.accuracy_core import answer_turns, left_pad, prefill, render_segments, teacher_forced
from benchmarks.methods import EVICTING, EXTENSIONS, METHODS, MODE_CHANGES, PolicyBundle, fork_cache
from benchmarks.results_io import (
    add_results_dir_option,
    environment,
    markdown_table,
    plot_facets,
    results_dir,
    write_results,
)
from benchmarks.selection_probe import SelectionProbe
from benchmarks.tasks import TASKS
from shadowkv_cache import ShadowKVCache, ShadowKVConfig
from shadowkv_cache.fidelity import natural_text_ids
from shadowkv_cache.hf.adapters import sliding_windows


def load_model(name: str, dtype: torch.dtype, device: str):
    """`(model, tokenizer)` of an embedded model: SmolLM2-135M-Instruct or Gemma 3 270M (extra `gemma`)."""
    from shadowkv_cache import embedded_models

    if name == "smollm2":
        return embedded_models.load_smollm2(dtype=dtype, device=device)
    if name == "gemma3":
        return embedded_models.load_gemma3_270m(dtype=dtype, device=device)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


MODELS = ["smollm2", "gemma3"]


@dataclass
class Plan:
    """What one run measures. Every method runs with exact keys (rank `Hkv*D`: the selection alone), and the
    `default_rank_methods` also at the scaled default rank (ShadowKV as shipped: 32 for SmolLM2)."""

    tasks: list[str]
    length: int  # prompt tokens (about)
    samples: int  # per task, run as one left-padded batch
    budgets: list[int]  # sparse_budget sweep (tokens per KV head) for the `budget_tasks`
    budget_tasks: list[str]
    default_rank_methods: dict[str, list[str]]  # task -> methods also run at the default rank ("*": the others)
    sweep_tasks: list[str]  # ShadowKV as shipped at the default budget, other ranks and chunk sizes
    sweep_ranks: list[int]
    sweep_chunks: list[int]
    fidelity_rows: int  # natural-text windows, one batch
    fidelity_steps: int  # teacher-forced steps
    greedy_tokens: int
    extra_lengths: dict[str, list[int]] = field(default_factory=dict)  # task -> other lengths (default budget)
    default_budget: int = 256  # ShadowKV's default for prompts up to 16K: max(256, 1.5625% of S)
    seed: int = 0
    methods: list[str] | None = None  # None: every method but the YAKV extensions
    chunk_overrides: dict = field(default_factory=dict)  # config changes for the ShadowKV-mode methods
    count_kept: bool = False  # recall over all offloaded units, outliers counted as covered (SelectionProbe)
    notes: str = ""  # what the plan changes, for the report


def plan_methods(plan: Plan) -> list[str]:
    return plan.methods or [m for m in METHODS if m not in EXTENSIONS]


PLANS = {
    # ~10 minutes on 2 busy cores (OMP_NUM_THREADS=1: with other processes on the cores, 2 threads ran 30x
    # slower here).
    "cpu": Plan(
        tasks=["niah_single_1", "niah_multikey_2", "multi_needle", "text2json", "multi_turn"],
        length=1024,
        samples=2,
        budgets=[32, 64, 128, 256],
        budget_tasks=["fidelity", "niah_multikey_2"],
        default_rank_methods={"fidelity": ["shadowkv", "oracle"], "*": ["shadowkv"]},
        sweep_tasks=["fidelity"],
        sweep_ranks=[16, 64, 96],
        sweep_chunks=[4, 16],
        fidelity_rows=2,
        fidelity_steps=32,
        greedy_tokens=16,
    ),
    # About 6-7 minutes on an H200 (estimated from a partial run: decode is launch-bound at ~0.1 s per step
    # with batch 8 at 4K and the probe, whatever the batch), so samples are batched and answers kept short.
    "gpu": Plan(
        tasks=[
            "niah_single_1",
            "niah_multikey_2",
            "niah_multivalue",
            "multi_needle",
            "text2json",
            "multi_turn",
        ],
        length=4096,
        samples=8,
        budgets=[64, 256, 1024],
        budget_tasks=["fidelity", "niah_multikey_2"],
        default_rank_methods={"fidelity": ["shadowkv", "oracle"], "*": ["shadowkv"]},
        sweep_tasks=["fidelity"],
        sweep_ranks=[16, 64, 96],
        sweep_chunks=[4, 16],
        fidelity_rows=8,
        fidelity_steps=24,
        greedy_tokens=8,
        extra_lengths={"fidelity": [8000]},
    ),
    # Selection quality alone. The ShadowKV-mode methods run with a 64-token local window, so
    # that at 3072 tokens (3008 = 376 chunks, no ragged tail) they and YAKV (64 recent tokens) offload the same
    # tokens, and the probe counts ShadowKV's outlier chunks as covered: one denominator for all methods.
    "selection": Plan(
        tasks=[],
        length=3072,
        samples=1,
        budgets=[32, 64, 128, 256, 512, 1024],
        budget_tasks=["fidelity"],
        default_rank_methods={},
        sweep_tasks=[],
        sweep_ranks=[],
        sweep_chunks=[],
        fidelity_rows=2,
        fidelity_steps=16,
        greedy_tokens=2,
        methods=["shadowkv", "oracle", "yakv", "yakv_residual", "yakv_shared"],
        chunk_overrides={"local_window": 64},
        count_kept=True,
        notes="""**Selection plan.** ShadowKV-mode methods (`shadowkv`, the chunk `oracle`) run here with
`local_window=64` (at 3072 tokens no ragged tail), so that they leave the same tokens in the prompt's offloaded part
as the YAKV methods (64 recent tokens exact) and `recall` has one denominator for all: the exact attention mass
over the prompt minus its last 64 tokens, per layer, query head and step. ShadowKV's outlier chunks (default
`max(4, 0.3% of S/8)` per head, exact on the GPU, no PCIe bytes) count as covered, for it and for its oracle. Keys
are exact (rank = Hkv*D): only the selection differs.
`yakv_residual` scores tokens from residual landmarks (a 4-bit landmark per 8 keys + a 1-bit residual per key,
`ResidualLandmarkTopK`), `yakv_shared` from YAKV's 2-bit keys with the layer's `Hkv*k` tokens shared by its heads
(`SharedBudgetTopK`); both fetch YAKV's 4-bit records. `h2d_bf16_kib` is what the budget moves per decode step and
sequence (all layers) in the GPU deployment: ShadowKV `k` tokens x D x 2 bytes of bf16 values per KV head (keys
are rebuilt on the device), YAKV `k` x (D + 4) bytes of 4-bit key and value records; `h2d_kib_per_step` is the
measured figure (ShadowKV: the temporal cache's misses, at the model's fp32 here). `oracle_recall` of a ShadowKV row
is the chunk oracle (best chunks per head), of a YAKV row the token oracle (best tokens per head), of a
`yakv_shared` row the shared token oracle (best `Hkv*k` (head, token) pairs of the layer).""",
    ),
}


@dataclass(frozen=True)
class Config:
    method: str
    rank: int | str | None  # None = the scaled default, "full" = Hkv*D (exact keys)
    chunk: int
    budget: int


def configs_for(plan: Plan, task: str, length: int) -> list[Config]:
    """The (method, rank, chunk size, budget) settings run on `task` at `length` (full attention comes on top)."""
    default = plan.default_budget
    if length != plan.length:  # other lengths: ShadowKV as shipped and the oracle, exact keys too
        return [Config(m, r, 8, default) for r in ("full", None) for m in ("shadowkv", "oracle")]
    budgets = plan.budgets if task in plan.budget_tasks else [default]
    out = [Config(m, "full", 8, b) for m in plan_methods(plan) for b in budgets]
    at_default_rank = plan.default_rank_methods.get(task, plan.default_rank_methods.get("*", []))
    out += [Config(m, None, 8, b) for m in at_default_rank for b in budgets]
    if task in plan.sweep_tasks:
        out += [Config("shadowkv", r, 8, default) for r in plan.sweep_ranks]
        out += [Config("shadowkv", None, c, default) for c in plan.sweep_chunks]
    return list(dict.fromkeys(out))


class Runner:
    def __init__(self, model, tokenizer, device: str, chunk_overrides: dict | None = None, count_kept: bool = False):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.chunk_overrides, self.count_kept = chunk_overrides or {}, count_kept
        text = model.config.get_text_config()
        # The layers ShadowKV compresses (Gemma 3: the full-attention ones; its sliding layers stay exact).
        self.num_layers = sum(window is None for window in sliding_windows(text))
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.num_kv_heads = text.num_key_value_heads
        self.key_dim = self.num_kv_heads * self.head_dim
        self.elem = torch.finfo(model.dtype).bits // 8

    def overrides(self, cfg: Config, length: int) -> dict:
        # Eager decode steps: the selection probe records every step in Python, which a replayed CUDA graph would
        # skip (capture also fails on the probe's host reads, and the cache then falls back to eager with a warning).
        start = {"min_compress_len": min(1024, length // 2), "cuda_graphs": False}
        if cfg.method in MODE_CHANGES:  # no rank or chunks: keys and values are quantised, tokens selected
            return {**start, **MODE_CHANGES[cfg.method]}
        rank = self.key_dim if cfg.rank == "full" else cfg.rank
        return {"rank": rank, "chunk_size": cfg.chunk, **start, **self.chunk_overrides}

    def groups(self, configs: list[Config]) -> dict[tuple, list[Config]]:
        """Configs that can share one prefill: same rank and chunk size, or the same storage mode."""
        out: dict[tuple, list[Config]] = defaultdict(list)
        for cfg in configs:
            key = (
                tuple(sorted(MODE_CHANGES[cfg.method].items())) if cfg.method in MODE_CHANGES else (cfg.rank, cfg.chunk)
            )
            out[key].append(cfg)
        return out

    def base_cache(self, group: list[Config], length: int, ids, mask) -> ShadowKVCache:
        bundle = PolicyBundle({m: METHODS[m]() for m in dict.fromkeys(c.method for c in group)})
        base = ShadowKVCache(self.model, policy=bundle, **self.overrides(group[0], length))
        prefill(self.model, ids, mask, base)
        return base

    def fork(self, base: ShadowKVCache, cfg: Config) -> tuple[ShadowKVCache, SelectionProbe]:
        probe = SelectionProbe(METHODS[cfg.method](), self.num_layers, self.count_kept)
        dense = cfg.method not in EVICTING
        cache = fork_cache(base, self.model, cfg.method, probe, cfg.budget, dense_multi_token_steps=dense)
        return cache, probe

    def stats(self, cache: ShadowKVCache, probe: SelectionProbe, rows: int, cfg: Config, multi_token_steps=0) -> dict:
        """Selection recall and the host-to-device value bytes per decode step and sequence.

        Single-token steps move the temporal cache's missed chunks; a multi-token step (a later chat turn) with
        `dense_multi_token_steps` moves every chunk of the prompt. YAKV counts the quantised key and value
        records it read (the selected tokens at every step, the whole prompt on multi-token steps).
        """
        if cache.config.mode == "yakv":
            recall, oracle, units = probe.totals()
            dense_steps = multi_token_steps if cache.config.dense_multi_token_steps else 0
            fetched = sum(layer.mode.fetched_bytes for layer in cache.layers if layer.is_compressed)
            nominal = sum(
                layer.prompt.max_budget_tokens * self.num_kv_heads * layer.prompt.store.record_bytes
                for layer in cache.layers
                if layer.prompt is not None
            )
            return {
                "nominal_bytes": nominal,
                "value_bytes_bf16": fetched,
                "rank": self.key_dim,  # keys are quantised, not low-rank
                "recall_mass": recall,
                "oracle_mass": oracle,
                "units": units,
                "value_bytes": sum(layer.mode.fetched_bytes for layer in cache.layers if layer.is_compressed),
                "steps_rows": (probe.steps + dense_steps) * rows,
                "hits": 0,
                "lookups": 0,
            }
        counts = [c for c in (layer.hit_counts() for layer in cache.layers if hasattr(layer, "hit_counts")) if c]
        misses = sum(n - h for h, n in counts)
        hits = sum(h for h, _ in counts)
        chunk_bytes = cfg.chunk * self.head_dim * self.elem
        dense_steps = multi_token_steps if cache.config.dense_multi_token_steps else 0
        prompt_chunks = sum(layer.prompt.values.data[0].shape[:2].numel() for layer in cache.layers if layer.prompt)
        recall, oracle, units = probe.totals()
        value_bytes = misses * chunk_bytes + dense_steps * rows * prompt_chunks * chunk_bytes
        nominal = sum(  # bf16 values of the selected chunks, as on the GPU
            int(layer.prompt.max_budget_chunks) * cfg.chunk * self.head_dim * 2 * self.num_kv_heads
            for layer in cache.layers
            if layer.prompt is not None
        )
        return {
            "nominal_bytes": nominal,
            "value_bytes_bf16": value_bytes * 2 // self.elem,
            "rank": int(next(layer for layer in cache.layers if layer.prompt).prompt.a.shape[-1]),  # the rank used
            "recall_mass": recall,
            "oracle_mass": oracle,
            "units": units,
            "value_bytes": misses * chunk_bytes + dense_steps * rows * prompt_chunks * chunk_bytes,
            "steps_rows": (probe.steps + dense_steps) * rows,
            "hits": hits,
            "lookups": hits + misses,
        }


def stacked(rows_ids: list[list[int]], pad: int, device: str):
    ids, mask = left_pad(rows_ids, pad)
    return ids.to(device), mask.to(device)


def batches_of(samples, segments):
    """One batch, unless later turns differ in length across samples (then one sample per batch)."""
    turns = len(samples[0].turns)
    if all(len({len(seg[k]) for seg in segments}) == 1 for k in range(1, turns)):
        return [(samples, segments)]
    return [([s], [g]) for s, g in zip(samples, segments)]


def run_task(runner: Runner, task: str, length: int, plan: Plan, bar) -> list[dict]:
    """Full attention and every config on `plan.samples` samples of `task`; one row per config."""
    model, tok, device = runner.model, runner.tokenizer, runner.device
    spec = TASKS[task]
    samples = [spec.generate(plan.seed + i, length, tok) for i in range(plan.samples)]
    segments = [render_segments(tok, s) for s in samples]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    totals: dict = defaultdict(lambda: defaultdict(float))  # config (or "full") -> sums
    turn_scores: dict = defaultdict(list)
    examples: dict = {}

    def record(key, batch, answers, seconds, stats=None):
        for sample, ans in zip(batch, answers):
            scores = [spec.score(t.expected, a) for t, a in zip(sample.turns, ans)]
            totals[key]["score"] += sum(scores) / len(scores)
            totals[key]["n"] += 1
            turn_scores[key].append(scores)
        for k, v in (stats or {}).items():
            totals[key][k] = v if k in ("rank", "nominal_bytes") else totals[key][k] + v
        totals[key]["seconds"] += seconds
        examples.setdefault(key, answers[0][-1][-160:])

    configs = configs_for(plan, task, length)
    for batch, segs in batches_of(samples, segments):
        ids, mask = stacked([g[0] for g in segs], pad, device)
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        prefill(model, ids, mask, cache)
        record("full", batch, answer_turns(model, tok, batch, segs, cache, device), time.perf_counter() - start)
        bar.update(1)
        for group in runner.groups(configs).values():
            base = runner.base_cache(group, length, ids, mask)
            for cfg in group:
                start = time.perf_counter()
                cache, probe = runner.fork(base, cfg)
                answers = answer_turns(model, tok, batch, segs, cache, device)
                stats = runner.stats(cache, probe, len(batch), cfg, multi_token_steps=len(batch[0].turns) - 1)
                record(cfg, batch, answers, time.perf_counter() - start, stats)
                bar.update(1)
            del base

    prompt_tokens = sum(len(g[0]) for g in segments) / len(segments)
    rows = []
    for key, t in totals.items():
        row = {
            "task": task,
            "length": length,
            "prompt_tokens": round(prompt_tokens),
            "samples": int(t["n"]),
            "accuracy": t["score"] / t["n"],
            "seconds": round(t["seconds"], 1),
            "example": examples[key],
        }
        if len(samples[0].turns) > 1:
            turns = turn_scores[key]
            row["first_turn"] = sum(x[0] for x in turns) / len(turns)
            row["later_turns"] = sum(sum(x[1:]) / (len(x) - 1) for x in turns) / len(turns)
        if key == "full":  # an offloaded full cache would move all of K and V at every step
            full_kv = 2 * runner.num_layers * runner.key_dim * prompt_tokens * runner.elem
            row.update(method="full", rank=runner.key_dim, chunk="", budget="all", h2d_kib_per_step=full_kv / 1024)
        else:
            row.update(method=key.method, rank=int(t["rank"]), chunk=key.chunk, budget=key.budget)
            row.update(summarise_stats(t))
        rows.append(row)
    return rows


def summarise_stats(a: dict) -> dict:
    return {
        "recall": a["recall_mass"] / a["units"] if a["units"] else float("nan"),
        "oracle_recall": a["oracle_mass"] / a["units"] if a["units"] else float("nan"),
        "h2d_kib_per_step": a["value_bytes"] / a["steps_rows"] / 1024 if a["steps_rows"] else 0.0,
        "h2d_bf16_kib": round(a["nominal_bytes"] / 1024),
        "h2d_bf16_measured_kib": a["value_bytes_bf16"] / a["steps_rows"] / 1024 if a["steps_rows"] else 0.0,
        "hit_rate": a["hits"] / a["lookups"] if a["lookups"] else float("nan"),
    }


@torch.no_grad()
def run_fidelity(runner: Runner, length: int, plan: Plan, bar) -> list[dict]:
    """Teacher-forced agreement and KL against full attention, and the matching greedy length, on natural text."""
    model, device = runner.model, runner.device
    steps, rows_n, greedy = plan.fidelity_steps, plan.fidelity_rows, plan.greedy_tokens
    width = length + steps
    ids = natural_text_ids(runner.tokenizer, rows_n * width).view(rows_n, width).to(device)
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=greedy, min_new_tokens=greedy, do_sample=False)

    def greedy_tokens(cache):
        return model.generate(ids[:, :length], attention_mask=mask[:, :length], past_key_values=cache, **kwargs)[
            :, length:
        ]

    start = time.perf_counter()
    full_cache = DynamicCache(config=model.config)
    prefill(model, ids[:, :length], mask[:, :length], full_cache)
    full_greedy = greedy_tokens(copy.deepcopy(full_cache))
    full = teacher_forced(model, ids, length, full_cache)  # [B, N, V]
    log_p = full.log_softmax(-1)
    out = [
        {
            "task": "fidelity",
            "method": "full",
            "rank": runner.key_dim,
            "chunk": "",
            "budget": "all",
            "length": length,
            "prompt_tokens": length,
            "samples": rows_n,
            "accuracy": 1.0,
            "mean_kl": 0.0,
            "greedy_match": float(greedy),
            "h2d_kib_per_step": 2 * runner.num_layers * runner.key_dim * length * runner.elem / 1024,
            "seconds": round(time.perf_counter() - start, 1),
        }
    ]
    bar.update(1)
    configs = configs_for(plan, "fidelity", length)
    for group in runner.groups(configs).values():
        base = runner.base_cache(group, length, ids[:, :length], mask[:, :length])
        for cfg in group:
            start = time.perf_counter()
            cache, probe = runner.fork(base, cfg)
            got = teacher_forced(model, ids, length, cache)
            stats = runner.stats(cache, probe, rows_n, cfg)
            agreement = (got.argmax(-1) == full.argmax(-1)).float().mean().item()
            kl = (log_p.exp() * (log_p - got.log_softmax(-1))).sum(-1).mean().item()
            same = (greedy_tokens(runner.fork(base, cfg)[0]) == full_greedy).int()
            match = torch.where(same.all(-1), greedy, (1 - same).argmax(-1)).float().mean().item()
            row = {"task": "fidelity", "method": cfg.method, "rank": stats["rank"], "chunk": cfg.chunk}
            row.update(budget=cfg.budget, length=length, prompt_tokens=length, samples=rows_n, accuracy=agreement)
            row.update(mean_kl=kl, greedy_match=match, seconds=round(time.perf_counter() - start, 1))
            row.update(summarise_stats(stats))
            out.append(row)
            bar.update(1)
        del base
    return out


def label(row: dict, key_dim: int) -> str:
    """Series name: the method, its keys (exact or the rank) and a chunk size other than 8."""
    if row["method"] == "full":
        return "full attention"
    if row["method"] in MODE_CHANGES:
        return f"{row['method']} (4-bit K/V, token top-k)"
    suffix = "" if row["chunk"] == 8 else f", c={row['chunk']}"
    keys = "exact keys" if row["rank"] >= key_dim else f"rank {row['rank']}"
    return f"{row['method']} ({keys}{suffix})"


def summary_tables(rows: list[dict], default_budget: int) -> str:
    """Markdown: accuracy and selection recall per task at the default budget, one column per method."""
    main = [r for r in rows if r["budget"] in ("all", default_budget) and r["chunk"] in ("", 8)]
    columns = list(dict.fromkeys(r["series"] for r in sorted(main, key=_series_order)))
    acc_rows, rec_rows = {}, {}
    for r in main:
        acc_rows.setdefault(r["task"], {"task": r["task"]})[r["series"]] = r["accuracy"]
        if "recall" in r:
            rec_rows.setdefault(r["task"], {"task": r["task"]})[r["series"]] = r["recall"]
    lines = [f"### Accuracy at a budget of {default_budget} tokens per KV head (fidelity: top-1 agreement)", ""]
    lines += markdown_table(list(acc_rows.values()), ["task", *columns])
    lines += ["", f"### Selection recall at {default_budget} tokens (exact attention mass held by the selection)", ""]
    lines += markdown_table(list(rec_rows.values()), ["task", *[c for c in columns if c != "full attention"]])
    return "\n".join(lines)


def _series_order(row: dict) -> tuple:
    methods = ["full", *METHODS]
    return (methods.index(row["method"]), -row["rank"], row["chunk"] if isinstance(row["chunk"], int) else 0)


NOTES = """Every method runs inside the same `ShadowKVCache`: the same low-rank pre-RoPE keys (rank column; "exact" =
`Hkv*D`, i.e. keys rebuilt exactly), outlier chunks (`max(4, 0.3% of S/c)` per head), 32-token local window and
host value store; only the selection policy and `sparse_budget` (tokens selected per KV head, per layer and step,
on top of outliers, local window and generated tokens) change. Methods: `full` = the model's own `DynamicCache`;
`shadowkv` = landmark top-k (`LandmarkTopK`); `quest` = per-chunk min/max bound; `streaming_llm` = first chunk +
most recent chunks (evicting); `snapkv` = chunks voted by the last 32 prompt queries (evicting); `oracle` =
top-k by exact attention mass (upper bound for chunk selection). `yakv` runs in its own cache (`mode="yakv"`, own
prefill): 4-bit keys and values on the host, tokens (not chunks) chosen from 2-bit keys on the device, the last
64 prompt tokens exact; its rank and chunk columns do not apply, and its recall and oracle recall are over tokens
(the oracle being the best `budget` tokens), so compare them with the chunk methods' at equal budget with care.

- accuracy: the task's score in [0, 1], averaged over samples (and turns); for `fidelity`, teacher-forced top-1
  agreement with full attention on natural text (plus `mean_kl`, `greedy_match`).
- recall: exact softmax attention mass (over the selectable chunks) on the selected chunks, averaged over
  layers, query heads, query tokens and decode steps; `oracle_recall`: the same for the best chunks at the same
  budget (so `recall <= oracle_recall`; 1 = all the mass the budget could hold).
- h2d_kib_per_step: host-to-device bytes per decode step and sequence, all layers, from the temporal cache's
  misses: missed chunks x c x D x dtype bytes, values only, since keys are rebuilt on the device from the
  low-rank factors. A method that offloaded exact keys as well would move twice as much. For `full`, the bytes
  of the whole K and V, which an offloaded full cache would move at every step. For `yakv`: the quantised key
  and value records read (`2*(D/2) + 4` bytes per token and KV head, whatever the model dtype), the selected
  tokens at every step (no temporal cache), the whole prompt on multi-token steps.
- Multi-token steps after the prompt (a later chat turn) read every chunk for the offloading methods (the
  package default `dense_multi_token_steps=True`; counted in h2d as the whole prompt's values), while the
  evicting methods (StreamingLLM, SnapKV) keep their prefill-time selection at every step: after the first step
  they move nothing, and what they dropped is lost for good (multi-turn's later turns). recall is measured on
  the single-token (selecting) steps.
- Samples are few (see `samples`): a difference of one answer is 1/samples of accuracy."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(PLANS), default="cpu")
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--tasks", nargs="+", help=f"subset of {['fidelity', *TASKS]}")
    parser.add_argument("--length", type=int, help="prompt tokens")
    parser.add_argument("--samples", type=int, help="samples per task")
    parser.add_argument("--budgets", type=int, nargs="+")
    parser.add_argument("--methods", nargs="+", help=f"subset of {list(METHODS)} (full attention always runs)")
    parser.add_argument("--no-sweeps", action="store_true", help="skip the rank / chunk-size / length sweeps")
    parser.add_argument("--fidelity-rows", type=int, help="natural-text windows of the fidelity task")
    parser.add_argument("--sweep-ranks", type=int, nargs="*", help="ranks of the sweep (default: the plan's)")
    parser.add_argument("--sweep-chunks", type=int, nargs="*", help="chunk sizes of the sweep (default: the plan's)")
    parser.add_argument(
        "--fidelity-lengths", type=int, nargs="*", help="other prompt lengths for fidelity (after --no-sweeps too)"
    )
    parser.add_argument("--out", help="results name (default accuracy_<model>_<mode>)")
    parser.add_argument("--replot", action="store_true", help="re-render the Markdown and plots of a stored run")
    parser.add_argument(
        "--update", action="store_true", help="rerun only --tasks and replace their rows in the stored results"
    )
    add_results_dir_option(parser)
    args = parser.parse_args()

    plan = copy.deepcopy(PLANS[args.mode])
    if args.length:
        plan.length = args.length
    if args.samples:
        plan.samples = args.samples
    if args.budgets:
        plan.budgets = args.budgets
    if args.methods:
        unknown_methods = sorted(set(args.methods) - set(METHODS))
        if unknown_methods:
            parser.error(f"unknown method(s) {unknown_methods}; choose from {list(METHODS)}")
        plan.methods = args.methods
    if args.no_sweeps:
        plan.sweep_tasks, plan.extra_lengths = [], {}
    if args.fidelity_rows:
        plan.fidelity_rows = args.fidelity_rows
    if args.sweep_ranks is not None:
        plan.sweep_ranks = args.sweep_ranks
    if args.sweep_chunks is not None:
        plan.sweep_chunks = args.sweep_chunks
    if args.fidelity_lengths is not None:
        plan.extra_lengths = {**plan.extra_lengths, "fidelity": args.fidelity_lengths}
    tasks = args.tasks or ["fidelity", *plan.tasks]
    unknown = sorted(set(tasks) - {"fidelity", *TASKS})
    if unknown:
        parser.error(f"unknown task(s) {unknown}; choose from {['fidelity', *TASKS]}")
    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    torch.manual_seed(plan.seed)

    name = args.out or f"accuracy_{args.model}_{args.mode}"
    if args.replot:
        stored = json.loads((results_dir() / f"{name}.json").read_text())
        env = stored["env"]
        args.device, args.model, args.mode = env["device"], env["model"], env["mode"]
        report = Report(name, args, plan, env["dtype"], key_dim=max(r["rank"] for r in stored["rows"]))
        report.env, report.rows = env, []
        report.add(stored["rows"])
        return

    model, tokenizer = load_model(args.model, getattr(torch, dtype_name), args.device)
    runner = Runner(model, tokenizer, args.device, plan.chunk_overrides, plan.count_kept)
    limit = model.config.max_position_embeddings - 256
    work = [(t, plan.length) for t in tasks] + [(t, n) for t in tasks for n in plan.extra_lengths.get(t, [])]
    work = [(t, min(n, limit)) for t, n in work]
    report = Report(name, args, plan, dtype_name, runner.key_dim)
    if args.update and (results_dir() / f"{name}.json").exists():
        stored = json.loads((results_dir() / f"{name}.json").read_text())
        report.rows = [r for r in stored["rows"] if (r["task"], r["length"]) not in set(work)]
        report.earlier = stored["env"]
    with tqdm(total=sum(1 + len(configs_for(plan, t, n)) for t, n in work), desc="runs", file=sys.stdout) as bar:
        for task, length in work:
            bar.set_postfix_str(f"{task} @ {length}")
            run = run_fidelity if task == "fidelity" else functools.partial(run_task, task=task)
            new = run(runner, length=length, plan=plan, bar=bar)
            full = next(r for r in new if r["method"] == "full")
            tqdm.write(f"{task} @ {length} tokens: full attention {full['accuracy']:.3f} ({len(new)} rows)")
            report.add(new)  # written after every task, so a run cut short still leaves its results
    out = results_dir() / report.name
    print(f"Wrote {out}.json, .md, .png and {report.name}_recall.png ({report.minutes:.1f} min)")


class Report:
    """The run's rows, rewritten in full (JSON, Markdown, two plots) each time a task adds its rows."""

    COLUMNS = [
        "task",
        "length",
        "prompt_tokens",
        "method",
        "rank",
        "chunk",
        "budget",
        "accuracy",
        "recall",
        "oracle_recall",
    ]
    COLUMNS += ["h2d_kib_per_step", "h2d_bf16_kib", "h2d_bf16_measured_kib", "hit_rate", "first_turn", "later_turns"]
    COLUMNS += ["mean_kl", "greedy_match", "samples"]

    def __init__(self, name: str, args, plan: Plan, dtype_name: str, key_dim: int):
        self.name, self.args, self.plan, self.dtype_name, self.key_dim = name, args, plan, dtype_name, key_dim
        self.default_rank = ShadowKVConfig().resolve(10**6, key_dim).rank
        self.rows: list[dict] = []
        self.started = time.perf_counter()
        self.env: dict | None = None  # set when re-rendering a stored run
        self.earlier: dict | None = None  # the stored run's environment, when this run updates some of its rows

    @property
    def minutes(self) -> float:
        return self.env["minutes"] if self.env else round((time.perf_counter() - self.started) / 60, 1)

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            row["series"] = label(row, self.key_dim)
        self.rows += rows
        self.rows.sort(key=lambda r: (r["task"], r["length"], _series_order(r), r["budget"] if r["chunk"] else 0))
        self.write()

    def styles(self, rows: list[dict]) -> dict[str, dict]:
        """One colour per method; solid = exact keys, dashed = the default rank, dotted = other ranks."""
        colors = {"full": "black", **{m: f"C{i + (i >= 7)}" for i, m in enumerate(METHODS)}}
        markers = {16: "v", 64: "^", 96: "D", 128: "P"}
        out = {}
        for r in sorted(rows, key=_series_order):
            exact, default = r["rank"] >= self.key_dim, r["rank"] == self.default_rank
            ls = "-" if exact else "--" if default else ":"
            marker = "o" if exact else "s" if default else markers.get(r["rank"], "x")
            out.setdefault(r["series"], {"color": colors[r["method"]], "ls": ls, "marker": marker})
        return out

    def write(self) -> None:
        args, plan, name = self.args, self.plan, self.name
        at_length = [r for r in self.rows if r["length"] == plan.length]
        env = self.env or environment(args.device, self.dtype_name)
        env.update(model=args.model, mode=args.mode, minutes=self.minutes)
        if self.earlier:
            env["command"] = f"{self.earlier['command']} && {env['command']}"
            earlier_commit = self.earlier.get("commit") or "unrecorded"
            if earlier_commit != env["commit"]:  # the kept rows come from another commit
                env["commit"] = f"{earlier_commit} && {env['commit']}"
            env["dirty"] = bool(self.earlier.get("dirty") or env["dirty"])
            env["minutes"] = round(self.earlier["minutes"] + self.minutes, 1)
        notes = "\n\n".join(
            [
                *([plan.notes] if plan.notes else []),
                NOTES,
                summary_tables(at_length, plan.default_budget),
                f"Wall time of the run: {env['minutes']} min. Plots: `{name}.png` (accuracy) and "
                f"`{name}_recall.png` (selection recall) against the budget, one panel per task; `{name}_bytes.png` "
                "(mass covered against bf16 host-to-device bytes per step, exact keys, with the oracles).",
                "### All rows",
            ]
        )
        write_results(name, f"Accuracy benchmark, {args.model}", env, self.rows, self.COLUMNS, None, notes=notes)

        plotted = [r for r in at_length if r["chunk"] in ("", 8)]
        title = f"{args.model} ({self.dtype_name}, {args.device}), ~{plan.length}-token prompts"
        common = dict(facet="task", series="series", x="budget", logx=True, styles=self.styles(plotted))
        accuracy = dict(common, y="accuracy", reference="full attention")
        plot_facets(name, f"Accuracy vs sparse budget, {title}", plotted, accuracy)
        recall = [r for r in plotted if r["method"] != "full"]
        if recall:
            plot = dict(common, y="recall", ylabel="selection recall")
            plot_facets(f"{name}_recall", f"Selection recall vs sparse budget, {title}", recall, plot)
            self.write_bytes_plot(recall, title)

    # The oracle of each selection kind, read from the rows of the method named here.
    ORACLES = {"shadowkv": "chunk oracle", "yakv": "token oracle", "yakv_shared": "shared token oracle (Hkv*k)"}

    def write_bytes_plot(self, rows: list[dict], title: str) -> None:
        """`<name>_bytes.png`: attention mass covered against the bf16 bytes the budget moves per step, one line per
        method (exact keys only, so ShadowKV's selection is what is compared) and per oracle."""
        rows = [r for r in rows if r["rank"] >= self.key_dim and isinstance(r.get("h2d_bf16_kib"), (int, float))]
        if not rows:
            return
        lines = [dict(r, series=r["method"]) for r in rows]
        lines += [
            dict(r, series=self.ORACLES[r["method"]], recall=r["oracle_recall"])
            for r in rows
            if r["method"] in self.ORACLES
        ]
        styles = {
            m: {"color": f"C{i + (i >= 7)}", "ls": "-", "marker": "o"} for i, m in enumerate(METHODS)
        }  # C7: oracles
        for oracle, ls in zip(self.ORACLES.values(), ("-.", ":", "--")):
            styles[oracle] = {"color": "gray", "ls": ls, "marker": ""}
        plot = dict(facet="task", series="series", x="h2d_bf16_kib", y="recall", logx=True, styles=styles)
        plot["ylabel"] = "exact attention mass covered"
        top = max(r["h2d_bf16_kib"] for r in lines)
        plot["xticks"] = [
            2**i for i in range(16) if 2**i >= min(r["h2d_bf16_kib"] for r in lines) / 2 and 2**i <= top * 2
        ]
        plot["panel_size"] = (7.5, 4.5)
        plot_facets(f"{self.name}_bytes", f"Mass covered vs host-to-device KiB per step (bf16), {title}", lines, plot)


if __name__ == "__main__":
    main()
