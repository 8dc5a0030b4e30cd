"""Which architectures the cache supports, and what it must know of each beyond its modeling module.

Every supported model applies RoPE through its modeling module's global `apply_rotary_pos_emb`, which the adapter
wraps (hf/adapters.py). What else differs between them and matters here (docs/architectures.md):
- norms or clipping before RoPE (Qwen3, OLMo 2, Apertus, EXAONE 4 `k_norm`; OLMo `clip_qkv`): part of the recorded
  pre-RoPE key, nothing to do;
- sliding-window layers (Gemma 2 and 3, GPT-OSS, Ministral, OLMo 3, EXAONE 4, AFMoE; every layer of a Mistral-like
  config with `sliding_window` set): kept exact (`sliding_windows`);
- layers without RoPE (SmolLM3, EXAONE 4 and AFMoE global layers): their keys are rebuilt without it
  (`WITHOUT_ROPE`);
- logit soft-capping (Gemma 2, VaultGemma) and attention sinks (GPT-OSS): passed by the model to the attention
  function, which applies them on every path (hf/attention.py);
- MoE MLPs (Mixtral, Qwen MoE, OLMoE, GPT-OSS, ...): nothing, attention is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "WITHOUT_ROPE",
    "check_supported",
    "layers_without_rope",
    "model_type_of",
    "sliding_windows",
]

# model_type -> the modeling module whose global `apply_rotary_pos_emb` its attention modules call. RoPE layouts other
# than Llama's rotate-half over the whole head (partial: phi, phi3 with partial_rotary_factor < 1, stablelm, gpt_neox,
# glm, glm4_moe, minimax_m2; interleaved pairs: glm, glm4, cohere, cohere2, ernie4_5) are read from the model itself
# (hf/rope.py).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "afmoe": "transformers.models.afmoe.modeling_afmoe",
    "apertus": "transformers.models.apertus.modeling_apertus",
    "arcee": "transformers.models.arcee.modeling_arcee",
    "bitnet": "transformers.models.bitnet.modeling_bitnet",
    "cohere": "transformers.models.cohere.modeling_cohere",
    "cohere2": "transformers.models.cohere2.modeling_cohere2",
    "ernie4_5": "transformers.models.ernie4_5.modeling_ernie4_5",
    "ernie4_5_moe": "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe",
    "exaone4": "transformers.models.exaone4.modeling_exaone4",
    "exaone_moe": "transformers.models.exaone_moe.modeling_exaone_moe",
    "flex_olmo": "transformers.models.flex_olmo.modeling_flex_olmo",
    "gemma": "transformers.models.gemma.modeling_gemma",
    "gemma2": "transformers.models.gemma2.modeling_gemma2",
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3",
    "glm": "transformers.models.glm.modeling_glm",
    "glm4": "transformers.models.glm4.modeling_glm4",
    "glm4_moe": "transformers.models.glm4_moe.modeling_glm4_moe",
    "gpt_neox": "transformers.models.gpt_neox.modeling_gpt_neox",
    "gpt_oss": "transformers.models.gpt_oss.modeling_gpt_oss",
    "granite": "transformers.models.granite.modeling_granite",
    "granitemoe": "transformers.models.granitemoe.modeling_granitemoe",
    "granitemoeshared": "transformers.models.granitemoeshared.modeling_granitemoeshared",
    "helium": "transformers.models.helium.modeling_helium",
    "hyperclovax": "transformers.models.hyperclovax.modeling_hyperclovax",
    "jais2": "transformers.models.jais2.modeling_jais2",
    "llama": "transformers.models.llama.modeling_llama",
    "minimax_m2": "transformers.models.minimax_m2.modeling_minimax_m2",
    "ministral": "transformers.models.ministral.modeling_ministral",
    "mistral": "transformers.models.mistral.modeling_mistral",
    "mixtral": "transformers.models.mixtral.modeling_mixtral",
    "olmo": "transformers.models.olmo.modeling_olmo",
    "olmo2": "transformers.models.olmo2.modeling_olmo2",
    "olmo3": "transformers.models.olmo3.modeling_olmo3",
    "olmoe": "transformers.models.olmoe.modeling_olmoe",
    "phi": "transformers.models.phi.modeling_phi",
    "phi3": "transformers.models.phi3.modeling_phi3",
    "phimoe": "transformers.models.phimoe.modeling_phimoe",
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "seed_oss": "transformers.models.seed_oss.modeling_seed_oss",
    "smollm3": "transformers.models.smollm3.modeling_smollm3",
    "solar_open": "transformers.models.solar_open.modeling_solar_open",
    "stablelm": "transformers.models.stablelm.modeling_stablelm",
    "starcoder2": "transformers.models.starcoder2.modeling_starcoder2",
    "vaultgemma": "transformers.models.vaultgemma.modeling_vaultgemma",
}


def model_type_of(model: nn.Module) -> str:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "model_type", type(model).__name__)


def check_supported(model: nn.Module) -> str:
    """The model's architecture name, or a `ValueError` listing the supported ones."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            "ShadowKVCache needs the Transformers model it caches for (e.g. AutoModelForCausalLM.from_pretrained(...))"
            f" as its first argument, got {type(model).__name__}."
        )
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
    sliding_windows(text)  # unknown layer types raise here, before anything is patched
    dynamic = sorted(set(_rope_types(text)) & _LENGTH_DEPENDENT_ROPE)
    if dynamic:
        # The model ropes a prompt with the frequencies of its length; the rebuild, asking the rotary module at a
        # chunk's own positions, would get the other set (LongRoPE's short factors below the original length).
        raise ValueError(
            f"ShadowKVCache does not support RoPE whose frequencies depend on the sequence length (rope_type "
            f"{dynamic[0]!r} in config.rope_parameters). Use DynamicCache for this model."
        )
    return model_type


