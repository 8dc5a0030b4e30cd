"""The side channel from an attention module's forward to the attention function.

Transformers hands the attention function the query, keys, values and mask, but not the cache, the positions or the
keys before RoPE. A wrapper around each attention module's forward (hf/adapters.py) opens a `StepContext` on this
thread for the duration of that forward (`attention_step`), the rotary wrapper adds the pre-RoPE keys to it, and the
attention function and `ShadowKVCache.update` read it (`current_step`). The context is closed in a `finally`, so an
exception of any kind (a `KeyboardInterrupt` too, which a forward hook with `always_call=True` does not see) leaves no
stale step behind: a stale step would keep its cache alive and receive the pre-RoPE keys of other models that share
the patched modeling module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ATTENTION_NAME", "StepContext", "attention_step", "current_step", "rotary_in_use", "rotary_replaced"]

# The name the attention function and its mask are registered under (free of "sdpa", "flash_attention",
# "flex_attention" and "/", which Transformers treats specially).
ATTENTION_NAME = "shadowkv"


@dataclass
class StepContext:
    """What one attention module's forward knows that the attention function is not given."""

    cache: Any
    layer_idx: int
    position_ids: torch.Tensor | None
    module: nn.Module | None = None  # the attention module running: tells a cache which model calls it
    pre_rope_keys: torch.Tensor | None = None


_local = threading.local()


def current_step() -> StepContext | None:
    """The attention module forward in progress on this thread, if a patched model is running."""
    return getattr(_local, "step", None)


@contextmanager
def attention_step(module: nn.Module, kwargs: dict) -> Iterator[StepContext]:
    """Open the step of `module`'s forward (called with `kwargs`) on this thread; the previous one (if an attention
    forward ever nests another) is restored on the way out, whatever ends the forward."""
    # GPT-NeoX hands its attention the cache as `layer_past`.
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "layer_past") if kwargs.get(k) is not None), None)
    step = StepContext(cache, module.layer_idx, kwargs.get("position_ids"), module)
    previous = getattr(_local, "step", None)
    _local.step = step
    try:
        yield step
    finally:
        _local.step = previous


def rotary_in_use(original: Callable) -> Callable:
    """What the rotary wrapper calls for the modeling function `original` on this thread: `original`, or what
    `rotary_replaced` put in its place (its compiled version, while a whole-step graph is captured)."""
    return getattr(_local, "rotary", {}).get(original, original)


@contextmanager
def rotary_replaced(original: Callable, replacement: Callable) -> Iterator[None]:
    """Call `replacement` for the modeling function `original` on this thread until the block ends."""
    saved = getattr(_local, "rotary", {})
    _local.rotary = {**saved, original: replacement}
    try:
        yield
    finally:
        _local.rotary = saved
