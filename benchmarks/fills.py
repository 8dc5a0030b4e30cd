"""Full-attention caches filled with random K/V at a context length, for the speed benchmarks' batch sweeps.

Legend: B batch, S context tokens, Hkv KV heads, D head dim. Compressed caches come from
`shadowkv_cache.testing.synthetic_cache`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

from benchmarks.speed import layer_devices


def fill_dynamic(model, batch: int, length: int) -> DynamicCache:
    """A `DynamicCache` holding random keys and values `[B, Hkv, S, D]` in every layer, each on its layer's device (a
    model split over GPUs has several)."""
    cfg = model.config
    cache = DynamicCache(config=cfg)
    shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
    for i, on in enumerate(layer_devices(model)):
        cache.update(torch.randn(shape, device=on, dtype=model.dtype),
                     torch.randn(shape, device=on, dtype=model.dtype), i)  # fmt: skip
    return cache


def fill_static(model, batch: int, length: int, extra: int) -> StaticCache:
    """A `StaticCache` of `S + extra` slots whose first `S` hold random keys and values in every layer, on the layer's
    device."""
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=length + extra)
    shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
    for i, on in enumerate(layer_devices(model)):
        k = torch.randn(shape, device=on, dtype=model.dtype)
        cache.update(k, torch.randn_like(k), i, {"cache_position": torch.arange(length, device=on)})
    return cache
