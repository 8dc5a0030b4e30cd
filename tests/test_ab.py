"""benchmarks/ab.py: a benchmark at a base commit and at the working tree in one call (CPU, the scoring script's small
sizes), the side-by-side rows, and its errors."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import ab

REPO = Path(__file__).resolve().parents[1]


def _head() -> str | None:
    if shutil.which("git") is None:
        return None
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


needs_git = pytest.mark.skipif(_head() is None, reason="needs a git checkout (the base side is a commit's tree)")


def test_compare_rows_keeps_settings_once_and_gives_each_measure_as_base_new_and_ratio():
    base = [{"batch": 1, "kernel": "k", "ms": 2.0, "replays": 9}, {"batch": 2, "kernel": "k", "ms": 4.0, "replays": 9}]
    new = [{"batch": 1, "kernel": "k", "ms": 1.0, "replays": 9}, {"batch": 2, "kernel": "k", "ms": 5.0, "replays": 10}]
    rows, settings, measured = ab.compare_rows(base, new)
    assert settings == ["batch", "kernel"] and measured == ["ms", "replays"]
    assert rows[0] == {"batch": 1, "kernel": "k", "ms_base": 2.0, "ms_new": 1.0, "ms_ratio": 0.5,
                       "replays_base": 9, "replays_new": 9, "replays_ratio": 1.0}  # fmt: skip
    assert rows[1]["ms_ratio"] == 1.25 and rows[1]["replays_ratio"] == pytest.approx(10 / 9, abs=1e-4)


def test_compare_rows_refuses_sides_that_ran_different_settings():
    with pytest.raises(SystemExit, match="differ in \\['kernel'\\]"):
        ab.compare_rows([{"kernel": "a", "ms": 1.0}], [{"kernel": "b", "ms": 1.0}])
    with pytest.raises(SystemExit, match="1 and 2 rows"):
        ab.compare_rows([{"ms": 1.0}], [{"ms": 1.0}, {"ms": 2.0}])
    # A zero base gives no ratio rather than a division error.
    rows, _, _ = ab.compare_rows([{"ms": 0.0}], [{"ms": 1.0}])
    assert rows[0]["ms_ratio"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--base", "HEAD", "--name", "x"], "give the benchmark after '--'"),
        (["--base", "HEAD", "--", "benchmarks.scoring"], "--name is required"),
        (["--base", "HEAD", "--name", "x", "--", "benchmarks.scoring", "--name", "y"], "pass --name and --results-dir"),
        (["--name", "x", "--", "benchmarks.scoring"], "exactly one of --base REV and --base-dir DIR"),
        (["--base-dir", "d", "--name", "x", "--", "benchmarks.scoring"], "--base-dir needs --base-commit"),
    ],
)
def test_bad_arguments_name_the_fix(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        ab.main(["--results-dir", str(tmp_path), *argv])
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@needs_git
def test_both_sides_run_and_record_their_commits(tmp_path, monkeypatch):
    head = _head()
    base_dir = (tmp_path / "base").resolve()
    ab.main(["--export", "HEAD", str(base_dir)])
    assert (base_dir / "src" / "shadowkv_cache" / "kernels" / "score_codes.cu").is_file()  # the link kept
    with pytest.raises(SystemExit, match="not empty"):
        ab.export_tree("HEAD", base_dir)
    out = tmp_path / "results"
    monkeypatch.chdir(tmp_path)  # the base folder given relative to here: its side runs from its own folder
    ours = ["--base-dir", "base", "--base-commit", head, "--name", "abc", "--order", "new,base"]
    ab.main([*ours, "--results-dir", str(out), "--work", str(tmp_path / "work"), "--", "benchmarks.scoring", "--small"])
    records = {side: json.loads((out / f"abc_{side}.json").read_text()) for side in ("base", "new")}
    assert records["base"]["env"]["commit"] == head  # recorded from --base-commit: the exported tree has no git
    # Each side imported the package from its own tree.
    assert records["base"]["env"]["env_vars"]["PYTHONPATH"].startswith(str(base_dir / "src"))
    assert records["new"]["env"]["env_vars"]["PYTHONPATH"].startswith(str(REPO / "src"))
    both = json.loads((out / "abc.json").read_text())
    assert both["env"]["base_commit"] == head and both["env"]["order"] == "new,base"
    assert len(both["rows"]) == len(records["new"]["rows"]) == 2  # the small sizes: 2K tokens, batches 1 and 2
    for row, base_row, new_row in zip(both["rows"], records["base"]["rows"], records["new"]["rows"]):
        assert row["batch"] == base_row["batch"] == new_row["batch"]
        assert row["ms_base"] == base_row["ms"] and row["ms_new"] == new_row["ms"]
        assert row["ms_ratio"] == pytest.approx(new_row["ms"] / base_row["ms"], rel=1e-3)
    assert (out / "abc.md").read_text().count("| 2048 |") == 2 and (out / "abc.png").stat().st_size > 0


@needs_git
def test_a_base_revision_is_extracted_into_the_work_folder(tmp_path):
    out, work = tmp_path / "results", tmp_path / "work"
    ab.main(["--base", "HEAD", "--name", "rev", "--results-dir", str(out), "--work", str(work), "--",
             "benchmarks.scoring", "--small"])  # fmt: skip
    assert (work / "base" / "kernels" / "score_codes.cu").is_file()
    both = json.loads((out / "rev.json").read_text())
    assert both["env"]["base_commit"] == _head() and both["env"]["order"] == "base,new"
