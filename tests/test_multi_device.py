"""A model split over devices by accelerate (design.md §11), on CUDA. Run with `pytest -m gpu`.

Three placements of the tiny Llama and the tiny Gemma 3 (sliding and full-attention layers alternating):

- `cuda+cpu`: decoder layers executed on `cuda:0` and on the CPU (`dispatch_model(..., main_device="cpu")`); the
  CPU layers run the PyTorch twins while the GPU layers run the kernels and CUDA graphs.
- `offload`: the same map with the GPU as main device, which is accelerate's CPU offload: the "cpu" layers keep
  their weights in host memory and execute on `cuda:0`, so their keys and values, and their state, are on `cuda:0`.
- `cuda0+cuda1` (two GPUs, skipped otherwise): layers on `cuda:0` and `cuda:1`, the rotary module on `cuda:0`.

Invariants: full budget gives `DynamicCache`'s tokens on the same placement; each layer's state lives on the device
its keys arrive on; `memory_report().per_device` groups the layers by that device. At a small budget a two-GPU split
gives what the model on one GPU gives (the same kind of GPU runs the same kernels, so the same chunks are selected);
a `cuda+cpu` split has no such reference (CPU layers round differently, and a top-k choice can turn on round-off).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from accelerate import dispatch_model
from helpers import (
    GEMMA3,
    assert_logits_close,
    dynamic_cache,
    full_budget_overrides,
    generate_with,
    left_pad,
    make_tiny_model,
    random_prompt,
    small_budget_overrides,
)
from test_kernel_twins import random_scan_case
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.model_shapes import LLAMA_3_1_8B
from benchmarks.speed import split_map
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.fidelity import natural_text_ids
from shadowkv_cache.hf.layer import CompressedLayer
from shadowkv_cache.ops.loader import kernels_available
from shadowkv_cache.ops.temporal_scan import temporal_scan, temporal_scan_reference
from shadowkv_cache.testing import synthetic_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

ARCHS = ("llama", GEMMA3)
NEW_TOKENS = 24  # past the first eager step of each layer, so that its CUDA graph is captured and replayed


def halves_map(model: torch.nn.Module, first, second, rotary) -> dict:
    """The first half of the decoder layers (and the embeddings) on `first`, the rest (and the head) on `second`; a
    head tied to the embeddings (SmolLM2) stays with them, as `device_map="auto"` keeps tied weights together."""
    layers = len(model.model.layers)
    head = first if model.config.get_text_config().tie_word_embeddings else second
    device_map = {"model.embed_tokens": first, "model.rotary_emb": rotary, "model.norm": second, "lm_head": head}
    device_map.update({f"model.layers.{i}": first if i < layers // 2 else second for i in range(layers)})
    return device_map


def placed(arch: str, placement: str) -> tuple[torch.nn.Module, dict[int, torch.device]]:
    """A tiny model dispatched by accelerate, and the device each decoder layer's keys and values arrive on."""
    return place(make_tiny_model(arch), placement)


def place(model: torch.nn.Module, placement: str) -> tuple[torch.nn.Module, dict[int, torch.device]]:
    """`model` (on the CPU) dispatched by accelerate, and the device each decoder layer's keys arrive on."""
    layers = len(model.model.layers)
    half = layers // 2
    if placement == "cuda+cpu":  # the rotary module on the CPU: the GPU layers rebuild keys from a copy of it
        model = dispatch_model(model, halves_map(model, 0, "cpu", "cpu"), main_device="cpu")
        return model, {i: torch.device("cuda", 0) if i < half else torch.device("cpu") for i in range(layers)}
    if placement == "offload":
        model = dispatch_model(model, halves_map(model, 0, "cpu", 0))
        return model, dict.fromkeys(range(layers), torch.device("cuda", 0))
    model = dispatch_model(model, halves_map(model, 0, 1, 0))
    return model, {i: torch.device("cuda", 0 if i < half else 1) for i in range(layers)}


PLACEMENTS = ["cuda+cpu", "offload", pytest.param("cuda0+cuda1", marks=two_gpus)]


