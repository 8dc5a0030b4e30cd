"""Where each layer's keys and values arrive, and the placements a cache cannot serve (design.md §11).

Legend: L layers.

A model split by accelerate (`device_map="auto"`, `dispatch_model`) runs each decoder layer on its own device,
and a layer whose weights accelerate offloads to host memory runs on its hook's execution device, with the weights
moved there for each call. Either way the cache only sees where attention's keys and values are: the execution
device. Each layer keeps its state there (it follows the tensors `update` receives), so no decode step crosses
devices. A layer offloaded to disk is refused: accelerate then reads its weights from disk at every forward (every
generated token), and they are not in memory for a prefix file's model identity; nor can the cache serve a layer
whose weights are on "meta" with nothing to load them.

Accelerate is known by the attributes it sets (`hf_device_map` on the model, `_hf_hook` on a module, the hook's
`execution_device`, `offload`, `weights_map`); nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .model_keys import key_projection

__all__ = ["PlacementError", "attention_devices", "check_placement"]

_FIX = (
    "Load the model with a device_map that keeps every decoder layer in GPU or CPU memory (device_map='auto' with "
    "a max_memory that fits, a smaller dtype, or fewer layers per GPU), or use DynamicCache for this placement."
)


class PlacementError(ValueError):
    """The model is placed where a ShadowKVCache cannot serve it; the message names the layers and the fix."""


def _attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if key_projection(module) is not None:
            yield name, module


def _hooks(module: nn.Module) -> list:
    """Accelerate's hooks on `module` (a `SequentialHook` holds several)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def _device(value) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, int):  # accelerate names a GPU by its index
        return torch.device("cuda", value)
    device = torch.device(value)
    if device.type == "cuda" and device.index is None:  # as the tensors will say: "cuda:<current>"
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _execution_device(owners: dict[str, nn.Module], name: str, module: nn.Module) -> torch.device:
    """Where `module` (named `name` among the model's modules `owners`) computes its keys: the execution device of
    the nearest accelerate hook (on its key projection, itself or a parent), else the device of that projection's
    weight."""
    parts = name.split(".") if name else []
    projection = key_projection(module)
    chain = [projection, module] + [owners[".".join(parts[:i])] for i in range(len(parts) - 1, -1, -1)]
    for owner in chain:
        for hook in _hooks(owner):
            device = _device(getattr(hook, "execution_device", None))
            if device is not None:
                return device
    return projection.weight.device


def attention_devices(model: nn.Module) -> dict[int, torch.device]:
    """`{layer index: device}` where each layer's attention computes its keys and values (its execution device)."""
    owners = dict(model.named_modules())
    return {module.layer_idx: _execution_device(owners, name, module) for name, module in _attention_modules(model)}


def _on_disk(hook) -> bool:
    """Whether an offloading hook reads its weights from files (accelerate's `OffloadedWeightsLoader` keeps an
    `index` of the weights it saved to disk, under the hook's `PrefixedDataset` prefix)."""
    if not getattr(hook, "offload", False):
        return False
    weights = getattr(hook, "weights_map", None)
    loader = getattr(weights, "dataset", weights)
    index = getattr(loader, "index", None) or {}
    prefix = getattr(weights, "prefix", "")
    return any(key.startswith(prefix) for key in index)


def check_placement(model: nn.Module) -> None:
    """Raise `PlacementError` (naming the layers and the fix) if some decoder layer's attention is placed where the
    cache cannot serve it: offloaded to disk, or on "meta" without a hook that loads it. Changes nothing."""
    on_disk = [key for key, where in (getattr(model, "hf_device_map", None) or {}).items() if where == "disk"]
    disk, unloaded = [], []
    owners = dict(model.named_modules())
    for name, module in _attention_modules(model):
        covered = any(key in ("", name) or name.startswith(key + ".") or key.startswith(name + ".") for key in on_disk)
        if covered or any(_on_disk(hook) for owner in module.modules() for hook in _hooks(owner)):
            disk.append(name)
        elif _execution_device(owners, name, module).type == "meta":
            unloaded.append(name)
    if disk:
        shown = ", ".join(disk[:4]) + (" ..." if len(disk) > 4 else "")
        raise PlacementError(
            f"ShadowKVCache cannot serve a model with layers offloaded to disk ({shown}): accelerate reads their "
            f"weights from disk at every forward, i.e. at every generated token. {_FIX}"
        )
    if unloaded:
        shown = ", ".join(unloaded[:4]) + (" ..." if len(unloaded) > 4 else "")
        raise PlacementError(
            f"ShadowKVCache cannot serve attention layers whose weights are on the 'meta' device with no accelerate "
            f"hook to load them ({shown}): the model cannot compute their keys. Load the weights first "
            f"(from_pretrained, or accelerate's load_checkpoint_and_dispatch). {_FIX}"
        )
