"""Model adapters: where each architecture keeps RoPE, and the reversible hooks that feed the cache.

Transformers calls `cache.update(post_rope_keys, values, layer_idx)` and then the attention function,
which sees neither the cache nor the pre-RoPE keys. Two public seams fill the gap:
- a forward pre-hook on each attention module records the step (cache, layer, positions) for the
  attention function (`current_step`);
- a wrapper around the modeling module's `apply_rotary_pos_emb` (looked up by global name at call time)
  records the exact pre-RoPE keys; inverting RoPE from bf16 cos/sin would be off by about one ulp;
- a wrapper around the model's `prepare_inputs_for_generation` lets a prefix cache check the full ids
  `generate` was given (the forward only sees the uncached tokens).
The wrapper sees the key as the attention module hands it to RoPE, so per-head norms applied before RoPE (Qwen3,
Gemma 3 `k_norm`) are part of the recorded pre-RoPE key. Models with sliding-window layers (`config.layer_types`,
Gemma 3) keep those layers exact (`sliding_windows`); only full-attention layers are compressed, and their keys
are rebuilt with the full-attention layers' RoPE (Gemma 3 has another base for its local layers).
Nothing is patched at import; `patch_model` is idempotent and `unpatch_model` undoes it.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .attention import register_attention
from .step_context import ATTENTION_NAME, current_step, enter_attention, leave_attention

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelAdapter",
    "ModelRope",
    "patch_model",
    "sliding_windows",
    "unpatch_model",
]

# model_type -> the modeling module whose global `apply_rotary_pos_emb` the attention modules call.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3",
}


@dataclass
class ModelAdapter:
    """One patched model: its architecture's RoPE and the handles that undo the patch."""

    model_type: str
    modeling_module: Any
    rotary_emb: nn.Module
    apply_rotary: Callable
    original_attn_implementation: str | None
    handles: list = field(default_factory=list)

    @property
    def rope(self) -> ModelRope:
        """The model's RoPE at given positions, as the key rebuild of the compressed (full-attention) layers
        needs it."""
        # A rotary module with per-layer-type tables (Gemma 3: θ 1e6 global, 1e4 local) is asked for the global one.
        layer_type = "full_attention" if getattr(self.rotary_emb, "layer_types", None) else None
        return ModelRope(self.rotary_emb, self.apply_rotary, layer_type)


class ModelRope:
    """Post-RoPE keys `[M, c, D]` from pre-RoPE keys `[M, c, D]` at positions `[M, c]`, the model's way.

    `inv_freq` and `attention_scaling` let the CUDA key rebuild compute the same rotate-half RoPE in-kernel
    (Llama-3 / YaRN scaling is already folded into them). `layer_type` names the table of a rotary module that
    keeps one per layer type (Gemma 3's `Gemma3RotaryEmbedding`); `None` for the usual single table.
    """

    def __init__(self, rotary_emb: nn.Module, apply_rotary: Callable, layer_type: str | None = None):
        self.rotary_emb, self.apply_rotary, self.layer_type = rotary_emb, apply_rotary, layer_type
        self._prefix = f"{layer_type}_" if layer_type else ""

    @property
    def inv_freq(self) -> torch.Tensor | None:
        return getattr(self.rotary_emb, f"{self._prefix}inv_freq", None)

    @property
    def attention_scaling(self) -> float:
        return float(getattr(self.rotary_emb, f"{self._prefix}attention_scaling", 1.0))

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        extra = (self.layer_type,) if self.layer_type else ()
        cos, sin = self.rotary_emb(keys, positions, *extra)
        _, rotated = self.apply_rotary(keys[:, None], keys[:, None], cos, sin)
        return rotated[:, 0]


_ADAPTERS: weakref.WeakKeyDictionary[nn.Module, ModelAdapter] = weakref.WeakKeyDictionary()


def model_type_of(model: nn.Module) -> str:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "model_type", type(model).__name__)


def check_supported(model: nn.Module) -> str:
    """The model's architecture name, or a `ValueError` listing the supported ones."""
    model_type = model_type_of(model)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"ShadowKVCache does not support the '{model_type}' architecture yet. Supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. Use transformers.DynamicCache for this model."
        )
    text = model.config.get_text_config()
    if getattr(text, "use_bidirectional_attention", False):
        # Sparse decoding assumes causal attention (the prompt never sees later tokens).
        raise ValueError(
            f"ShadowKVCache needs causal attention; this {model_type} model has use_bidirectional_attention=True "
            "(an encoder such as EmbeddingGemma). Use it without a cache."
        )
    if getattr(text, "attn_logit_softcapping", None) is not None:
        # SDPA (the model's own and the sparse step) has no logit soft-capping, so results would differ from eager.
        raise ValueError(
            f"ShadowKVCache does not support attention logit soft-capping (attn_logit_softcapping="
            f"{text.attn_logit_softcapping}); set it to None or use DynamicCache with eager attention."
        )
    sliding_windows(text)  # unknown layer types raise here, before anything is patched
    return model_type


