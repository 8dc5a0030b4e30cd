"""The attention function registered with Transformers' `AttentionInterface` as "shadowkv".

Legend: B batch, Hq query heads, T query tokens, D head dim.

Uncompressed layers (and any other cache) get exactly SDPA. On a ShadowKV layer's first long fill the
prompt is attended exactly and then compressed, right after this layer's attention, so the full K/V of
all layers never coexist. Later steps attend over the sparse set.

Models whose attention is not plain softmax pass what differs to the attention function: Gemma 2 its logit
soft-capping (`softcap`), GPT-OSS its attention sinks (`s_aux`). Both go into `LogitTerms`, and every path applies
them: exact attention written out (SDPA has neither) where SDPA would run, and the sparse step over the selected set.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..core.attention import LogitTerms, grouped_attention
from .layer import CompressedLayer
from .step_context import ATTENTION_NAME, current_step

__all__ = ["register_attention", "shadowkv_attention"]


def shadowkv_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Same contract as `sdpa_attention_forward`: returns `([B, T, Hq, D], None)`."""
    step = current_step()
    layers = getattr(step.cache, "layers", None) if step is not None else None
    layer = layers[module.layer_idx] if layers is not None and module.layer_idx < len(layers) else None
    terms = LogitTerms(kwargs.pop("softcap", None), kwargs.pop("s_aux", None))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(layer, CompressedLayer) and layer.is_compressed:
        return layer.sparse_attention(query, attention_mask, scaling, terms), None
    if terms.plain:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    else:
        out = _exact_attention(query, key, value, attention_mask, scaling, terms)
    if not isinstance(layer, CompressedLayer):
        return out, None

    q_len = query.shape[2]
    first_fill = layer.get_seq_length() == q_len
    if first_fill and q_len < layer.config.min_compress_len:
        _note_kept_exact(step.cache, q_len, layer.config.min_compress_len)
    if first_fill and q_len >= layer.config.min_compress_len:
        keys_pre = _pre_rope_keys(step, layer, key)
        layer.compress(keys_pre, step.position_ids, attention_mask, query=query, scaling=scaling)
    return out, None


def _pre_rope_keys(step, layer: CompressedLayer, key: torch.Tensor) -> torch.Tensor:
    """The layer's keys before RoPE `[B, Hkv, S, D]`: what the rotary wrapper recorded, completed or replaced as the
    layer's RoPE says (`ModelRope.pre_rope_keys`: the non-rotated dims of partial rotary; in a layer without RoPE the
    keys as the attention module handed them to the cache, which is what `key` holds here). A mode that keeps
    post-RoPE keys only (YAKV) gets those."""
    rope = getattr(layer.mode, "rope", None)
    keys_pre = key if rope is None else rope.pre_rope_keys(step.pre_rope_keys, key)
    if keys_pre is None or step.position_ids is None:
        raise RuntimeError(
            "ShadowKVCache did not see the pre-RoPE keys or position ids of layer "
            f"{step.layer_idx}; the model was not patched (create the cache with ShadowKVCache(model))."
        )
    return keys_pre


def _exact_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    terms: LogitTerms,
) -> torch.Tensor:
    """What the model's eager attention computes with soft-capping or sinks: `query` `[B, Hq, T, D]` over `key`,
    `value` `[B, Hkv, N, D]`, the queries being the last `T` of the `N` tokens. Returns `[B, T, Hq, D]`."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:  # the mask function leaves it out when causal order is all there is
        mask = torch.ones((q_len, kv_len), dtype=torch.bool, device=query.device).tril(kv_len - q_len)[None, None]
    else:
        mask = attention_mask[..., -kv_len:]
        mask = mask if mask.dtype == torch.bool else mask == 0
    return grouped_attention(query, key, value, mask, scaling, terms)


def _note_kept_exact(cache, tokens: int, min_compress_len: int) -> None:
    """Tell the user, once per cache, that its prompt stays exact (only a first fill is ever compressed)."""
    notices = getattr(cache, "notices", None)
    if notices is not None:
        notices.once(
            "kept_exact",
            logging.WARNING,
            "ShadowKVCache kept the prompt exact: %d tokens < min_compress_len=%d; pass min_compress_len=... "
            "to compress shorter prompts (a cache compresses its first fill only).",
            tokens,
            min_compress_len,
        )


def register_attention() -> None:
    """Register the attention function and its mask (SDPA's boolean mask) under one name (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, shadowkv_attention)
    # Without the mask registration the function would get mask=None and left-padded batches would go wrong.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
