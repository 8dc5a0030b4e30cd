"""The `shadowkv` operator library: every kernel entry point as a PyTorch operator (design.md §10).

Each op module registers its kernel path as `torch.ops.shadowkv.<name>`: a schema that says which arguments it
writes, a CUDA implementation that launches the NVRTC kernel on the current stream, a CPU implementation that is the
module's PyTorch twin on the same arguments (so the operator means one thing on every device, and its registration is
tested without a GPU), and a fake implementation that gives its outputs' shapes, dtypes and strides without
computing them. `torch.compile` then traces each as one opaque node, and a CUDA graph capture records its launch as it
records any PyTorch kernel.

The CUDA implementations are the kernels alone: the module's public function checks that a call fits the kernel
(dtypes, head sizes, alignment) and runs the twin otherwise, as before. Call those functions; the operators are for
tracing and capture. Where a kernel would read an argument otherwise than the twin (a softcap of 0, a grid that is not
the named quantiser's, several query tokens), the operator refuses it on every device rather than answer differently.

Registered with `torch.library.define`/`impl`/`register_fake` rather than the `torch.library.custom_op` decorator:
the decorator's Python wrapper adds autograd and aliasing checks to every call, an eager decode step calls these ops a
few hundred times, and nothing here needs autograd (design.md §10).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["NAMESPACE", "define_op", "registered_ops"]

NAMESPACE = "shadowkv"
_REGISTERED: dict[str, str] = {}  # op name -> schema


def define_op(schema: str, *, cpu: Callable, fake: Callable) -> Callable[[Callable], torch._ops.OpOverload]:
    """Register `shadowkv::<schema>`; decorates its CUDA implementation and returns the operator's overload.

    Args:
        schema (`str`): `"name(Tensor(a!) out, Tensor x, int n) -> ()"`; `(a!)` marks an argument written in place.
        cpu (`Callable`): the twin on the same arguments (the CPU implementation).
        fake (`Callable`): outputs of the right shape, dtype, device and strides, for tracing.
    """
    name, signature = schema.split("(", 1)

    def register(cuda: Callable) -> torch._ops.OpOverload:
        qualified = f"{NAMESPACE}::{name}"
        torch.library.define(qualified, "(" + signature)
        torch.library.impl(qualified, "CUDA")(cuda)
        torch.library.impl(qualified, "CPU")(cpu)
        torch.library.register_fake(qualified)(fake)
        _REGISTERED[name] = schema
        return getattr(getattr(torch.ops, NAMESPACE), name).default

    return register


def registered_ops() -> dict[str, str]:
    """Name -> schema of every registered `shadowkv` operator (import `shadowkv_cache.ops` to register them all)."""
    return dict(_REGISTERED)
