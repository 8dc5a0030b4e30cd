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
The wrapper sees the key as the attention module hands it to RoPE, so norms applied before RoPE (Qwen3, Gemma 3
`k_norm` per head; OLMo 2 over the whole projection) and clipping (OLMo `clip_qkv`) are part of the recorded pre-RoPE
key. A layer without RoPE (SmolLM3, EXAONE 4 NoPE layers, `WITHOUT_ROPE`) never calls the wrapper: its keys reach the
attention function as they are, and that is where its pre-RoPE keys are taken. Models with sliding-window layers
(`config.layer_types`: Gemma 2 and 3, GPT-OSS, OLMo 3, ...) keep those layers exact (`sliding_windows`); only
full-attention layers are compressed, and their keys are rebuilt with the full-attention layers' RoPE (Gemma 3 has
another base for its local layers).

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

import torch
from torch import nn

from ..ops.rebuild_keys import IdentityRope, RopeFn
from .architectures import SUPPORTED_ARCHITECTURES, check_supported, layers_without_rope, model_type_of, sliding_windows
from .attention import register_attention
from .step_context import ATTENTION_NAME, current_step
from .wrappers import WRAPPED_NAMES, AttentionForward, Generate, InstanceWrapper, ModelForward, PrepareInputs

# The architecture table and its per-model rules live in hf/architectures.py; re-exported for older imports.
__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelAdapter",
    "ModelRope",
    "check_supported",
    "model_type_of",
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

    @property
    def rope(self) -> ModelRope:
        """The model's RoPE at given positions, as the key rebuild of the compressed (full-attention) layers
        needs it."""
        # A rotary module with per-layer-type tables (Gemma 3: θ 1e6 global, 1e4 local) is asked for the global one.
        layer_type = "full_attention" if getattr(self.rotary_emb, "layer_types", None) else None
        return ModelRope(self.rotary_emb, self.apply_rotary, layer_type)

    def layer_rope(self, layer_idx: int) -> RopeFn:
        """The RoPE of one compressed layer: the model's, or the identity where the layer applies none."""
        return IdentityRope() if layer_idx in self.without_rope else self.rope


class ModelRope:
    """Post-RoPE keys `[M, c, D]` from pre-RoPE keys `[M, c, D]` at positions `[M, c]`, the model's way, on the keys'
    device.

    `inv_freq_on(device)` and `attention_scaling` let the CUDA key rebuild compute the same rotate-half RoPE
    in-kernel (Llama-3 / YaRN scaling is already folded into them). `layer_type` names the table of a rotary module
    that keeps one per layer type (Gemma 3's `Gemma3RotaryEmbedding`); `None` for the usual single table.

    A model split over devices (design.md §11) keeps its one rotary module on one of them, behind an accelerate hook
    that moves every input there; a layer elsewhere would then copy its keys over and back at every step. So a layer
    on another device gets a copy of the rotary module whose tables live on its device (made once; the module's own
    forward, called without the hook), and no step crosses devices.
    """

    def __init__(self, rotary_emb: nn.Module, apply_rotary: Callable, layer_type: str | None = None):
        self.rotary_emb, self.apply_rotary, self.layer_type = rotary_emb, apply_rotary, layer_type
        self._prefix = f"{layer_type}_" if layer_type else ""
        self._copies: dict[torch.device, nn.Module] = {}

    @property
    def inv_freq(self) -> torch.Tensor | None:
        """The rotary module's own `[D/2]` inverse frequencies (on its device)."""
        return getattr(self.rotary_emb, f"{self._prefix}inv_freq", None)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor | None:
        """`[D/2]` float32 inverse frequencies on `device`, for the key-rebuild kernel (no copy per step); None when
        the tables are not in memory (buffers offloaded by accelerate: the rebuild then calls the module)."""
        inv_freq = getattr(self._module_on(device), f"{self._prefix}inv_freq", None)
        if inv_freq is None or inv_freq.is_meta:
            return None
        return inv_freq.to(device=device, dtype=torch.float32).contiguous()

    @property
    def attention_scaling(self) -> float:
        return float(getattr(self.rotary_emb, f"{self._prefix}attention_scaling", 1.0))

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        extra = (self.layer_type,) if self.layer_type else ()
        module = self._module_on(keys.device)
        if module is self.rotary_emb:  # its hook may compute elsewhere when it brings offloaded tables (no-op else)
            cos, sin = (t.to(keys.device) for t in module(keys, positions, *extra))
        else:  # the class's forward: a copy must not run the original's accelerate hook
            cos, sin = type(module).forward(module, keys, positions, *extra)
        _, rotated = self.apply_rotary(keys[:, None], keys[:, None], cos, sin)
        return rotated[:, 0]

    def _module_on(self, device: torch.device) -> nn.Module:
        """The rotary module if its tables are on `device` (or not in memory: an offloading hook brings them), else
        its copy on `device`."""
        tables = list(self.rotary_emb.buffers())
        if all(t.device == device or t.is_meta for t in tables):
            return self.rotary_emb
        if device not in self._copies:
            self._copies[device] = rotary_on(self.rotary_emb, device)
        return self._copies[device]


def rotary_on(rotary_emb: nn.Module, device: torch.device) -> nn.Module:
    """A copy of `rotary_emb` with its tables (buffers) on `device`; it shares the config and the scalars. Call it
    through its class's `forward`: the copy carries the original's accelerate hook, which would move inputs back."""
    clone = copy.copy(rotary_emb)
    clone._buffers = {name: None if t is None else t.to(device) for name, t in rotary_emb._buffers.items()}
    return clone


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
        return original(q, k, cos, sin, *args, **kwargs)

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
