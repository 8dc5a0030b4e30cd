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


def write_results(name: str, title: str, env: dict, rows: list[dict], columns: list[str], plot: dict | None) -> None:
    """Write `results/<name>.json`, `.md` and `.png` (one line per `plot['series']` value; no plot if `None`)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    _atomic_write(RESULTS / f"{name}.json", json.dumps({"title": title, "env": env, "rows": rows}, indent=1).encode())
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
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
