"""What a new user meets: notices on the package's logger, progress bars that follow Transformers' switch, clear
errors for common mistakes, and examples that do not crash on short documents."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import forward_with, generate_with, left_pad, make_tiny_model, random_prompt, small_budget_overrides
from transformers.utils import logging as hf_logging

from shadowkv_cache import ShadowKVCache, embedded_models, unpatch_model
from shadowkv_cache.memory_report import LayerMemory, MemoryReport
from shadowkv_cache.prefix import batch_questions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # generate(past_key_values=...) on Transformers 5.24

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LOGGER = "shadowkv_cache"


@pytest.fixture
def model():
    model = make_tiny_model("llama", seed=11)
    yield model
    unpatch_model(model)


def kept_exact(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "kept the prompt exact" in r.getMessage()]


def test_short_prompt_is_logged_once_per_cache(model, caplog):
    cache = ShadowKVCache(model, **small_budget_overrides(min_compress_len=64))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = generate_with(model, random_prompt(40), cache, max_new_tokens=4)
        generate_with(model, torch.cat([out.sequences, random_prompt(8, seed=1)], 1), cache, max_new_tokens=4)
    messages = kept_exact(caplog)
    assert len(messages) == 1, messages  # two turns, 2 layers: one notice
    assert "40 tokens < min_compress_len=64" in messages[0]
    assert "pass min_compress_len=" in messages[0]
    assert caplog.records[0].levelno == logging.WARNING  # shown without any logging set-up
    assert not any(layer.is_compressed for layer in cache.layers)

    with caplog.at_level(logging.INFO, logger=LOGGER):  # a new cache tells again
        generate_with(model, random_prompt(40), ShadowKVCache(model, min_compress_len=64), max_new_tokens=2)
    assert len(kept_exact(caplog)) == 2


def test_compressed_prompt_logs_nothing(model, caplog):
    cache = ShadowKVCache(model, **small_budget_overrides(min_compress_len=64))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        generate_with(model, random_prompt(200), cache, max_new_tokens=4)
    assert all(layer.is_compressed for layer in cache.layers)
    assert not kept_exact(caplog)


def test_short_micro_batches_log_once(model, caplog):
    ids, mask = left_pad([random_prompt(30, seed=2)[0], random_prompt(20, seed=3)[0]])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1, min_compress_len=64)
    assert len(kept_exact(caplog)) == 1


def test_progress_bars_follow_transformers_switch(model, capsys):
    ids = random_prompt(100)
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        ShadowKVCache.prefill(model, ids, progress=True, min_compress_len=64)
        batch, mask = left_pad([ids[0], ids[0, :80]])
        ShadowKVCache.prefill_batch(model, batch, mask, progress=True, min_compress_len=64)
    finally:
        hf_logging.enable_progress_bar()
    assert "prefill" not in capsys.readouterr().err
    ShadowKVCache.prefill(model, ids, progress=True, min_compress_len=64)
    assert "prefill 100 tokens" in capsys.readouterr().err


def test_model_config_passed_as_config_names_the_fix(model):
    with pytest.raises(TypeError, match="ShadowKVConfig") as info:
        ShadowKVCache(model, config=model.config)
    message = str(info.value)
    assert "LlamaConfig" in message and "sparse_budget=1024" in message


def test_batch_questions_without_a_pad_token(model):
    """Llama 3 and Mistral tokenizers have no pad token (`pad_token_id` None): pads are masked, so any id works."""
    document, questions = random_prompt(80)[0], [random_prompt(3, seed=4)[0], random_prompt(6, seed=5)[0]]
    ids, mask = batch_questions(document, questions, None)
    padded, _ = batch_questions(document, questions, 7)
    assert ids.shape == padded.shape == (2, 86)
    real = mask.bool()
    assert torch.equal(ids[real], padded[real]) and (ids[~real] == 0).all() and (padded[~real] == 7).all()
    doc = ShadowKVCache.prefill(model, document, **small_budget_overrides(min_compress_len=64))
    with torch.no_grad():
        kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
        a = model.generate(ids, past_key_values=doc.fork(2), pad_token_id=0, **kwargs)
        b = model.generate(padded, past_key_values=doc.fork(2), pad_token_id=0, **kwargs)
    assert torch.equal(a[:, 86:], b[:, 86:])  # the pad id does not matter


@pytest.mark.parametrize("bad", ["0", 1.5, -1, True])
def test_batch_questions_bad_pad_names_the_fix(bad):
    with pytest.raises(TypeError, match="eos_token_id"):
        batch_questions([1, 2, 3], [[4]], bad)


def test_missing_gguf_says_how_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "gguf" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModuleNotFoundError, match=r"shadowkv-cache\[models\]"):
        embedded_models._convert_gguf(gguf, tmp_path / "converted", {"format": 1})
    assert not (tmp_path / "converted").exists()


def test_demo_memory_line_when_the_prompt_stayed_exact(model):
    """`long_document_demo.py --tokens 2000` used to crash formatting a hit rate of None."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from long_document_demo import describe_memory
    finally:
        sys.path.remove(str(EXAMPLES))
    cache = ShadowKVCache(model)  # min_compress_len 4096
    forward_with(model, random_prompt(50), cache)
    report = cache.memory_report()
    assert report.hit_rate is None
    line = describe_memory(report, "cpu", 2000, 4096)
    assert "stayed exact" in line and "min_compress_len=4096" in line and "hit rate n/a" in line

    compressed = MemoryReport((LayerMemory(0, "shadowkv", 10, 20, 40, 8, 32),), hit_rate=None)
    assert "hit rate n/a" in describe_memory(compressed, "cpu", 5000, 4096)
    compressed = MemoryReport((LayerMemory(0, "shadowkv", 10, 20, 40, 8, 32),), hit_rate=0.5)
    assert "hit rate 50%" in describe_memory(compressed, "cpu", 5000, 4096)


def test_document_qa_compares_end_to_end_times():
    """A load (seconds) set against a prefill (a minute) was reported as a speed-up ("166x"); the summary now
    compares end-to-end times and labels the load against the prefill as what it is."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from document_qa import summary
    finally:
        sys.path.remove(str(EXAMPLES))
    lines = summary(3, "load", 0.5, 60.0, (80.0, 40.0), 0.5, 83.0)
    text = "\n".join(lines)
    assert "ShadowKVCache: load 0.5 s + answers 60.0 s = 60.5 s" in text
    assert "DynamicCache:  prefill 80.0 s + answers 40.0 s = 120.0 s" in text
    assert "end to end, ShadowKVCache is 2.0x faster than DynamicCache" in text
    assert "load vs prefill of ShadowKV's document alone: 0.50 s vs 83.0 s" in text and "166" not in text
    slower = "\n".join(summary(3, "prefill", 83.0, 60.0, (80.0, 40.0), None, 83.0))
    assert "1.2x slower" in slower and "load vs prefill" not in slower
    assert "DynamicCache" not in "\n".join(summary(3, "load", 0.5, 60.0, None, 0.5, None))