def assert_state_on(cache: ShadowKVCache, devices: dict[int, torch.device], graphs: bool) -> None:
    """Every tensor a layer holds is on the device its keys arrive on (host values aside), and layers on a GPU
    captured their decode step when `graphs`."""
    for i, layer in enumerate(cache.layers):
        device = devices[i]
        assert layer.keys.device == device, i
        if not isinstance(layer, CompressedLayer):
            continue
        assert layer.is_compressed, f"layer {i} was not compressed"
        prompt = layer.prompt
        tensors = {f.name: getattr(prompt, f.name) for f in dataclasses.fields(prompt)}
        tensors.update({f"policy.{k}": v for k, v in prompt.policy_state.items()})
        tensors.update({"new.keys": layer.new.keys, "new.valid": layer.new.valid})
        if layer.mode.name == "shadowkv":
            temporal = layer.mode.temporal
            tensors.update(
                {"temporal.ids": temporal.ids, "temporal.keys": temporal.keys, "temporal.hits": temporal.hits}
            )
            store = prompt.values
        else:
            held = layer.mode.held
            tensors.update({"held.ids": held.ids, "held.keys": held.keys, "held.hits": held.hits})
            store = prompt.store
        wrong = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.device != device}
        assert not wrong, f"layer {i} on {device} holds {wrong}"
        assert store.data.device.type == "cpu" and store.data.is_pinned() == (device.type == "cuda")
        if store.stored_rows.device is not None:
            assert store.stored_rows.device == device
        assert (layer._graph is not None) == (graphs and device.type == "cuda"), i
        if layer._graph is not None:
            assert layer._graph.device == device and layer._graph.output.device == device


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_split_model_gives_dynamic_cache_tokens_at_full_budget(arch, placement):
    model, devices = placed(arch, placement)
    ids = random_prompt(301, seed=3)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(model, **full_budget_overrides())
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)

    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits, atol=1e-4)  # CUDA sums in another order than the CPU
    assert_state_on(cache, devices, graphs=True)
    compressed = [layer for layer in cache.layers if isinstance(layer, CompressedLayer)]
    assert all(int(layer.mode.temporal.lookups) > int(layer.mode.temporal.hits) for layer in compressed)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_split_model_in_yakv_mode_keeps_each_layers_state_on_its_device(placement):
    model, devices = placed("llama", placement)
    cache = ShadowKVCache(model, mode="yakv", min_compress_len=64, sparse_budget=32, recent_window=16)
    out = generate_with(model, random_prompt(301, seed=4), cache, max_new_tokens=NEW_TOKENS)
    assert out.sequences.shape[1] == 301 + NEW_TOKENS
    assert_state_on(cache, devices, graphs=True)  # pinned records: the GPU layers capture their steps


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_memory_report_per_device(arch, placement):
    model, devices = placed(arch, placement)
    cache = ShadowKVCache(model, **small_budget_overrides())
    generate_with(model, random_prompt(301, seed=5), cache, max_new_tokens=4)

    report = cache.memory_report()
    per_device = report.per_device
    expected: dict[str, list[int]] = {}
    for i, device in devices.items():
        expected.setdefault(str(device), []).append(i)
    assert {name: list(d.layers) for name, d in per_device.items()} == expected
    assert sum(d.gpu_bytes for d in per_device.values()) == report.gpu_bytes
    assert sum(d.host_bytes for d in per_device.values()) == report.host_bytes
    assert sum(d.dynamic_cache_bytes for d in per_device.values()) == report.dynamic_cache_bytes
    for name, d in per_device.items():
        layers = [report.layers[i] for i in d.layers]
        assert d.gpu_bytes == sum(m.gpu_bytes for m in layers) > 0
        assert all(m.device == name for m in layers)
    if len(per_device) > 1:
        assert all(f"{name} (" in str(report) for name in per_device)


@two_gpus
@pytest.mark.parametrize("arch", ARCHS)
def test_two_gpu_split_at_a_small_budget_equals_one_gpu(arch):
    """The same kernels on the same kind of GPU: the split selects, rebuilds and fetches what one GPU does."""
    one = make_tiny_model(arch).cuda()
    ids = random_prompt(301, seed=6)
    alone = generate_with(one, ids.cuda(), ShadowKVCache(one, **small_budget_overrides()), max_new_tokens=NEW_TOKENS)
    model, devices = placed(arch, "cuda0+cuda1")
    cache = ShadowKVCache(model, **small_budget_overrides())
    split = generate_with(model, ids.cuda(), cache, max_new_tokens=NEW_TOKENS)

    assert torch.equal(split.sequences.cpu(), alone.sequences.cpu())
    assert_logits_close([x.cpu() for x in split.logits], [x.cpu() for x in alone.logits], atol=1e-5)
    assert_state_on(cache, devices, graphs=True)


