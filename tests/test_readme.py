"""The README's quick start runs as written, on CPU, and prints what the README says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shadowkv_cache

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- quick-start:"


def quick_start_code() -> str:
    """The first python block after the quick-start marker."""
    text = README.read_text()
    assert MARKER in text, f"README.md lost its quick-start marker ({MARKER})"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.DOTALL)
    assert block is not None, "no ```python block after the quick-start marker"
    return block.group(1)


def quick_start_output() -> list[str]:
    """The ```text block the README shows after the quick start: the lines it promises (`...` elides)."""
    text = README.read_text()
    rest = text[text.index(MARKER) :]
    block = re.search(r"```text\n(.*?)```", rest, re.DOTALL)
    assert block is not None
    return block.group(1).splitlines()


def test_quick_start_code_is_found():
    code = quick_start_code()
    assert "ShadowKVCache(model" in code and "load_smollm2()" in code and "print(cache.memory_report())" in code


@pytest.mark.slow
def test_quick_start_runs_as_written(tmp_path):
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start_code())
    src = str(Path(shadowkv_cache.__file__).resolve().parents[1])  # the package these tests import
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    promised = quick_start_output()

    assert lines[0] == promised[0], (lines[0], promised[0])  # the answer: "The vault code is 4827."
    assert "4827" in lines[0]
    assert lines[1] == promised[1]  # the memory table's header
    rows = [line.split() for line in lines[2:] if line.split() and line.split()[0].isdigit()]
    # rank="auto" picks each layer's rank within [1/8, 3/4] of Hkv*D = 192
    assert len(rows) == 30 and all(row[1] == "shadowkv" and 24 <= int(row[2]) <= 144 for row in rows), rows
    assert rows[0][:4] == promised[2].split()[:4]  # layer 0's mode, rank and budget as shown
    assert any(line.startswith("total") for line in lines)
    summary = lines[-1]
    assert summary.startswith("device bytes / DynamicCache bytes = ")
    ratio = float(summary.split("=")[1].split(";")[0])
    assert 0 < ratio < 1
    assert promised[-1].split("=")[0] == summary.split("=")[0]
