"""examples/chat.py on the embedded SmolLM2: a document prefilled and compressed, two turns of one conversation,
its prefix saved and loaded by a second run that reads its turn from stdin; the same in YAKV mode, whose prefix file
a ShadowKV-mode run refuses and replaces by a prefill."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import shadowkv_cache

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "examples" / "chat.py"
# The demo handbook at ~1.4K tokens with min_compress_len below it, so that compression really runs; rank 96 (of
# 192) keeps the planted digits on this small model (docs/configuration.md).
OPTIONS = ["--min-compress-len", "1024", "--rank", "96", "--max-new-tokens", "24", "--device", "cpu"]
YAKV_OPTIONS = ["--mode", "yakv", "--min-compress-len", "1024", "--max-new-tokens", "24", "--device", "cpu"]


def run_chat(args: list[str], stdin: str | None = None, options: list[str] = OPTIONS) -> subprocess.CompletedProcess:
    src = str(Path(shadowkv_cache.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(CHAT), *args, *options],
        input=stdin if stdin is not None else "",
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def answers(stdout: str) -> dict[str, str]:
    """{turn: answer} from a non-interactive run: each turn is echoed as "> turn", its answer follows."""
    lines, found = stdout.splitlines(), {}
    for i, line in enumerate(lines[:-1]):
        if line.startswith("> "):
            found[line[2:]] = lines[i + 1]
    return found


@pytest.mark.slow
def test_chat_answers_from_a_compressed_document_and_remembers_the_conversation(smollm2, tmp_path):
    from shadowkv_cache.testing import build_document

    _, tokenizer = smollm2
    document = tmp_path / "handbook.txt"
    document.write_text(build_document(tokenizer, 1400))  # the vault code 4827 is planted at 20% depth
    turns = tmp_path / "turns.txt"
    turns.write_text("/save\nMy name is Ada. What number is the vault code?\nWhat is my name?\n/memory\n")

    first = run_chat(["--document", str(document), "--turns", str(turns)])
    assert "compressed in 30 of 30 layers" in first.stdout, first.stdout
    got = answers(first.stdout)
    assert "4827" in got["My name is Ada. What number is the vault code?"], got
    assert "Ada" in got["What is my name?"], got  # the second turn sees the first
    assert (tmp_path / "handbook.txt.shadowkv.safetensors").is_file()
    assert "device bytes / DynamicCache bytes" in first.stdout  # /memory

    # A second run loads the saved prefix instead of prefilling; its turn comes from stdin (not a terminal).
    second = run_chat(["--document", str(document)], stdin="What number is the vault code?\n")
    assert "Loaded the" in second.stdout and "Prefilled" not in second.stdout, second.stdout
    assert "4827" in answers(second.stdout)["What number is the vault code?"], second.stdout


@pytest.mark.slow
def test_chat_in_yakv_mode_answers_and_keeps_its_prefix_apart(smollm2, tmp_path):
    from shadowkv_cache.testing import build_document

    _, tokenizer = smollm2
    document = tmp_path / "handbook.txt"
    document.write_text(build_document(tokenizer, 1400))
    turns = tmp_path / "turns.txt"
    turns.write_text("/save\nWhat number is the vault code?\n")
    question = "What number is the vault code?\n"

    first = run_chat(["--document", str(document), "--turns", str(turns)], options=YAKV_OPTIONS)
    assert "compressed in 30 of 30 layers" in first.stdout, first.stdout
    assert "4827" in answers(first.stdout)["What number is the vault code?"], first.stdout

    again = run_chat(["--document", str(document)], stdin=question, options=YAKV_OPTIONS)
    assert "Loaded the" in again.stdout and "Prefilled" not in again.stdout, again.stdout
    assert "4827" in answers(again.stdout)["What number is the vault code?"], again.stdout

    # The file holds YAKV state: a ShadowKV-mode run says why it does not use it and prefills instead.
    other = run_chat(["--document", str(document)], stdin=question)
    assert "Not using" in other.stdout and "Prefilled" in other.stdout, other.stdout
