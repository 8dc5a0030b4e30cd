"""The side channel from an attention module's forward to the attention function.

Transformers hands the attention function the query, keys, values and mask, but not the cache, the positions or the
keys before RoPE. A forward pre-hook on each attention module opens a `StepContext` on this thread
(`enter_attention`), the rotary wrapper adds the pre-RoPE keys to it, and the attention function reads it
(`current_step`); a forward hook closes it (`leave_attention`), also when the forward raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ATTENTION_NAME", "StepContext", "current_step", "enter_attention", "leave_attention"]

# The name the attention function and its mask are registered under (free of "sdpa", "flash_attention",
# "flex_attention" and "/", which Transformers treats specially).
ATTENTION_NAME = "shadowkv"


@dataclass
class StepContext:
    """What one attention module's forward knows that the attention function is not given."""

    cache: Any
    layer_idx: int
    position_ids: torch.Tensor | None
    pre_rope_keys: torch.Tensor | None = None


_local = threading.local()


def current_step() -> StepContext | None:
    """The attention module forward in progress on this thread, if a patched model is running."""
    return getattr(_local, "step", None)


def enter_attention(module: nn.Module, args: tuple, kwargs: dict) -> None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    _local.step = StepContext(cache, module.layer_idx, kwargs.get("position_ids"))


def leave_attention(module: nn.Module, args: tuple, output: Any) -> None:
    _local.step = None
