"""The model's norms, dense MLPs and RoPE compiled for one-token decode steps (hf/fused_pieces.py), on the CPU.

Compiling itself is replaced by dynamo's `aot_eager` backend here (the same trace, no code generation), so the tests
check which pieces are swapped in, when, on which threads, and what happens when compiling fails; the GPU suite
(test_gpu.py) runs inductor's kernels inside the whole-step graph.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from helpers import generate_with, make_tiny_model, random_prompt, small_budget_overrides

from shadowkv_cache import ShadowKVCache, ShadowKVConfig
from shadowkv_cache.hf import fused_pieces
from shadowkv_cache.hf.adapters import patch_model
from shadowkv_cache.prefix.format import DECODE_TIME_FIELDS
from shadowkv_cache.prefix.read import _check_config


@pytest.fixture
def traced(monkeypatch):
    """Compile with `aot_eager` and record what was compiled; the process's compiled functions are fresh."""
    compiled = []
    real = torch.compile

    def compile_(fn, **kwargs):
        compiled.append(fn)
        return real(fn, backend="aot_eager", fullgraph=kwargs.get("fullgraph", False))

    monkeypatch.setattr(fused_pieces.torch, "compile", compile_)
    monkeypatch.setattr(fused_pieces, "_COMPILED", {})
    yield compiled
    torch._dynamo.reset()


def _own_forwards(model) -> list[str]:
    return [type(m).__name__ for m in model.modules() if isinstance(vars(m).get("forward"), fused_pieces._Bound)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_pieces_are_the_norms_and_dense_mlps_of_the_modeling_module(arch):
    model = make_tiny_model(arch)
    names = sorted({type(m).__name__ for m in patch_model(model).pieces.modules(model)})
    layers = model.config.num_hidden_layers
    assert names == sorted({type(model.model.norm).__name__, type(model.model.layers[0].mlp).__name__})
    # Two norms and an MLP per layer and the final norm; Qwen3's per-head query and key norms too.
    per_layer = 5 if arch == "qwen3" else 3
    assert len(patch_model(model).pieces.modules(model)) == per_layer * layers + 1


def test_inside_the_switch_the_pieces_run_compiled_and_give_the_models_outputs(traced):
    model = make_tiny_model("llama")
    pieces = patch_model(model).pieces
    ids = random_prompt(9, batch=2)
    with torch.no_grad():
        want = model(ids).logits
        with pieces.active(model):
            assert len(_own_forwards(model)) == len(pieces.modules(model))
            got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    names = sorted(getattr(fn, "__qualname__", "") for fn in traced)
    assert names == ["LlamaMLP.forward", "LlamaRMSNorm.forward", "apply_rotary_pos_emb"]  # once per class
    assert _own_forwards(model) == []  # each module's own forward is back


def test_other_threads_run_the_models_own_pieces_while_one_thread_fuses(traced):
    model = make_tiny_model("llama")
    pieces = patch_model(model).pieces
    ids = random_prompt(5)
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def other():
        inside.wait()
        with torch.no_grad():
            seen["logits"] = model(ids).logits
        outside.set()

    thread = threading.Thread(target=other)
    thread.start()
    with torch.no_grad(), pieces.active(model):
        before = len(traced)
        inside.set()
        outside.wait()
    thread.join()
    assert len(traced) == before  # the other thread compiled nothing
    torch.testing.assert_close(seen["logits"], model(ids).logits.detach())
    assert _own_forwards(model) == []


def test_a_piece_that_fails_to_compile_runs_its_own_forward_and_says_so_once(monkeypatch, caplog):
    def broken(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("injected: no backend")

        return fail

    monkeypatch.setattr(fused_pieces.torch, "compile", broken)
    monkeypatch.setattr(fused_pieces, "_COMPILED", {})
    model = make_tiny_model("llama")
    pieces = patch_model(model).pieces
    ids = random_prompt(6)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="shadowkv_cache"):
        want = model(ids).logits
        for _ in range(2):
            with pieces.active(model):
                torch.testing.assert_close(model(ids).logits, want)
    messages = [r.getMessage() for r in caplog.records if "could not compile" in r.getMessage()]
    assert len(messages) == 3 and all("compile_model_ops=False" in m for m in messages)  # norm, MLP, RoPE


def test_cpu_decode_steps_never_compile(traced):
    """The pieces are fused for one-token steps on a GPU only: on the CPU a compressed cache decodes as before."""
    model = make_tiny_model("llama")
    cache = ShadowKVCache(model, **small_budget_overrides())
    with torch.no_grad():
        generate_with(model, random_prompt(301), cache, max_new_tokens=3)
    assert any(layer.is_compressed for layer in cache.layers) and traced == []


def test_compile_model_ops_is_a_checked_decode_time_setting():
    with pytest.raises(ValueError, match="compile_model_ops"):
        ShadowKVConfig(compile_model_ops="yes")
    assert ShadowKVCache(make_tiny_model("llama"), compile_model_ops=False).step_graphs.pieces is None
    assert "compile_model_ops" in DECODE_TIME_FIELDS


def test_a_prefix_file_written_before_compile_model_ops_loads_with_its_default(tmp_path):
    """Files of this format version written before the setting existed lack it in their config: they were made with
    its default, and any value may be asked for at load."""
    saved = dataclasses.asdict(ShadowKVConfig(sparse_budget=512))
    del saved["compile_model_ops"]
    made, asked = _check_config({"shadowkv_config": saved}, None, {"compile_model_ops": False}, tmp_path / "doc")
    assert made.compile_model_ops is True and asked.compile_model_ops is False and asked.sparse_budget == 512
