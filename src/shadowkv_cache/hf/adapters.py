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
The wrapper sees the key as the attention module hands it to RoPE, so per-head norms applied before RoPE (Qwen3,
Gemma 3 `k_norm`, Cohere, StableLM) are part of the recorded pre-RoPE key. Phi and StableLM hand RoPE only the
rotary part of the key; the other dims pass through RoPE unchanged, so the full pre-RoPE key is completed from the
post-RoPE key (`ModelRope.pre_rope_keys`). Models with sliding-window layers (`config.layer_types`, Gemma 3,
Cohere 2) keep those layers exact (`sliding_windows`); only full-attention layers are compressed, and their keys
are rebuilt with the full-attention layers' RoPE (Gemma 3 has another base for its local layers; Cohere 2's global
layers apply none).

Each compressed layer's RoPE is a `ModelRope` (hf/rope.py).

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

from .attention import register_attention
from .rope import ModelRope
from .step_context import ATTENTION_NAME, current_step
from .wrappers import WRAPPED_NAMES, AttentionForward, Generate, InstanceWrapper, ModelForward, PrepareInputs

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelAdapter",
    "ModelRope",
    "key_dims",
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
    # Partial rotary (the first `partial_rotary_factor` of each head's dims rotate).
    "phi": "transformers.models.phi.modeling_phi",
    "phi3": "transformers.models.phi3.modeling_phi3",
    "stablelm": "transformers.models.stablelm.modeling_stablelm",
    "gpt_neox": "transformers.models.gpt_neox.modeling_gpt_neox",
    # Interleaved rotary (pairs of adjacent dims; GLM also partial).
    "glm": "transformers.models.glm.modeling_glm",
    "glm4": "transformers.models.glm4.modeling_glm4",
    "cohere": "transformers.models.cohere.modeling_cohere",
    "cohere2": "transformers.models.cohere2.modeling_cohere2",
}

# model_type -> which attention modules apply no RoPE, decided as the module's forward decides it. Cohere 2 rotates
# only in its sliding-window layers (`if self.sliding_window is not None: apply_rotary_pos_emb`); its global layers
# attend without positions. Such a layer is compressed all the same, with an identity RoPE.
_WITHOUT_ROPE: dict[str, Callable[[nn.Module], bool]] = {
    "cohere2": lambda attention: attention.sliding_window is None,
}


@dataclass
class ModelAdapter:
    """One patched model: its architecture's RoPE and its attention modules (held weakly, by layer index)."""

    model_type: str
    modeling_module: Any
    rotary_emb: nn.Module
    apply_rotary: Callable
    original_attn_implementation: str | None
    attention: dict[int, weakref.ref] = field(default_factory=dict)
    without_rope: frozenset[int] = frozenset()  # layers whose attention applies no RoPE (Cohere 2's global ones)

    @functools.cached_property
    def rope(self) -> ModelRope:
        """The model's RoPE at given positions, as the key rebuild of the compressed (full-attention) layers
        needs it."""
        # A rotary module with per-layer-type tables (Gemma 3: θ 1e6 global, 1e4 local) is asked for the global one.
        layer_type = "full_attention" if getattr(self.rotary_emb, "layer_types", None) else None
        return ModelRope(self.rotary_emb, self.apply_rotary, layer_type)

    def layer_rope(self, layer_idx: int) -> ModelRope:
        """The RoPE of one compressed layer: the model's, or the identity where the layer applies none."""
        return ModelRope.none() if layer_idx in self.without_rope else self.rope


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


def key_dims(text_config: Any) -> tuple[int, int]:
    """(KV heads, head dim) of a text config. GPT-NeoX configs name no KV heads: every query head has its own."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return heads, head_dim


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
            without_rope=frozenset(m.layer_idx for m in attention if _WITHOUT_ROPE.get(model_type, _never)(m)),
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


def _never(attention: nn.Module) -> bool:
    return False


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