@two_gpus
def test_kernel_launches_on_its_tensors_device_whatever_device_is_current():
    """A module loaded for one GPU is not valid in the other's context (CUDA_ERROR_INVALID_HANDLE): each launch makes
    its own device current."""
    if not kernels_available(torch.device("cuda", 0)):
        pytest.fail('cuda-python is missing: pip install "shadowkv-cache[cuda]" to test the kernels')
    ids, wanted, valid = random_scan_case(3, 2, 51, 77, seed=0)
    expected = temporal_scan_reference(ids, wanted, valid)
    for current, target in ((0, 1), (1, 0), (1, 1), (0, 1)):
        with torch.cuda.device(current):
            got = temporal_scan(ids.to(f"cuda:{target}"), wanted.to(f"cuda:{target}"), valid.to(f"cuda:{target}"))
        assert got[0].device == torch.device("cuda", target)
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_synthetic_cache_fills_each_layer_on_its_device(placement):
    """The speed benchmarks' synthetic caches (`--split`) follow the placement as a real prefill does."""
    model, devices = placed("llama", placement)
    cache = synthetic_cache(model, 2, 512, min_compress_len=64, sparse_budget=64, rank=8, hit_rate=0.5)
    assert {name: list(d.layers) for name, d in cache.memory_report().per_device.items()} == {
        str(device): [i for i in devices if devices[i] == device] for device in set(devices.values())
    }
    tokens = torch.zeros((2, 1), dtype=torch.long)
    with torch.no_grad():
        for _ in range(4):  # eager, then captured, then replayed
            tokens = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert_state_on(cache, devices, graphs=True)


@pytest.mark.parametrize("placement", ["cuda+cpu", pytest.param("cuda0+cuda1", marks=two_gpus)])
def test_prefix_saved_on_one_gpu_loads_into_a_split_model(tmp_path, placement):
    """A prefix file holds no devices: loaded into a split model, each layer goes to the device its keys arrive on,
    and the document plus a question give DynamicCache's tokens at full budget."""
    document, question = random_prompt(240, seed=7)[0], random_prompt(9, seed=8)[0]
    one = make_tiny_model("llama").cuda()
    ShadowKVCache.prefill(one, document.cuda(), **full_budget_overrides()).save_prefix(tmp_path / "doc.safetensors")
    model, devices = placed("llama", placement)
    loaded = ShadowKVCache.load_prefix(model, tmp_path / "doc.safetensors")
    ids = torch.cat([document, question])[None]
    out = generate_with(model, ids, loaded, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)

    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits, atol=1e-4)
    assert_state_on(loaded, devices, graphs=True)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_micro_batched_prefill_of_a_split_model_gives_dynamic_cache_tokens(placement):
    """`prefill_batch` joins the micro batches' layers on their own devices (pinned values for GPU layers)."""
    model, devices = placed("llama", placement)
    ids, mask = left_pad([random_prompt(n, seed=n)[0] for n in (300, 211, 140)])
    cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=2, **full_budget_overrides())
    out = generate_with(model, ids, cache, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    ref = generate_with(model, ids, dynamic_cache(model), attention_mask=mask, max_new_tokens=NEW_TOKENS)

    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits, atol=1e-4)
    assert_state_on(cache, devices, graphs=True)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["cuda+cpu", pytest.param("cuda0+cuda1", marks=two_gpus)])
def test_smollm2_split_gives_dynamic_cache_tokens_at_full_budget(smollm2, placement):
    """The real model (30 layers, fp32) split as `device_map="auto"` would, on natural text."""
    model, devices = place(copy.deepcopy(smollm2[0]), placement)
    ids = natural_text_ids(smollm2[1], 700)
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(model, **full_budget_overrides(rank=1.0))
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)

    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits, rtol=1e-4, atol=1e-3)  # logits of ~20: fp32 round-off of two orders
    assert_state_on(cache, devices, graphs=True)


@pytest.mark.slow
@two_gpus
def test_llama_8b_shape_split_over_two_gpus_gives_dynamic_cache_tokens_at_full_budget():
    """The Llama-3.1-8B shape (random fp32 weights, 32 GB) split over two GPUs as `device_map="auto"` would, at 2K
    tokens: the shape whose first sparse step used to fail with CUDA_ERROR_INVALID_HANDLE on the second GPU."""
    config = AutoConfig.for_model(
        "llama", **LLAMA_3_1_8B, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(0)
    with torch.device("cuda", 0):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    layers = config.num_hidden_layers
    model = dispatch_model(model, split_map(layers, 2))
    devices = {i: torch.device("cuda", i * 2 // layers) for i in range(layers)}
    ids = random_prompt(2048, seed=9).cuda()
    ref = generate_with(model, ids, dynamic_cache(model), max_new_tokens=NEW_TOKENS)
    cache = ShadowKVCache(model, **full_budget_overrides(rank=1.0))
    out = generate_with(model, ids, cache, max_new_tokens=NEW_TOKENS)

    assert torch.equal(out.sequences, ref.sequences)
    assert_logits_close(out.logits, ref.logits, atol=1e-3)
    assert_state_on(cache, devices, graphs=True)
    assert set(cache.memory_report().per_device) == {"cuda:0", "cuda:1"}