_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


def _rope_types(text_config: Any) -> list[str]:
    """The `rope_type`s of `config.rope_parameters`: one dict, or one per layer type (Gemma 3)."""
    params = getattr(text_config, "rope_parameters", None) or {}
    tables = [params] if "rope_type" in params else [p for p in params.values() if isinstance(p, dict)]
    return [table["rope_type"] for table in tables if "rope_type" in table]


def sliding_windows(text_config: Any) -> list[int | None]:
    """Per layer: the sliding window of a `sliding_attention` layer (kept exact, never compressed), else `None`.

    Read from `config.layer_types` (Gemma 3: five local layers per global one). A config without it follows
    Transformers' own rule (`DynamicCache`, and the mask of Mistral-like models): every layer slides when
    `config.sliding_window` is set, none otherwise.
    """
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        sliding = getattr(text_config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * text_config.num_hidden_layers
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(
            f"ShadowKVCache does not support layer types {unknown} (config.layer_types); it handles "
            "'full_attention' (compressed) and 'sliding_attention' (kept exact). Use DynamicCache for this model."
        )
    return [text_config.sliding_window if t == "sliding_attention" else None for t in layer_types]


# model_type -> which attention modules apply no RoPE (NoPE), decided as the module's forward decides it: SmolLM3
# drops it in every fourth layer (`use_rope`, from `no_rope_layers`), EXAONE 4 and EXAONE MoE in their global layers
# when they have local ones, AFMoE everywhere but its local layers. Such a layer is compressed all the same; its keys
# are their own pre-RoPE keys and are rebuilt without rotation (`ModelRope.none()`, hf/rope.py). Cohere 2 rotates
# only in its sliding-window layers (`if self.sliding_window is not None: apply_rotary_pos_emb`).
WITHOUT_ROPE: dict[str, Callable[[nn.Module], bool]] = {
    "cohere2": lambda attention: attention.sliding_window is None,
    "smollm3": lambda attention: not attention.use_rope,
    "exaone4": lambda attention: not (attention.sliding_window is None or attention.is_sliding),
    "exaone_moe": lambda attention: not (attention.sliding_window is None or attention.is_sliding),
    "afmoe": lambda attention: not attention.is_local_attention,
}


def layers_without_rope(model_type: str, attention: list[nn.Module]) -> frozenset[int]:
    """The layer indices among `attention` (the model's attention modules) that apply no RoPE (`WITHOUT_ROPE`)."""
    rule = WITHOUT_ROPE.get(model_type)
    return frozenset(module.layer_idx for module in attention if rule is not None and rule(module))
