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

This module holds the arguments and the run; the plans are in `accuracy_plans.py`, the caches and byte counts of
each setting in `accuracy_runner.py`, one task or fidelity at one length in `accuracy_runs.py`, the report and
`--replot` in `accuracy_report.py`, prompt rendering and turn-by-turn answers in `accuracy_core.py`.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import sys

import torch
from tqdm import tqdm

from benchmarks.accuracy_plans import PLANS, Plan, configs_for
from benchmarks.accuracy_report import Report, replot
from benchmarks.accuracy_runner import MODELS, Runner, load_model
from benchmarks.accuracy_runs import run_fidelity, run_task
from benchmarks.methods import METHODS
from benchmarks.results_io import add_results_dir_option, results_dir
from benchmarks.tasks import TASKS


def parse_args() -> tuple[argparse.Namespace, Plan, list[str]]:
    """The arguments, the plan they select and change, and the tasks to run (errors exit with a usage message)."""
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
    parser.add_argument("--sweep-tasks", nargs="*", help="tasks the rank / chunk sweeps run on (default: fidelity)")
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
    if args.sweep_tasks is not None:
        plan.sweep_tasks = args.sweep_tasks
    if args.fidelity_lengths is not None:
        plan.extra_lengths = {**plan.extra_lengths, "fidelity": args.fidelity_lengths}
    tasks = args.tasks or ["fidelity", *plan.tasks]
    unknown = sorted(set(tasks) - {"fidelity", *TASKS})
    if unknown:
        parser.error(f"unknown task(s) {unknown}; choose from {['fidelity', *TASKS]}")
    return args, plan, tasks


def main() -> None:
    args, plan, tasks = parse_args()
    dtype_name = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    torch.manual_seed(plan.seed)
    name = args.out or f"accuracy_{args.model}_{args.mode}"
    if args.replot:
        replot(name, args, plan)
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


if __name__ == "__main__":
    main()
