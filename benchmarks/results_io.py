"""Recording benchmark results: JSON (with the commit, command, environment variables, machine and versions), a
Markdown table and a plot, in `benchmarks/results/` or the folder a script's `--results-dir` names."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

import shadowkv_cache

RESULTS = Path(__file__).resolve().parent / "results"  # where results are kept in the repository
_REPO = Path(__file__).resolve().parents[1]
_results_dir = RESULTS

# Environment variables that change what a run does or how fast, recorded when set.
ENV_PREFIXES = ("SHADOWKV_", "TRANSFORMERS_", "PYTORCH_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH")
# Keys of `environment()` that the Markdown shows on their own lines rather than in the "Environment:" line.
_PROVENANCE = ("command", "commit", "dirty", "env_vars")


def results_dir() -> Path:
    """The folder results are read from and written to (`benchmarks/results/` unless `--results-dir` changed it)."""
    return _results_dir


def set_results_dir(path: str | os.PathLike) -> None:
    global _results_dir
    _results_dir = Path(path)


class _ResultsDir(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        set_results_dir(values)
        setattr(namespace, self.dest, Path(values))


def add_results_dir_option(parser: argparse.ArgumentParser) -> None:
    """`--results-dir DIR`: read and write results in DIR instead of `benchmarks/results/` (e.g. a check run)."""
    parser.add_argument(
        "--results-dir",
        action=_ResultsDir,
        default=RESULTS,
        metavar="DIR",
        help="where results are read and written (default: benchmarks/results)",
    )


def command_line() -> str:
    """The command as run: `python -m benchmarks.<script> ...` (the interpreter's name, not its path)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    return shlex.join([Path(argv[0]).name, *argv[1:]])


@functools.cache
def git_state() -> tuple[str | None, bool | None]:
    """`(commit, dirty)` of the repository the benchmarks run from, once per process (before any result is written);
    dirty: tracked or untracked changes outside `benchmarks/results/`. `(None, None)` outside a git checkout.

    A copy of the tree on another machine may carry a stale `.git`: there `SHADOWKV_SOURCE_COMMIT` names the commit the
    tree was copied from (`git rev-parse HEAD` where it was made, with no uncommitted changes), and that is recorded.
    """
    given = os.environ.get("SHADOWKV_SOURCE_COMMIT")
    if given:
        return given, False

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changes = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return commit, bool(changes.strip())


def env_vars() -> dict[str, str]:
    """The set environment variables that change behaviour (`ENV_PREFIXES`, `ENV_NAMES`), sorted by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def environment(device: str, dtype: str) -> dict:
    """Commit, command line, environment variables, machine and versions, recorded beside every result."""
    commit, dirty = git_state()
    env = {
        "command": command_line(),
        "commit": commit,
        "dirty": dirty,
        "env_vars": env_vars(),
        "python": platform.python_version(),
        "shadowkv_cache": shadowkv_cache.__version__,
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


def provenance_lines(env: dict) -> list[str]:
    """Markdown lines: the environment, then (when recorded) environment variables and commit, then the command."""
    lines = ["Environment: " + ", ".join(f"{k}={v}" for k, v in env.items() if k not in _PROVENANCE), ""]
    if "env_vars" in env:
        shown = ", ".join(f"{k}={v}" for k, v in env["env_vars"].items()) or "none of those that change behaviour"
        lines += [f"Environment variables: {shown}", ""]
    if env.get("commit"):
        lines += [f"Commit: `{env['commit']}`" + (" with uncommitted changes" if env.get("dirty") else ""), ""]
    return lines + [f"Command: `{env['command']}`", ""]


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
    """Write `<results dir>/<name>.json`, `.md` and `.png` (one line per `plot['series']` value; no plot if `None`).

    `notes` (Markdown) goes above the table; `extra` is stored in the JSON beside the rows. The plot draws `rows`, or
    `plot['rows']` where the points are not the table's rows.
    """
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    data = {"title": title, "env": env, "rows": rows, **(extra or {})}
    _atomic_write(out / f"{name}.json", json.dumps(data, indent=1).encode())
    lines = [f"# {title}", ""] + ([notes, ""] if notes else []) + markdown_table(rows, columns)
    lines += ["", *provenance_lines(env)]
    _atomic_write(out / f"{name}.md", "\n".join(lines).encode())
    if plot is None:
        return

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    points = plot.get("rows", rows)
    numeric = [r for r in points if all(isinstance(r.get(plot[k]), (int, float)) for k in ("x", "y"))]
    for series in sorted({r[plot["series"]] for r in numeric}):
        pts = sorted((r[plot["x"]], r[plot["y"]]) for r in numeric if r[plot["series"]] == series)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{plot['series']}={series}")
    ax.set_xlabel(plot["x"])
    ax.set_ylabel(plot.get("ylabel", plot["y"]))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = results_dir() / f".{name}.png.tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, results_dir() / f"{name}.png")
    plt.close(fig)


def plot_facets(name: str, title: str, rows: list[dict], plot: dict) -> None:
    """Write `<results dir>/<name>.png`: one panel per value of `plot['facet']`, one line per `plot['series']` value.

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
    tmp = results_dir() / f".{name}.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, results_dir() / f"{name}.png")
    plt.close(fig)
