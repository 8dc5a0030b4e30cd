"""Model adapters: where each architecture keeps RoPE, and the reversible wrappers that feed the cache.

Transformers calls `cache.update(post_rope_keys, values, layer_idx)` and then the attention function,
which sees neither the cache nor the pre-RoPE keys. Public seams fill the gap (design.md §8):
- a wrapper around each attention module's forward opens the step (cache, layer, positions, module) for the
  attention function and the cache (`attention_step`), and closes it in a `finally`;
- a wrapper around the modeling module's `apply_rotary_pos_emb` (looked up by global name at call time)
  records the exact pre-RoPE keys; inverting RoPE from bf16 cos/sin would be off by about one ulp;
- wrappers around the model's `forward` and `generate` run each call that gets a `ShadowKVCache` inside that
  cache's use scope: one thread at a time, and a call that raises leaves the cache as it was (hf/state.py);
- a wrapper around the model's `prepare_inputs_for_generation` lets a prefix cache check the full ids
  `generate` was given (the forward only sees the uncached tokens).
The wrapper sees the key as the attention module hands it to RoPE, so norms applied before RoPE (Qwen3, Gemma 3,
Cohere, StableLM `k_norm` per head; OLMo 2 over the whole projection) and clipping (OLMo `clip_qkv`) are part of the
recorded pre-RoPE key. Phi and StableLM hand RoPE only the rotary part of the key; the other dims pass through RoPE
unchanged, so the full pre-RoPE key is completed from the post-RoPE key (`ModelRope.pre_rope_keys`). A layer without
RoPE (SmolLM3, EXAONE 4 NoPE layers, Cohere 2's global layers: `WITHOUT_ROPE`) never calls the wrapper: its keys
reach the attention function as they are, and that is where its pre-RoPE keys are taken. Models with sliding-window
layers (`config.layer_types`: Gemma 2 and 3, GPT-OSS, OLMo 3, Cohere 2, ...) keep those layers exact
(`sliding_windows`); only full-attention layers are compressed, and their keys are rebuilt with the full-attention
layers' RoPE (Gemma 3 has another base for its local layers). Each compressed layer's RoPE is a `ModelRope`
(hf/rope.py).

The attention implementation is switched with Transformers' own `set_attn_implementation`, on a copy of the
model's config that the patch gives the model: models built from one config object share it, and switching the
shared object would route (or, on unpatching, un-route) the other models too. Nothing is patched at import;
`patch_model` is idempotent and thread-safe, and `unpatch_model` undoes it, also on a `copy.deepcopy` of a patched
model (the wrappers, hf/wrappers.py, are objects that rebind to the copy, not closures over the original).
"""

from __future__ import annotations

import copy
import functools
import importlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .architectures import (
    SUPPORTED_ARCHITECTURES,
    check_supported,
    layers_without_rope,
    model_type_of,
    sliding_windows,
)
from .attention import register_attention
from .fused_pieces import FusedPieces
from .rope import ModelRope, rotary_on
from .step_context import ATTENTION_NAME, current_step, rotary_in_use
from .wrappers import WRAPPED_NAMES, AttentionForward, Generate, InstanceWrapper, ModelForward, PrepareInputs

# The architecture table and its per-model rules live in hf/architectures.py; re-exported for older imports.
__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelAdapter",
    "ModelRope",
    "check_supported",
    "model_type_of",
    "rotary_on",
    "patch_model",
    "sliding_windows",
    "unpatch_model",
]


@dataclass
class ModelAdapter:
    """One patched model: its architecture's RoPE and its attention modules (held weakly, by layer index)."""

    model_type: str
    modeling_module: Any
    rotary_emb: nn.Module
    apply_rotary: Callable
    original_attn_implementation: str | None
    attention: dict[int, weakref.ref] = field(default_factory=dict)
    without_rope: frozenset[int] = frozenset()  # layers whose attention applies no RoPE (`WITHOUT_ROPE`)

    @functools.cached_property
    def rope(self) -> ModelRope:
        """The model's RoPE at given positions, as the key rebuild of the compressed (full-attention) layers
        needs it."""
        # A rotary module with per-layer-type tables (Gemma 3: θ 1e6 global, 1e4 local) is asked for the global one.
        layer_type = "full_attention" if getattr(self.rotary_emb, "layer_types", None) else None
        return ModelRope(self.rotary_emb, self.apply_rotary, layer_type)

    @functools.cached_property
    def pieces(self) -> FusedPieces:
        """The model's norms, dense MLPs and RoPE as compiled for one-token decode steps (hf/fused_pieces.py)."""
        return FusedPieces(self.modeling_module, self.apply_rotary)

    def layer_rope(self, layer_idx: int) -> ModelRope:
        """The RoPE of one compressed layer: the model's, or the identity where the layer applies none."""
        return ModelRope.none() if layer_idx in self.without_rope else self.rope


_ADAPTERS: weakref.WeakKeyDictionary[nn.Module, ModelAdapter] = weakref.WeakKeyDictionary()


# One patch or unpatch at a time: two threads that make the first cache of one model must patch it once.
_PATCH_LOCK = threading.RLock()
_RECORD = "_shadowkv_patch"  # instance attribute of a patched model: its configs before and after patching


