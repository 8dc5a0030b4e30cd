"""Where a kernel's warps wait: Nsight Compute's stall reasons and its per-instruction samples, per source tree.

A kernel that reads at a fraction of HBM bandwidth may be bound by issuing instructions (then fewer instructions pay,
`benchmarks/kernel_sass.py`) or by waiting (then they may not: YAKV's code pass issued 16% fewer and took 28% longer
when each of its tiles waited on a load per token, docs/results.md). This runs `ncu` on one launch of the kernels
matching `--kernel` while `python -m MODULE ARGS...` runs (the words after `--`), once per side (`--sides
label=DIR,...`: each tree's `src` first on the path and its own kernel cache, as `benchmarks/ab.py` runs a side;
default: this tree), and records for each side:

- the launch's duration, DRAM throughput, instructions executed and issued per scheduler and cycle, and each stall
  reason in cycles per issued instruction (the printed report: `--print-details all`);
- the warp-stall samples by opcode from the source page (SASS), all samples and long-scoreboard ones, beside the
  instructions executed (the `--top` opcodes with the most samples, in the Markdown; all in the JSON).

`--keep DIR` keeps each side's printed report (`<label>.txt`) and source page (`<label>.csv`); `--reports DIR` reads
such a folder instead of running `ncu` (no GPU needed), e.g. reports made on another machine, which `--made-on` then
names (the machine, versions and command: the record's environment is the reading machine's).

    python -m benchmarks.ncu_stalls --kernel regex:code_states_mma --sides base=DIR,new=. --launch-skip 2 \\
        --name scoring_ncu_128k_b22 -- benchmarks.scoring --device cuda --contexts 131072 --batches 22
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.ab import side_env
from benchmarks.results_io import add_results_dir_option, environment, markdown_table, write_results
from benchmarks.speed import log

# The printed report's metrics kept for each side (first occurrence), under the record's names.
SUMMARY = {
    "Duration": "duration_us",
    "DRAM Throughput": "dram_pct",
    "Executed Instructions": "instructions",
    "Issued Warp Per Scheduler": "issued_per_scheduler",
    "No Eligible": "no_eligible_pct",
    "Warp Cycles Per Issued Instruction": "cycles_per_issue",
}
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
# A metric line of the printed report: name, an optional unit, a value ("1,234.5", "0.66", "-").
_LINE = re.compile(r"^\s+(?P<name>\S(?:.*?\S)?)\s{2,}(?:(?P<unit>\S+)\s+)?(?P<value>-?[\d,]+(?:\.\d+)?)\s*$")


def summary_metrics(report: str) -> dict:
    """The kept metrics of a printed report (`ncu --print-details all`) and its stall reasons (`stall_<reason>`,
    cycles per issued instruction), each at its first occurrence; the duration in microseconds."""
    out: dict = {}
    for line in report.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, unit, value = m["name"], m["unit"], float(m["value"].replace(",", ""))
        if name in SUMMARY and SUMMARY[name] not in out:
            key = SUMMARY[name]
            if key == "duration_us":
                if unit not in _TO_US:
                    raise SystemExit(f"ncu_stalls: the report's duration has an unknown unit {unit!r}: {line.strip()}")
                value *= _TO_US[unit]
            out[key] = int(value) if key == "instructions" else value
        elif name.startswith("Stall ") and unit == "inst":
            out.setdefault("stall_" + name[6:].lower().replace(" ", "_"), value)
    missing = [k for k in SUMMARY.values() if k not in out]
    if missing:
        raise SystemExit(f"ncu_stalls: the printed report has no {missing}; was it made with --print-details all?")
    return out


def opcode_samples(source_csv: str) -> list[dict]:
    """Warp-stall samples by opcode from a source page (`ncu --page source --csv --print-source sass`): `opcode`,
    `samples`, `long_scoreboard` (samples) and `executed` (warp instructions), most samples first."""
    lines = source_csv.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise SystemExit('ncu_stalls: the source page has no header row ("Address", "Source", ...)')
    table = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    for column in ("Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "Instructions Executed"):
        if column not in (table.fieldnames or []):
            raise SystemExit(f"ncu_stalls: the source page has no column {column!r}; give ncu --section SourceCounters")
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in table:
        words = row["Source"].split()
        if not words:
            continue
        op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]
        totals[op]["samples"] += int(row["Warp Stall Sampling (All Samples)"] or 0)
        totals[op]["long_scoreboard"] += int(row["stall_long_sb"] or 0)
        totals[op]["executed"] += int(row["Instructions Executed"] or 0)
    rows = [{"opcode": op, **{k: c[k] for k in ("samples", "long_scoreboard", "executed")}} for op, c in totals.items()]
    return sorted(rows, key=lambda r: (-r["samples"], r["opcode"]))


def run_side(root: Path, kernel: str, skip: int, count: int, module_args: list[str], keep: Path, label: str) -> None:
    """Profile `python -m module_args...` from `root` under ncu; writes `<keep>/<label>.txt` and `.csv`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = side_env(root, Path(tmp) / "kernels")
        report = Path(tmp) / "report"
        command = ["ncu", "--clock-control", "none", "-k", kernel, "--launch-skip", str(skip), "--launch-count",
                   str(count), "--section", "SpeedOfLight", "--section", "WarpStateStats", "--section",
                   "SchedulerStats", "--section", "SourceCounters", "--section", "InstructionStats", "--import-source",
                   "no", "--export", str(report), "-f", sys.executable, "-m", *module_args]  # fmt: skip
        log(f"{label}: {' '.join(command)} (from {root})")
        if subprocess.run(command, cwd=root, env=env).returncode:
            raise SystemExit(f"ncu_stalls: ncu failed for side {label!r}; its output is above.")
        rep = f"{report}.ncu-rep"
        pages = {"txt": ["--print-details", "all"], "csv": ["--page", "source", "--csv", "--print-source", "sass"]}
        for ext, args in pages.items():
            done = subprocess.run(["ncu", "--import", rep, *args], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"ncu_stalls: ncu --import {' '.join(args)} failed: {done.stderr.strip()}")
            (keep / f"{label}.{ext}").write_text(done.stdout)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    module_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", default="regex:code_states_mma", help="ncu's -k: a kernel name or regex:PATTERN")
    p.add_argument("--launch-skip", type=int, default=2, help="launches of the kernel to pass over (warm-up)")
    p.add_argument("--launch-count", type=int, default=1)
    p.add_argument("--sides", default="", help="'label=DIR,...' source trees to profile (default: this tree)")
    p.add_argument("--keep", type=Path, default=None, help="keep each side's <label>.txt and <label>.csv here")
    p.add_argument("--reports", type=Path, default=None, help="read <label>.txt and <label>.csv here; run nothing")
    p.add_argument("--made-on", default=None, help="with --reports: where and how the reports were made")
    p.add_argument("--top", type=int, default=8, help="opcodes per side in the Markdown")
    p.add_argument("--name", default="ncu_stalls")
    add_results_dir_option(p)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    sides = [tuple(x.split("=", 1)) for x in args.sides.split(",") if x.strip()] or [("this tree", ".")]
    if any(len(s) != 2 or not s[0] for s in sides):
        p.error(f"--sides takes 'label=DIR,...'; got {args.sides!r}")
    if args.reports is None and not module_args:
        p.error("give the benchmark to profile after `--` (e.g. -- benchmarks.scoring --device cuda), or --reports DIR")
    if args.reports is not None and not args.made_on:
        p.error("--reports needs --made-on: the machine, versions and command that made the reports")
    rows, opcodes = [], {}
    with contextlib.ExitStack() as stack:  # the reports go to a temporary folder unless kept or given
        folder = args.reports or args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        for label, root in sides:
            if args.reports is None:
                run_side(Path(root).resolve(), args.kernel, args.launch_skip, args.launch_count, module_args, folder,
                         label)  # fmt: skip
            txt, src = folder / f"{label}.txt", folder / f"{label}.csv"
            if not txt.exists() or not src.exists():
                raise SystemExit(f"ncu_stalls: no {txt} or {src} (make them with --keep DIR on a machine with ncu)")
            rows.append({"side": label, **summary_metrics(txt.read_text())})
            opcodes[label] = opcode_samples(src.read_text())
            log(rows[-1])
    # Stall reasons by their largest value over the sides; those no side waited on stay in the JSON only.
    stalls = {k for r in rows for k in r if k.startswith("stall_") and r[k]}
    stalls = sorted(stalls, key=lambda k: -max(r.get(k, 0) for r in rows))
    columns = ["side", *SUMMARY.values(), *stalls]
    notes = [
        f"ncu on one launch of `{args.kernel[6:] if args.kernel.startswith('regex:') else args.kernel}` (after "
        f"{args.launch_skip}) per side, clocks left alone (`--clock-control none`); stall reasons in cycles per issued "
        "instruction. The plot draws each side's stall reasons in the table's column order (x = column index)."
    ]
    for label, ops in opcodes.items():
        total = sum(o["samples"] for o in ops)
        notes += ["", f"**{label}**: warp-stall samples by opcode ({total} in all), the {args.top} with the most:", ""]
        notes += markdown_table(ops[: args.top], ["opcode", "samples", "long_scoreboard", "executed"])
    made = {"reports_made_on": args.made_on} if args.reports else {"profiled": " ".join(module_args)}
    plot_rows = [{"reason": i, "cycles": r[k], "side": r["side"]} for r in rows for i, k in enumerate(stalls) if k in r]
    write_results(
        args.name,
        "Nsight Compute: where the kernel's warps wait, by side",
        {**environment("cuda", "n/a"), "kernel": args.kernel, "sides": dict(sides), **made},
        rows,
        columns,
        {"x": "reason", "y": "cycles", "series": "side", "rows": plot_rows, "ylabel": "cycles per issued instruction"},
        notes="\n".join(notes),
        extra={"opcodes": opcodes, "stall_columns": stalls},
    )


if __name__ == "__main__":
    main()
