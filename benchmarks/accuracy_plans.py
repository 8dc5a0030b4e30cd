"""The accuracy benchmark's plans: what each `--mode` measures (tasks, length, samples, budgets, sweeps), and the
(method, rank, chunk size, budget) settings a task runs at.

Legend: S prompt tokens, Hkv KV heads, D head dim, c chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.methods import EXTENSIONS, METHODS
from shadowkv_cache import ShadowKVConfig

__all__ = ["PLANS", "Config", "Plan", "configs_for", "default_budget", "plan_methods", "rank_rule"]


@dataclass
class Plan:
    """What one run measures. Every method runs with exact keys (rank `Hkv*D`: the selection alone), and the
    `default_rank_methods` also at the default rank (`rank="auto"`: ShadowKV as shipped, each layer's own rank)."""

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
    budget: int | None = None  # the budget of the non-budget tasks; None: the package default at `length`
    seed: int = 0
    methods: list[str] | None = None  # None: every method but the YAKV extensions
    chunk_overrides: dict = field(default_factory=dict)  # config changes for the ShadowKV-mode methods
    count_kept: bool = False  # recall over all offloaded units, outliers counted as covered (SelectionProbe)
    notes: str = ""  # what the plan changes, for the report


def plan_methods(plan: Plan) -> list[str]:
    return plan.methods or [m for m in METHODS if m not in EXTENSIONS]


def default_budget(plan: Plan, length: int | None = None) -> int:
    """Tokens per KV head the package selects by default for a `length`-token prompt (the plan's length unless
    given): `max(2048, 1.5625% of S)`, at most `S/4`, in whole chunks; or the plan's fixed `budget`."""
    if plan.budget is not None:
        return plan.budget
    config = ShadowKVConfig(min_compress_len=1)  # the runs compress shorter prompts than the package would
    return config.resolve(length or plan.length, 1).budget_chunks * config.chunk_size


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
        budget=256,
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
    rank: int | str | None  # None = the default (rank="auto"), "full" = Hkv*D (exact keys)
    chunk: int
    budget: int


def rank_rule(cfg: Config) -> str:
    """How a setting's keys were factorised: "auto" (the default), "exact" (rank Hkv*D) or "fixed" (a given rank)."""
    return "auto" if cfg.rank is None else "exact" if cfg.rank == "full" else "fixed"


def configs_for(plan: Plan, task: str, length: int) -> list[Config]:
    """The (method, rank, chunk size, budget) settings run on `task` at `length` (full attention comes on top)."""
    default = default_budget(plan, length)
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
