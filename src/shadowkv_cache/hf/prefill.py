"""Prefill runs: one forward of a prompt into a cache, no logits kept but the last, with a per-layer progress bar."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.utils.logging import is_progress_bar_enabled

from ..model_keys import key_projection
from ..prefix.identity import kv_dtype_and_devices
from ..prefix.use import as_prefix_ids

__all__ = ["prefill", "run_prompt"]


def prefill(model: nn.Module, input_ids: torch.Tensor, cache, progress: bool = False) -> None:
    """Run the document `input_ids` (`[S]` or `[1, S]`) through `model` into `cache` (one forward, no logits
    kept but the last), with a per-layer progress bar if `progress` (and Transformers' progress bars are on)."""
    run_prompt(model, as_prefix_ids(input_ids)[None], cache, progress=progress)


def run_prompt(model: nn.Module, input_ids: torch.Tensor, cache, progress: bool = False, **inputs) -> None:
    """One forward of `input_ids` (`[B, S]`) and further `inputs` (e.g. `attention_mask`, `position_ids`, `[B, S]`)
    into `cache`, on the device of the model's first layer, no logits kept but the last; a per-layer progress
    bar if `progress`."""
    device = kv_dtype_and_devices(model, 1)[1][0]
    ids = input_ids.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    hooks = []
    progress = progress and is_progress_bar_enabled()  # transformers.utils.logging.disable_progress_bar() silences it
    if progress:
        from tqdm import tqdm

        attention = [m for m in model.modules() if key_projection(m) is not None]
        bar = tqdm(total=len(attention), desc=f"prefill {ids.shape[1]} tokens", unit="layer", leave=False)

        def step(*_) -> None:  # a forward hook that returns a value would replace the module's output
            bar.update(1)

        hooks = [m.register_forward_hook(step) for m in attention]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **inputs, **{name: cache})
    finally:
        for hook in hooks:
            hook.remove()
        if progress:
            bar.close()