def sliding_windows(text_config: Any) -> list[int | None]:
    """Per layer: the sliding window of a `sliding_attention` layer (kept exact, never compressed), else `None`.

    Read from `config.layer_types` (Gemma 3: five local layers per global one); a config without it has only
    full-attention layers here.
    """
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(
            f"ShadowKVCache does not support layer types {unknown} (config.layer_types); it handles "
            "'full_attention' (compressed) and 'sliding_attention' (kept exact). Use DynamicCache for this model."
        )
    return [text_config.sliding_window if t == "sliding_attention" else None for t in layer_types]


def patch_model(model: nn.Module) -> ModelAdapter:
    """Install the attention function, the rotary wrapper and the hooks on `model` (idempotent)."""
    if model in _ADAPTERS:
        return _ADAPTERS[model]
    model_type = check_supported(model)
    register_attention()
    modeling = importlib.import_module(SUPPORTED_ARCHITECTURES[model_type])
    original_rotary = getattr(modeling.apply_rotary_pos_emb, "__shadowkv_original__", modeling.apply_rotary_pos_emb)
    if not hasattr(modeling.apply_rotary_pos_emb, "__shadowkv_original__"):
        modeling.apply_rotary_pos_emb = _recording_rotary(original_rotary)

    adapter = ModelAdapter(
        model_type=model_type,
        modeling_module=modeling,
        rotary_emb=_find_rotary_embedding(model),
        apply_rotary=original_rotary,
        original_attn_implementation=model.config._attn_implementation,
    )
    for module in _attention_modules(model, modeling):
        adapter.handles.append(module.register_forward_pre_hook(enter_attention, with_kwargs=True))
        adapter.handles.append(module.register_forward_hook(leave_attention, always_call=True))
    adapter.handles.append(_InstanceWrapper(model, "prepare_inputs_for_generation", _checking_prefix))
    model.set_attn_implementation(ATTENTION_NAME)
    _ADAPTERS[model] = adapter
    return adapter


def unpatch_model(model: nn.Module) -> None:
    """Undo `patch_model`: hooks removed, attention implementation and `apply_rotary_pos_emb` restored."""
    adapter = _ADAPTERS.pop(model, None)
    if adapter is None:
        return
    for handle in adapter.handles:
        handle.remove()
    if adapter.original_attn_implementation is not None:
        model.set_attn_implementation(adapter.original_attn_implementation)
    # Models that were dropped without unpatching have left the weak dictionary, so they do not count.
    if not any(a.modeling_module is adapter.modeling_module for a in _ADAPTERS.values()):
        adapter.modeling_module.apply_rotary_pos_emb = adapter.apply_rotary


def _recording_rotary(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        step = current_step()
        if step is not None:
            step.pre_rope_keys = k
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__shadowkv_original__ = original
    return apply_rotary_pos_emb


def _checking_prefix(original: Callable) -> Callable:
    """`generate` passes each step's full ids to `prepare_inputs_for_generation` (the forward only sees the
    uncached ones): a cache that holds a saved prefix checks there, before the first forward, that the ids start
    with it (`check_prefix_ids`)."""

    @functools.wraps(original)
    def prepare_inputs_for_generation(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        input_ids = args[0] if args else kwargs.get("input_ids")
        check = getattr(cache, "check_prefix_ids", None)
        if check is not None and isinstance(input_ids, torch.Tensor):
            check(input_ids, kwargs.get("attention_mask"))
        return original(*args, **kwargs)

    return prepare_inputs_for_generation


class _InstanceWrapper:
    """Wraps a method on one object (an instance attribute over its class's method); `remove` undoes it."""

    def __init__(self, obj: Any, name: str, wrap: Callable[[Callable], Callable]):
        self.obj, self.name = weakref.ref(obj), name  # weak: the adapter must not keep a dropped model alive
        self.previous = vars(obj).get(name)  # an instance attribute that was already there, if any
        setattr(obj, name, wrap(getattr(obj, name)))

    def remove(self) -> None:
        obj = self.obj()
        if obj is None:
            return
        if self.previous is not None:
            setattr(obj, self.name, self.previous)
        elif self.name in vars(obj):
            delattr(obj, self.name)


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
