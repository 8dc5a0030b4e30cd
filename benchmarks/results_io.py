"""Recording benchmark results: JSON (with machine, versions and command), a Markdown table and a plot."""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import transformers

RESULTS = Path(__file__).resolve().parent / "results"


def environment(device: str, dtype: str) -> dict:
    """Machine, versions and the command line, recorded beside every result."""
    env = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "device": device,
        "dtype": dtype,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]


def write_results(
    name: str,
    title: str,
    env: dict,
    rows: list[dict],
    columns: list[str],
    plot: dict | None,
    notes: str = "",
    extra: dict | None = None,
) -> None:
    """Write `results/<name>.json`, `.md` and `.png` (one line per `plot['series']` value; no plot if `None`).

    `notes` (Markdown) goes above the table; `extra` is stored in the JSON beside the rows.
    """
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"title": title, "env": env, "rows": rows, **(extra or {})}
    _atomic_write(RESULTS / f"{name}.json", json.dumps(data, indent=1).encode())
    lines = [f"# {title}", ""] + ([notes, ""] if notes else []) + markdown_table(rows, columns)
    lines += [
        "",
        "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items() if k != "command"),
        "",
        f"Command: `{env['command']}`",
        "",
    ]
    _atomic_write(RESULTS / f"{name}.md", "\n".join(lines).encode())
    if plot is None:
        return

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    numeric = [r for r in rows if all(isinstance(r.get(plot[k]), (int, float)) for k in ("x", "y"))]
    for series in sorted({r[plot["series"]] for r in numeric}):
        pts = sorted((r[plot["x"]], r[plot["y"]]) for r in numeric if r[plot["series"]] == series)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{plot['series']}={series}")
    ax.set_xlabel(plot["x"])
    ax.set_ylabel(plot.get("ylabel", plot["y"]))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = RESULTS / f".{name}.png.tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, RESULTS / f"{name}.png")
    plt.close(fig)


def plot_facets(name: str, title: str, rows: list[dict], plot: dict) -> None:
    """Write `results/<name>.png`: one panel per value of `plot['facet']`, one line per `plot['series']` value.

    `plot['reference']` (a series value whose x is not a number, e.g. full attention) is drawn in each panel as
    a dashed horizontal line; `plot['logx']` puts x on a log2 scale; `plot['styles']` maps a series to its
    matplotlib `color` / `ls` / `marker` (so that two figures of one run draw a series alike) and sets the
    legend order. `plot['xticks']` (with `logx`) replaces the default ticks (every x of the panel);
    `plot['panel_size']` is a panel's `(width, height)` in inches (default `(3.6, 2.9)`).
    """
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facets = list(dict.fromkeys(r[plot["facet"]] for r in rows))
    ncols = min(4, len(facets))
    nrows = math.ceil(len(facets) / ncols)
    width, height = plot.get("panel_size", (3.6, 2.9))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    styles = plot.get("styles", {})
    present = {r[plot["series"]] for r in rows}
    series_names = [s for s in styles if s in present]
    series_names += [s for s in dict.fromkeys(r[plot["series"]] for r in rows) if s not in styles]
    style = {
        s: {"color": f"C{i % 10}", "ls": "-", "marker": "o", **styles.get(s, {})} for i, s in enumerate(series_names)
    }
    for ax, facet in zip(axes.flat, facets):
        mine = [r for r in rows if r[plot["facet"]] == facet and isinstance(r.get(plot["y"]), (int, float))]
        for series in series_names:
            pts = sorted(
                (r[plot["x"]], r[plot["y"]])
                for r in mine
                if r[plot["series"]] == series and isinstance(r.get(plot["x"]), (int, float))
            )
            if series == plot.get("reference"):
                for r in mine:
                    if r[plot["series"]] == series:
                        ax.axhline(r[plot["y"]], color=style[series]["color"], ls="--", lw=1, label=str(series))
                        break
            elif pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=3, lw=1.2, label=series, **style[series])
        ax.set_title(str(facet), fontsize=9)
        if plot.get("logx"):
            ax.set_xscale("log", base=2)
            xs = plot.get("xticks") or sorted(
                {r[plot["x"]] for r in mine if isinstance(r.get(plot["x"]), (int, float))}
            )
            if xs:
                ax.set_xticks(xs, [str(x) for x in xs])
                ax.minorticks_off()
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(facets) :]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel(plot["x"], fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(plot.get("ylabel", plot["y"]), fontsize=8)
    legend: dict[str, object] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    handles, labels = list(legend.values()), list(legend)
    ncol = min(4, len(labels))
    legend_rows = math.ceil(len(labels) / ncol) if labels else 0
    bottom = 0.25 * legend_rows / (height * nrows + 0.25 * legend_rows)
    fig.set_size_inches(fig.get_figwidth(), height * nrows + 0.25 * legend_rows + 0.4)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, bottom + 0.01, 1, 0.97))
    tmp = RESULTS / f".{name}.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, RESULTS / f"{name}.png")
    plt.close(fig)
