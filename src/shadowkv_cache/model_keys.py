"""What the package reads of a model's attention keys: the module that projects them, and their shape.

Both vary by architecture (design.md §8): Phi-3 and GPT-NeoX fuse the key projection into one QKV projection, and
GPT-NeoX configs name no KV heads (every query head has its own keys). Placement, prefix files and the cache all ask
here, so the architectures agree everywhere.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["key_dims", "key_projection"]

# An attention module's key projection: its own, or the fused QKV one of Phi-3 and GPT-NeoX.
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")


def key_projection(module: nn.Module) -> nn.Module | None:
    """The key projection of an attention module (one with a `layer_idx`), else None."""
    if not hasattr(module, "layer_idx"):
        return None
    projection = next((getattr(module, n) for n in _KEY_PROJECTIONS if hasattr(module, n)), None)
    return projection if isinstance(projection, nn.Module) else None


def key_dims(text_config: Any) -> tuple[int, int]:
    """(KV heads, head dim) of a text config. GPT-NeoX configs name no KV heads: every query head has its own."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return heads, head_dim
