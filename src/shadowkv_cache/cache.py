"""`ShadowKVCache`: the drop-in `transformers.Cache` (ShadowKV, Sun et al., ICML 2025, arXiv:2410.21465)."""

from __future__ import annotations

import dataclasses

from torch import nn
from transformers.cache_utils import Cache

from .adapters import check_supported, patch_model
from .config import ShadowKVConfig
from .layer import ShadowKVLayer
from .memory_report import LayerMemory, MemoryReport
from .policies import LandmarkTopK, SelectionPolicy

__all__ = ["ShadowKVCache"]


class ShadowKVCache(Cache):
    """A KV cache that keeps long prompts compressed on the accelerator and their values in host memory.

    At prefill each layer keeps a low-rank factorisation of the pre-RoPE keys, chunk landmarks, a few exact
    outlier chunks and the local window on the device, and moves the values to (pinned) host memory. Each
    decode step selects the top chunks per KV head, rebuilds only missed keys and fetches only missed values.
    Prompts shorter than `min_compress_len` stay exact.

    Args:
        model (`PreTrainedModel`): a supported causal LM (Llama, Mistral, Qwen2, Qwen3); it is patched
            (attention function, rotary hook) reversibly, see `shadowkv_cache.unpatch_model`.
        config (`ShadowKVConfig`, *optional*): settings; the paper's defaults scaled to the model when omitted.
        policy (`SelectionPolicy`, *optional*, defaults to `LandmarkTopK()`): how chunks are scored.
        **overrides: any `ShadowKVConfig` field, e.g. `sparse_budget=512`.

    >>> cache = ShadowKVCache(model, sparse_budget=1024)  # doctest: +SKIP
    >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP
    >>> print(cache.memory_report())  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        config: ShadowKVConfig | None = None,
        policy: SelectionPolicy | None = None,
        **overrides,
    ):
        # Everything is checked before the model is touched.
        unknown = sorted(set(overrides) - set(ShadowKVConfig.field_names()))
        if unknown:
            raise TypeError(
                f"Unknown ShadowKVCache option(s) {unknown}; valid options: {ShadowKVConfig.field_names()}."
            )
        config = dataclasses.replace(config or ShadowKVConfig(), **overrides)
        check_supported(model)
        text_config = model.config.get_text_config()
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        config.validate(key_dim=text_config.num_key_value_heads * head_dim)
        if policy is not None and not isinstance(policy, SelectionPolicy):
            raise TypeError(f"policy must be a SelectionPolicy, got {type(policy).__name__}.")

        adapter = patch_model(model)
        self.config = config
        self.policy = policy or LandmarkTopK()
        layers = [ShadowKVLayer(config, self.policy, adapter.rope) for _ in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)

    @property
    def is_compileable(self) -> bool:
        return False

    def memory_report(self) -> MemoryReport:
        """Device and host bytes per layer and in total, the ratio to `DynamicCache`, and the hit rate so far."""
        per_layer, hits, lookups = [], 0, 0
        for i, layer in enumerate(self.layers):
            device, host, full = layer.nbytes()
            per_layer.append(LayerMemory(i, layer.is_compressed, device, host, full))
            if layer.temporal is not None:
                hits += int(layer.temporal.hits)
                lookups += int(layer.temporal.lookups)
        return MemoryReport(tuple(per_layer), hits / lookups if lookups else None)

    def __repr__(self) -> str:
        compressed = sum(layer.is_compressed for layer in self.layers)
        return f"ShadowKVCache({self.config}, compressed_layers={compressed}/{len(self.layers)})"
