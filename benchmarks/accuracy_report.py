"""The accuracy benchmark's report: rows, the Markdown (notes, summary tables, all rows) and the plots, rewritten in
full each time a task adds its rows; also re-rendered from a stored run (`--replot`).

Legend: Hkv KV heads, D head dim, c chunk size.
"""

from __future__ import annotations

import json
import time

from benchmarks.accuracy_plans import Plan, default_budget
from benchmarks.methods import METHODS, MODE_CHANGES
from benchmarks.results_io import environment, markdown_table, plot_facets, results_dir, write_results

__all__ = ["Report", "replot"]


def label(row: dict, key_dim: int) -> str:
    """Series name: the method, its keys (exact or the rank) and a chunk size other than 8."""
    if row["method"] == "full":
        return "full attention"
    if row["method"] in MODE_CHANGES:
        return f"{row['method']} (4-bit K/V, token top-k)"
    suffix = "" if row["chunk"] == 8 else f", c={row['chunk']}"
    if row.get("rank_rule") == "auto":
        keys = "rank auto"
    else:
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
    auto = row.get("rank_rule") == "auto"
    rank = -row["rank"] if not auto else 0
    return (methods.index(row["method"]), auto, rank, row["chunk"] if isinstance(row["chunk"], int) else 0)


NOTES = """Every method runs inside the same `ShadowKVCache`: the same low-rank pre-RoPE keys (rank column; "exact" =
`Hkv*D`, i.e. keys rebuilt exactly; "rank auto" = the package default `rank="auto"`, each layer's own rank, the `rank`
column then holding the mean over layers), outlier chunks (`max(4, 0.3% of S/c)` per head), 32-token local window and
host value store; only the selection policy and `sparse_budget` (tokens selected per KV head, per layer and step, on top
of outliers, local window and generated tokens) change. Methods: `full` = the model's own `DynamicCache`; `shadowkv` =
landmark top-k (`LandmarkTopK`); `quest` = per-chunk min/max bound; `streaming_llm` = first chunk + most recent chunks
(evicting); `snapkv` = chunks voted by the last 32 prompt queries (evicting); `oracle` = top-k by exact attention mass
(upper bound for chunk selection). `yakv` runs in its own cache (`mode="yakv"`, own prefill): 4-bit keys and values on
the host, tokens (not chunks) chosen from 2-bit keys on the device, the last 64 prompt tokens exact; its rank and chunk
columns do not apply, and its recall and oracle recall are over tokens (the oracle being the best `budget` tokens), so
compare them with the chunk methods' at equal budget with care.

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
  tokens the previous step did not hold, the whole prompt on multi-token steps.
- h2d_bf16_kib: the nominal bytes of one step without reuse (every selected chunk's values in bf16; for `yakv`
  every selected token's record), the x axis of the bytes plot; h2d_bf16_measured_kib: h2d_kib_per_step with
  values counted in bf16; hit_rate: selected chunks (`yakv`: tokens) found on the device from the previous step.
- Multi-token steps after the prompt (a later chat turn) read every chunk for the offloading methods (the
  package default `dense_multi_token_steps=True`; counted in h2d as the whole prompt's values), while the
  evicting methods (StreamingLLM, SnapKV) keep their prefill-time selection at every step: after the first step
  they move nothing, and what they dropped is lost for good (multi-turn's later turns). recall is measured on
  the single-token (selecting) steps.
- Samples are few (see `samples`): a difference of one answer is 1/samples of accuracy."""


class Report:
    """The run's rows, rewritten in full (JSON, Markdown, two plots) each time a task adds its rows."""

    COLUMNS = [
        "task",
        "length",
        "prompt_tokens",
        "method",
        "rank",
        "rank_rule",
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
        """One colour per method; solid = exact keys, dashed = the default rank (auto), dotted = other ranks."""
        colors = {"full": "black", **{m: f"C{i + (i >= 7)}" for i, m in enumerate(METHODS)}}
        markers = {16: "v", 64: "^", 96: "D", 128: "P"}
        out = {}
        for r in sorted(rows, key=_series_order):
            default = r.get("rank_rule") == "auto"
            exact = r["rank"] >= self.key_dim and not default
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
                summary_tables(at_length, default_budget(plan)),
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


def replot(name: str, args, plan: Plan) -> None:
    """Re-render the Markdown and plots of the stored run `name` (its device, model and mode come from the record)."""
    stored = json.loads((results_dir() / f"{name}.json").read_text())
    env = stored["env"]
    args.device, args.model, args.mode = env["device"], env["model"], env["mode"]
    report = Report(name, args, plan, env["dtype"], key_dim=max(r["rank"] for r in stored["rows"]))
    report.env, report.rows = env, []
    report.add(stored["rows"])
