"""One task, or the fidelity measure, at one prompt length: full attention first, then every setting of the plan
from one prefill per group of settings; one row per setting.

Legend: B batch (samples of one task, left-padded), S prompt tokens, N continuation tokens, V vocabulary.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict

import torch
from transformers import DynamicCache

from benchmarks.accuracy_core import answer_turns, left_pad, prefill, render_segments, teacher_forced
from benchmarks.accuracy_plans import Plan, configs_for, rank_rule
from benchmarks.accuracy_runner import Runner, summarise_stats
from benchmarks.tasks import TASKS
from shadowkv_cache.fidelity import natural_text_ids

__all__ = ["run_fidelity", "run_task"]


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
            row.update(method=key.method, rank=t["rank"], rank_rule=rank_rule(key), chunk=key.chunk, budget=key.budget)
            row.update(summarise_stats(t))
        rows.append(row)
    return rows


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
            row["rank_rule"] = rank_rule(cfg)
            row.update(budget=cfg.budget, length=length, prompt_tokens=length, samples=rows_n, accuracy=agreement)
            row.update(mean_kl=kl, greedy_match=match, seconds=round(time.perf_counter() - start, 1))
            row.update(summarise_stats(stats))
            out.append(row)
            bar.update(1)
        del base
    return out
