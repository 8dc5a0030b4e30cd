"""The throughput benchmark's record: rows written after each measurement (JSON, Markdown), the plot, and the
summary rows (each method's best tokens/s per context against this run's baselines), also for a stored run.

Legend: h hit rate.
"""

from __future__ import annotations

import json

from benchmarks.results_io import results_dir, write_results
from benchmarks.speed import log

TITLE = "Decode throughput: ShadowKV vs full attention (Llama-3.1-8B shape, random bf16)"


class Recorder:
    COLUMNS = ["context", "method", "value_format", "landmark_format", "fill", "batch", "h_target", "hit_rate",
               "tok_s", "step_ms", "peak_gpu_gib", "held_gpu_gib", "built_gpu_gib", "cache_gpu_gib", "host_gib",
               "gpu_bytes_per_seq_gib", "prefill_s", "compress_share", "bound_ms", "note"]  # fmt: skip

    def __init__(self, name, env):
        self.name, self.env, self.rows = name, env, []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        log("RESULT", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
        self.write(plot=False)

    def write(self, plot=True) -> None:
        try:
            write_results(self.name, TITLE, self.env, self.rows, self.COLUMNS, None)
            if plot:
                self.plot(TITLE)
        except Exception as err:  # never lose a run to a plotting problem
            log("could not write results:", err)

    def plot(self, title) -> None:
        """Best decode tokens/s per method and context (ShadowKV at each hit rate), log scale."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        series: dict[str, dict[int, float]] = {}
        for r in self.rows:
            if (
                not isinstance(r.get("tok_s"), (int, float))
                or r["method"] == "summary"
                or r.get("fill") == "real prefill"
            ):
                continue
            label = r["method"]
            if r["method"] == "shadowkv":
                label += f" {variant_label(r.get('value_format'), r.get('landmark_format'))} h={r['h_target']}"
            elif r["method"] == "yakv" and r.get("value_format") not in (None, "higgs4 k+v"):
                label += f" ({r['value_format']})"
            best = series.setdefault(label, {})
            best[r["context"]] = max(best.get(r["context"], 0.0), r["tok_s"])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, pts in sorted(series.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s at best batch")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(results_dir() / f"{self.name}.png", dpi=120)
        plt.close(fig)


def variant_label(value_format: str | None, landmark_format: str | None) -> str:
    """`higgs4`, or `higgs4, int8 landmarks` for other than the native landmarks (rows without a landmark format were
    recorded before it existed: native)."""
    return f"{value_format}" if landmark_format in (None, "native") else f"{value_format}, {landmark_format} landmarks"


def variant_of(row: dict) -> tuple[str | None, str]:
    """A ShadowKV row's (value format, landmark format)."""
    return row.get("value_format"), row.get("landmark_format") or "native"


def add_summary(rec: Recorder, contexts: list[int], variants: list[tuple[str, str]], h_sweep: float) -> None:
    """Summary rows: each method's best tokens/s per context as ratios to this run's baselines (the best
    DynamicCache batch, the full-attention roofline, and for YAKV the best ShadowKV batch per variant); ShadowKV per
    (value format, landmark format) variant."""
    rec.rows = [r for r in rec.rows if r["method"] != "summary"]
    for length in contexts:
        dynamic = [
            r
            for r in rec.rows
            if r["context"] == length
            and r["method"] == "dynamic"
            and r.get("fill") == "synthetic"
            and isinstance(r.get("tok_s"), float)
        ]
        dyn = max(dynamic, key=lambda r: r["tok_s"], default=None)
        roof = [r for r in rec.rows if r["context"] == length and r["method"] == "full-attention roofline"]
        roof_best = max(roof, key=lambda r: r["tok_s"], default=None)  # its best batch: the largest that fits
        tops = {}
        yakv_labels = dict.fromkeys(r.get("value_format") for r in rec.rows if r["method"] == "yakv")
        for method, variant in [("shadowkv", v) for v in variants] + [("yakv", label) for label in yakv_labels]:
            rows = [
                r
                for r in rec.rows
                if r["context"] == length
                and r["method"] == method
                and r.get("fill") == "synthetic"
                and (
                    r.get("value_format") == variant
                    if method == "yakv"
                    else (variant_of(r) == variant and r.get("h_target") == h_sweep)
                )
            ]
            if not rows:
                continue
            top = tops[(method, variant)] = max(rows, key=lambda r: r["tok_s"])
            notes = []
            if dyn:
                notes.append(f"x{top['tok_s'] / dyn['tok_s']:.2f} vs DynamicCache best")
                notes[-1] += f" ({dyn['tok_s']:.1f} tok/s at batch {dyn['batch']})"
            if roof_best:
                notes.append(f"x{top['tok_s'] / roof_best['tok_s']:.2f} vs roofline at its best batch")
                notes[-1] += f" ({roof_best['tok_s']:.1f})"
            if method == "yakv":
                notes += [f"x{top['tok_s'] / t['tok_s']:.2f} vs ShadowKV {variant_label(*v)} best ({t['tok_s']:.1f})"
                          for (m, v), t in tops.items() if m == "shadowkv"]  # fmt: skip
            if method == "yakv":
                who = method if variant == "higgs4 k+v" else f"{method} ({variant})"
            else:
                who = method if variant[1] == "native" else f"{method} ({variant[1]} landmarks)"
            if notes:
                rec.add(dict(context=length, method="summary", value_format=top.get("value_format"),
                             landmark_format=top.get("landmark_format"), batch=top["batch"],
                             h_target=top.get("h_target"), tok_s=top["tok_s"],
                             note=f"{who}: " + "; ".join(notes)))  # fmt: skip


def replot(name: str, h_sweep: float, note: str | None) -> None:
    """Summary rows and plot of a stored run from its rows alone (a run cut short never wrote them)."""
    stored = json.loads((results_dir() / f"{name}.json").read_text())
    env = stored["env"]
    if note:
        env["note"] = note
    rec = Recorder(name, env)
    rec.rows = stored["rows"]
    contexts = sorted({r["context"] for r in rec.rows})
    found = list(dict.fromkeys(variant_of(r) for r in rec.rows if r["method"] == "shadowkv" and "value_format" in r))
    add_summary(rec, contexts, found, h_sweep)
    rec.write(plot=True)