@dataclass
class _PatchRecord:
    """The config objects a patch swapped: the model's own (perhaps shared with other models) and its private copy,
    whose attention implementation is "shadowkv". Held on the model, so a deep copy of the model carries its own."""

    original: Any
    patched: Any


def patch_model(model: nn.Module) -> ModelAdapter:
    """Install the attention function, the rotary wrapper and the model's wrappers on `model` (idempotent,
    thread-safe). A model already patched whose attention implementation was switched away (`set_attn_implementation`)
    is routed through "shadowkv" again."""
    with _PATCH_LOCK:
        adapter = _ADAPTERS.get(model)
        if adapter is not None:
            if model.config._attn_implementation != ATTENTION_NAME:
                model.set_attn_implementation(ATTENTION_NAME)
            return adapter
        model_type = check_supported(model)
        modeling = importlib.import_module(SUPPORTED_ARCHITECTURES[model_type])
        # Everything that can fail is looked up before anything changes.
        attention = _attention_modules(model, modeling)
        rotary_emb = _find_rotary_embedding(model)
        _remove_patch(model)  # what a deep copy of a patched model carries over; it is patched afresh below
        register_attention()
        original_rotary = getattr(modeling.apply_rotary_pos_emb, "__shadowkv_original__", modeling.apply_rotary_pos_emb)
        adapter = ModelAdapter(
            model_type=model_type,
            modeling_module=modeling,
            rotary_emb=rotary_emb,
            apply_rotary=original_rotary,
            original_attn_implementation=model.config._attn_implementation,
            attention={module.layer_idx: weakref.ref(module) for module in attention},
            without_rope=layers_without_rope(model_type, attention),
        )
        adapter.rope  # noqa: B018 - probes the layout now, while a failure leaves the model untouched
        try:
            original = model.config
            patched = copy.deepcopy(original)
            _swap_configs(model, original, patched)
            setattr(model, _RECORD, _PatchRecord(original, patched))
            for module in attention:
                AttentionForward.install(module)
            for wrapper in (ModelForward, Generate, PrepareInputs):
                if callable(getattr(model, wrapper.name, None)):
                    wrapper.install(model)
            model.set_attn_implementation(ATTENTION_NAME)  # on the model's own copy of its config
        except BaseException:
            _remove_patch(model)
            raise
        if not hasattr(modeling.apply_rotary_pos_emb, "__shadowkv_original__"):
            modeling.apply_rotary_pos_emb = _recording_rotary(original_rotary)
        _ADAPTERS[model] = adapter
        return adapter


def unpatch_model(model: nn.Module) -> None:
    """Undo `patch_model`: wrappers removed, the model's own config object (and so its attention implementation)
    and `apply_rotary_pos_emb` restored. Also undoes what a `copy.deepcopy` of a patched model carries over."""
    with _PATCH_LOCK:
        adapter = _ADAPTERS.pop(model, None)
        _remove_patch(model)
        if adapter is None:
            return
        # Models that were dropped without unpatching have left the weak dictionary, so they do not count.
        if not any(a.modeling_module is adapter.modeling_module for a in _ADAPTERS.values()):
            adapter.modeling_module.apply_rotary_pos_emb = adapter.apply_rotary


def _remove_patch(model: nn.Module) -> None:
    """Remove this package's wrappers from `model` and its modules and give them back their config objects."""
    for module in model.modules():
        for name in WRAPPED_NAMES:
            wrapper = vars(module).get(name)
            if isinstance(wrapper, InstanceWrapper):
                wrapper.remove(module)
    record = vars(model).pop(_RECORD, None)
    if isinstance(record, _PatchRecord):
        _swap_configs(model, record.patched, record.original)


def _swap_configs(model: nn.Module, old: Any, new: Any) -> None:
    """Point every module whose `config` is `old` (or one of its sub-configs) at `new` (or its counterpart)."""
    pairs: dict[int, tuple[Any, Any]] = {}

    def pair(a: Any, b: Any) -> None:
        pairs[id(a)] = (a, b)
        for key in getattr(a, "sub_configs", None) or {}:
            sub_a, sub_b = getattr(a, key, None), getattr(b, key, None)
            if sub_a is not None and sub_b is not None:
                pair(sub_a, sub_b)

    pair(old, new)
    for module in model.modules():
        current = vars(module).get("config")
        if current is not None and pairs.get(id(current), (None,))[0] is current:
            module.config = pairs[id(current)][1]


def _recording_rotary(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        step = current_step()
        if step is not None:
            step.pre_rope_keys = k
        # The modeling module's own function, or its compiled version inside a whole-step capture (fused_pieces.py).
        return rotary_in_use(original)(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__shadowkv_original__ = original
    return apply_rotary_pos_emb


def _attention_modules(model: nn.Module, modeling: Any) -> list[nn.Module]:
    found = [
        m
        for m in model.modules()
        if type(m).__module__ == modeling.__name__
        and type(m).__name__.endswith("Attention")
        and hasattr(m, "layer_idx")
    ]
    if not found:
        raise ValueError(f"No attention modules of {modeling.__name__} found in {type(model).__name__}.")
    return found


def _find_rotary_embedding(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if hasattr(module, "rotary_emb") and isinstance(module.rotary_emb, nn.Module):
            return module.rotary_emb
    raise ValueError(f"{type(model).__name__} has no rotary embedding module (`rotary_emb`).")
