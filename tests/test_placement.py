"""A model placed by accelerate (design.md §11), on the CPU: dispatched, offloaded to host memory, or refused.

Only "cpu" exists here, so a split over devices is tested on CUDA (tests/test_multi_device.py, `-m gpu`). What the
CPU can show: accelerate's hooks around every layer change nothing (full budget still equals `DynamicCache`), a
layer whose weights are offloaded to host memory is served, the execution device is read from the hooks, and the
placements the cache refuses raise `PlacementError` before the model is patched.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from helpers import (
    GEMMA3,
    assert_logits_close,
    dynamic_cache,
    full_budget_overrides,
    generate_with,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
)

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.hf import adapters
from shadowkv_cache.hf.adapters import SUPPORTED_ARCHITECTURES, ModelRope, rotary_on
from shadowkv_cache.placement import PlacementError, attention_devices, check_placement
from shadowkv_cache.prefix import PrefixCacheError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

NEW_TOKENS = 12


def layer_map(model: torch.nn.Module, where: dict[int, str] | None = None) -> dict[str, str]:
    """A module-level device map as `device_map="auto"` writes it: every decoder layer on `where[i]` (else "cpu")."""
    where = where or {}
    layers = len(model.model.layers)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": where.get(i, "cpu") for i in range(layers)})
    return device_map


@pytest.mark.parametrize("arch", ["llama", "qwen3", GEMMA3])
@pytest.mark.parametrize("overrides", [full_budget_overrides(), small_budget_overrides()], ids=["full", "small"])
def test_dispatched_model_gives_what_it_gives_undispatched(arch, overrides):
    """accelerate's hooks move nothing on an all-CPU map: the dispatched model's cache holds and selects exactly
    what the plain model's does, and at full budget gives DynamicCache's tokens and logits."""
    ids = random_prompt(203, seed=5)
    plain = make_tiny_model(arch)
    ref = generate_with(plain, ids, dynamic_cache(plain), max_new_tokens=NEW_TOKENS)
    alone = generate_with(plain, ids, ShadowKVCache(plain, **overrides), max_new_tokens=NEW_TOKENS)

    # force_hooks: a one-device map would otherwise only move the model, with no hooks to test.
    model = dispatch_model(make_tiny_model(arch), device_map=layer_map(make_tiny_model(arch)), force_hooks=True)
    assert model.hf_device_map and hasattr(model.model.layers[0], "_hf_hook")
    cache = ShadowKVCache(model, **overrides)
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)

    assert torch.equal(out.sequences, alone.sequences)
    assert_logits_close(out.logits, alone.logits, rtol=0, atol=0)
    if overrides["sparse_budget"] > 10**5:
        assert torch.equal(out.sequences, ref.sequences)
        assert_logits_close(out.logits, ref.logits)
    compressed = [layer for layer in cache.layers if getattr(layer, "is_compressed", False)]
    assert compressed and all(int(layer.mode.temporal.lookups) > 0 for layer in compressed)


def test_weights_offloaded_to_host_memory_are_served_but_not_saved(tmp_path):
    """accelerate's CPU offload keeps the weights elsewhere ('meta' in the module) and puts them in place for each
    call; the keys and values still arrive on the execution device, so the cache works. A prefix file cannot
    identify such a model (its weights are not in memory) and says so."""
    ids = random_prompt(160, seed=2)
    plain = make_tiny_model("llama")
    ref = generate_with(plain, ids, dynamic_cache(plain), max_new_tokens=NEW_TOKENS)
    model = cpu_offload(make_tiny_model("llama"), execution_device="cpu")
    assert model.model.layers[0].self_attn.k_proj.weight.is_meta
    assert attention_devices(model) == {0: torch.device("cpu"), 1: torch.device("cpu")}

    cache = ShadowKVCache(model, **full_budget_overrides())
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits)
    assert all(layer.is_compressed for layer in cache.layers)

    document = ShadowKVCache.prefill(model, ids[0], **full_budget_overrides())
    with pytest.raises(PrefixCacheError, match="not in memory"):
        document.save_prefix(tmp_path / "doc.safetensors")
    assert not (tmp_path / "doc.safetensors").exists()


def unpatched(model: torch.nn.Module) -> bool:
    return model.config._attn_implementation != "shadowkv" and model not in adapters._ADAPTERS


@pytest.mark.parametrize("drop_device_map", [False, True], ids=["device_map", "hooks_only"])
def test_a_layer_offloaded_to_disk_is_refused_before_the_model_is_patched(tmp_path, drop_device_map):
    model = make_tiny_model("llama")
    model = dispatch_model(model, device_map=layer_map(model, {1: "disk"}), offload_dir=str(tmp_path))
    if drop_device_map:  # accelerate's disk_offload() and hand-made hooks set no hf_device_map: the hooks tell
        del model.hf_device_map
    with pytest.raises(PlacementError, match=r"offloaded to disk \(model\.layers\.1\.self_attn\).*device_map"):
        ShadowKVCache(model)
    assert unpatched(model)
    # The model itself still runs (accelerate reads the layer from disk), with DynamicCache.
    generate_with(model, random_prompt(20), dynamic_cache(model), max_new_tokens=2)


def test_attention_on_meta_without_a_hook_is_refused():
    model = make_tiny_model("llama")
    model.model.layers[1].self_attn.to("meta")
    with pytest.raises(PlacementError, match=r"'meta' device.*model\.layers\.1\.self_attn"):
        ShadowKVCache(model)
    assert unpatched(model)


def test_execution_device_comes_from_the_nearest_hook():
    """The device a layer's keys arrive on: its own or a parent's accelerate hook (accelerate names GPUs by index),
    else its k_proj weight's device."""

    class Hook:  # what accelerate's AlignDevicesHook exposes
        def __init__(self, device):
            self.execution_device, self.offload = device, False

    model = make_tiny_model("llama")
    model.model.layers[1]._hf_hook = Hook(1)
    model.model.layers[0].self_attn.k_proj._hf_hook = Hook("cuda:0")
    assert attention_devices(model) == {0: torch.device("cuda", 0), 1: torch.device("cuda", 1)}
    check_placement(model)  # placed on devices, not offloaded: nothing to refuse
    assert attention_devices(make_tiny_model("llama")) == {0: torch.device("cpu"), 1: torch.device("cpu")}


