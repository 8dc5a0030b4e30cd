"""One benchmark at two versions of the code in one call: a base commit's tree against the working tree, on one machine.

A kernel change is judged against the kernel before it on the same warm machine (timings move between machines and
between runs far more than most changes do), so both sides run here, one after the other, each as the benchmark's own
run and record:

    python -m benchmarks.ab --base 93762a7 --name scoring_128k_loop -- \\
        benchmarks.scoring --device cuda --contexts 131072 --batches 12,22

writes `<name>_base` and `<name>_new` (each a normal record of the benchmark, with its side's commit), then `<name>`:
the rows of both side by side, with each measured column's new / base ratio (JSON, Markdown table, plot of the ratios).
The benchmark must take `--name` and `--results-dir` (every script in `benchmarks/` does); pass neither after `--`.

The base side is `git archive <base> src kernels benchmarks`, run from its own folder with its own kernel cache. A copy
of the tree without git (another machine) takes an exported base: `python -m benchmarks.ab --export REV DIR` here,
then `--base-dir DIR --base-commit REV` there. `--order new,base` runs the sides the other way round (a drift over the
call then shows as a changed ratio).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks.results_io import add_results_dir_option, environment, results_dir, write_results
from benchmarks.speed import log

_REPO = Path(__file__).resolve().parents[1]
_TREE = ("src", "kernels", "benchmarks")  # what a side needs to run a benchmark
_SIDES = ("base", "new")


def export_tree(rev: str, dest: Path) -> str:
    """Extract `rev`'s `src`, `kernels` and `benchmarks` into `dest` (created; must be empty); returns the full hash."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"ab: {dest} is not empty; export into a new folder (or remove it first).")
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "--format=tar", commit, *_TREE], cwd=_REPO, capture_output=True)
    if archive.returncode:
        raise SystemExit(f"ab: git archive {commit} failed: {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        # The package's kernels/ link points inside the tree, which the "data" filter allows (Python 3.11.4+; the
        # archive is this repository's own before that).
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return commit


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or err
        raise SystemExit(f"ab: git {' '.join(args)} failed ({str(detail).strip()}); is this a git checkout?") from None


def side_env(root: Path, cache: Path) -> dict[str, str]:
    """The environment a side runs in: the tree `root`'s `src` (then `root`) first on the path, and its own kernel
    cache `cache` (the sides' kernels differ)."""
    path = os.pathsep.join([str(root / "src"), str(root)])
    return {**os.environ, "PYTHONPATH": path, "SHADOWKV_CACHE_DIR": str(cache)}


def run_side(root: Path, module: str, args: list[str], name: str, out: Path, commit: str | None, cache: Path) -> dict:
    """Run `python -m module args --name name --results-dir out` from `root` (its `src` first on the path, its own
    kernel cache); returns the record it wrote."""
    env = side_env(root, cache)
    if commit:  # the base side: its tree has no git
        env["SHADOWKV_SOURCE_COMMIT"] = commit
    command = [sys.executable, "-m", module, *args, "--name", name, "--results-dir", str(out)]
    log(f"{name}: {' '.join(command[1:])} (from {root})")
    done = subprocess.run(command, cwd=root, env=env)
    if done.returncode:
        raise SystemExit(f"ab: {name} failed with exit status {done.returncode}; its output is above.")
    path = out / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"ab: {module} wrote no {path}: does it record results with --name and --results-dir?")
    return json.loads(path.read_text())