def test_memory_report_per_device_on_one_device():
    model = dispatch_model(make_tiny_model(GEMMA3), device_map=layer_map(make_tiny_model(GEMMA3)), force_hooks=True)
    cache = ShadowKVCache(model, **small_budget_overrides())
    assert cache.memory_report().per_device == {}  # nothing held yet
    generate_with(model, random_prompt(150), cache, max_new_tokens=4)

    report = cache.memory_report()
    (cpu,) = report.per_device.values()
    assert cpu.device == "cpu" and cpu.layers == tuple(range(len(cache.layers)))
    assert (cpu.gpu_bytes, cpu.host_bytes, cpu.dynamic_cache_bytes) == (
        report.gpu_bytes,
        report.host_bytes,
        report.dynamic_cache_bytes,
    )
    assert {m.device for m in report.layers} == {"cpu"}
    assert "(4 layers)" not in str(report)  # one device: no per-device lines


@pytest.mark.parametrize("arch", ["llama", GEMMA3])
def test_rope_copy_for_another_device_gives_the_models_keys(arch):
    """A layer on another device than the rotary module uses a copy of the module with its tables on the layer's
    device, called without the original's hooks: it must give the module's own cos/sin. (Only the CPU exists here,
    so the copy is made for it; tests/test_multi_device.py uses it across devices.)"""
    model = make_tiny_model(arch)
    rotary = model.model.rotary_emb
    calls = []
    rotary.register_forward_pre_hook(lambda *_: calls.append(1))  # stands in for accelerate's hook
    layer_type = ("full_attention",) if getattr(rotary, "layer_types", None) else ()
    keys, positions = torch.randn(6, 8, 16), torch.arange(48).view(6, 8)

    clone = rotary_on(rotary, torch.device("cpu"))
    got = type(clone).forward(clone, keys, positions, *layer_type)
    assert not calls
    expected = rotary(keys, positions, *layer_type)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert clone._buffers is not rotary._buffers  # its own tables: moving them leaves the module's where they are
    for name, table in rotary.named_buffers():
        assert torch.equal(getattr(clone, name), table)

    modeling = importlib.import_module(SUPPORTED_ARCHITECTURES[arch])
    apply = getattr(modeling.apply_rotary_pos_emb, "__shadowkv_original__", modeling.apply_rotary_pos_emb)
    rope = ModelRope(rotary, apply, layer_type[0] if layer_type else None)
    assert rope._module_on(torch.device("cpu")) is rotary  # on the module's own device: the module itself
    inv_freq = getattr(rotary, f"{layer_type[0]}_inv_freq" if layer_type else "inv_freq")
    torch.testing.assert_close(rope.inv_freq_on(torch.device("cpu")), inv_freq.float(), rtol=0, atol=0)


def test_rope_tables_offloaded_by_accelerate_leave_the_kernel_path():
    """Buffers accelerate offloads (`offload_buffers=True`) are on 'meta' between calls: the key rebuild then has no
    in-kernel tables and calls the module, whose hook brings them."""
    model = make_tiny_model("llama")
    modeling = importlib.import_module(SUPPORTED_ARCHITECTURES["llama"])
    apply = getattr(modeling.apply_rotary_pos_emb, "__shadowkv_original__", modeling.apply_rotary_pos_emb)
    rope = ModelRope(model.model.rotary_emb.to("meta"), apply)
    assert rope.inv_freq_on(torch.device("cpu")) is None
    assert rope._module_on(torch.device("cpu")) is model.model.rotary_emb  # no copy of tables that are not there


def test_load_prefix_into_a_disk_offloaded_model_is_refused_before_reading(tmp_path):
    model = make_tiny_model("llama")
    document = ShadowKVCache.prefill(model, random_prompt(120)[0], **full_budget_overrides())
    document.save_prefix(tmp_path / "d.safetensors")
    offloaded = make_tiny_model("llama")
    offloaded = dispatch_model(offloaded, device_map=layer_map(offloaded, {0: "disk"}), offload_dir=str(tmp_path / "o"))
    with pytest.raises(PlacementError, match="offloaded to disk"):
        ShadowKVCache.load_prefix(offloaded, tmp_path / "d.safetensors")
    assert unpatched(offloaded)