def compare_rows(base: list[dict], new: list[dict]) -> tuple[list[dict], list[str], list[str]]:
    """Rows of both sides by position: the fields equal on every row pair (the settings) once, and each measured
    field (numbers on both sides that differ on some pair) as `<field>_base`, `<field>_new` and `<field>_ratio`
    (new / base). Returns the rows, the setting fields and the measured fields; a field that is not a number and
    differs means the sides ran different settings, an error."""
    if len(base) != len(new):
        raise SystemExit(f"ab: the sides wrote {len(base)} and {len(new)} rows; one command writes the same rows.")
    fields = list(dict.fromkeys(k for row in (*base, *new) for k in row))
    measured = [
        f for f in fields
        if any(b.get(f) != n.get(f) for b, n in zip(base, new))
        and all(_number(b.get(f)) and _number(n.get(f)) for b, n in zip(base, new) if b.get(f) != n.get(f))
    ]  # fmt: skip
    settings = [f for f in fields if f not in measured]
    for b, n in zip(base, new):
        differ = [f for f in settings if b.get(f) != n.get(f)]
        if differ:
            raise SystemExit(f"ab: row {b} and row {n} differ in {differ}: the sides did not run the same settings.")
    rows = []
    for b, n in zip(base, new):
        row = {f: b.get(f) for f in settings}
        for f in measured:
            x, y = b.get(f), n.get(f)
            ratio = y / x if _number(x) and _number(y) and x else None
            row |= {f"{f}_base": x, f"{f}_new": y, f"{f}_ratio": round(ratio, 4) if ratio is not None else None}
        rows.append(row)
    return rows, settings, measured


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the base commit (any revision git knows)")
    p.add_argument("--base-dir", type=Path, help="an exported base tree (--export), where this checkout has no git")
    p.add_argument("--base-commit", help="with --base-dir: the commit it was exported from (recorded)")
    p.add_argument("--name", help="record names: <name>_base, <name>_new and <name> (the comparison)")
    p.add_argument("--order", default="base,new", choices=["base,new", "new,base"])
    p.add_argument("--work", type=Path, help="where the base tree is extracted (default: a new temporary folder)")
    p.add_argument("--export", nargs=2, metavar=("REV", "DIR"), help="only extract REV's tree into DIR, then stop")
    add_results_dir_option(p)
    args = p.parse_args(ours)
    if args.export:
        commit = export_tree(args.export[0], Path(args.export[1]))
        log(f"exported {commit} into {args.export[1]}: run with --base-dir {args.export[1]} --base-commit {commit}")
        return
    if not bench:
        p.error("give the benchmark after '--', e.g. -- benchmarks.scoring --device cuda")
    if not args.name:
        p.error("--name is required: the records are <name>_base, <name>_new and <name>")
    if {"--name", "--results-dir"} & {a.split("=")[0] for a in bench}:
        p.error("pass --name and --results-dir to ab, not to the benchmark: ab names each side's record")
    if (args.base is None) == (args.base_dir is None):
        p.error("give exactly one of --base REV and --base-dir DIR")
    if args.base_dir is not None and not args.base_commit:
        p.error("--base-dir needs --base-commit: the commit the tree was exported from is recorded")
    if args.base_dir is not None:  # the base side runs from its own folder, so a relative path would miss
        args.base_dir = args.base_dir.resolve()
    if args.base_dir is not None and not (args.base_dir / "src" / "shadowkv_cache").is_dir():
        p.error(f"--base-dir {args.base_dir} holds no src/shadowkv_cache: export it with --export REV DIR")

    out = results_dir()
    work = Path(tempfile.mkdtemp(prefix="shadowkv-ab-")) if args.work is None else args.work
    try:
        if args.base_dir is not None:
            base_root, base_commit = args.base_dir, args.base_commit
        else:
            base_root = work / "base"
            base_commit = export_tree(args.base, base_root)
        roots = {"base": (base_root, base_commit), "new": (_REPO, None)}
        records = {}
        for side in args.order.split(","):
            root, commit = roots[side]
            cache = work / f"cache_{side}"
            records[side] = run_side(root, bench[0], bench[1:], f"{args.name}_{side}", out, commit, cache)
    finally:
        if args.work is None:  # a temporary folder of ab's own: the base tree and both kernel caches
            shutil.rmtree(work, ignore_errors=True)

    rows, settings, measured = compare_rows(records["base"]["rows"], records["new"]["rows"])
    env = environment(records["new"]["env"].get("device", "?"), records["new"]["env"].get("dtype", "?"))
    env |= {"base_commit": records["base"]["env"].get("commit"), "new_commit": records["new"]["env"].get("commit"),
            "new_dirty": records["new"]["env"].get("dirty"), "order": args.order}  # fmt: skip
    for key in ("gpu", "hbm_copy_bandwidth_GBps"):
        if key in records["new"]["env"]:
            env[key] = records["new"]["env"][key]
    columns = settings + [f"{f}_{s}" for f in measured for s in ("base", "new", "ratio")]
    plot_rows = [
        {"row": i, "field": f, "ratio": row[f"{f}_ratio"]}
        for i, row in enumerate(rows) for f in measured if row[f"{f}_ratio"] is not None
    ]  # fmt: skip
    short = [str(c)[:9] for c in (env["new_commit"], base_commit)]
    title = f"{records['new']['title']}: {short[0]} against {short[1]} (new / base)"
    notes = (
        f"Both sides in one call on one machine, in the order {args.order}: `{args.name}_base` and `{args.name}_new` "
        "are each side's own record. Measured columns (numbers that differ between the sides) as base, new and "
        "new / base; the plot shows each ratio by row (0 = the first row)."
    )
    plot = {"x": "row", "y": "ratio", "series": "field", "ylabel": "new / base", "rows": plot_rows}
    write_results(args.name, title, env, rows, columns, plot, notes)
    for row in rows:
        log({k: v for k, v in row.items() if k in settings or k.endswith("_ratio")})
    log(f"done: {out / args.name}.md")


if __name__ == "__main__":
    main()
