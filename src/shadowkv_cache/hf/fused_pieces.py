"""The model's own norms, dense MLPs and RoPE compiled (`torch.compile`) for one-token decode steps (design.md §3).

A captured one-token step replays the model's kernels as eager PyTorch launched them. At batch 1 those are ~60 small
launches per layer around the GEMMs: an RMSNorm is eight kernels (upcast, square, mean, add, rsqrt, two products,
downcast), RoPE ten for the query and key (products, a negation, a concatenation, a sum, each), SiLU and the gate
product two; on the Llama-3.1-8B shape at 128K that was ~60 us of a ~360 us layer, ~1.9 ms of an 11.6 ms step on an
H200 machine (`decode_profile_128k_batch1_window`). Inductor fuses each piece into one or two kernels.

Only pieces that are pure tensor functions of their inputs are compiled: the norm modules (classes of the modeling
module named `*Norm`: the decoder layers', the final one, per-head query and key norms), the dense MLPs (`*MLP`) and
the modeling module's `apply_rotary_pos_emb` (through the rotary wrapper, hf/adapters.py). Attention, the cache and
its kernels stay as they are. Each compiled function is shared by every module of its class (their parameters are
inputs of one graph) and made once per process; a new batch size or model shape compiles again (dynamo's own rule:
the second shape gets a graph with dynamic sizes). The pieces are compiled only for the one-token decode steps of a
compressed cache on one GPU (`StepGraphs.fused`), eager or captured, so the whole-step graph and `cuda_graphs=False`
run the same kernels; prefill and multi-token steps run the model as it is written.

Numerics: inductor is asked to round where eager rounds (`emulate_precision_casts`), so a 16-bit model's fused
pieces give eager's values up to the summation order of the norm (fp32). A piece that dynamo or inductor cannot
compile runs its own forward from then on, and that is logged once (logger "shadowkv_cache").
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ..notices import logger
from .step_context import rotary_replaced

__all__ = ["FusedPieces", "compiled"]

_OPTIONS = {"emulate_precision_casts": True}
_COMPILED: dict[Callable, _Compiled] = {}
_LOCK = threading.Lock()
_local = threading.local()  # .depth: the fused pieces' contexts open on this thread


class _Compiled:
    """`fn` compiled on first call; where compiling fails, `fn` itself from then on (logged once)."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        self._compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(self.fn, fullgraph=True, options=_OPTIONS)
                return self._compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # dynamo and inductor fail before running anything: the eager call is safe
                self.failed = True
                logger.warning(
                    "ShadowKV could not compile %s for its decode steps (%s: %s); it runs as the model wrote it. "
                    "Pass compile_model_ops=False to skip the attempt.",
                    self.name,
                    type(err).__name__,
                    err,
                )
        return self.fn(*args, **kwargs)


def compiled(fn: Callable, name: str | None = None) -> _Compiled:
    """The process's one compiled version of `fn` (a class's `forward` or a modeling module's function)."""
    with _LOCK:
        if fn not in _COMPILED:
            _COMPILED[fn] = _Compiled(fn, name or getattr(fn, "__qualname__", repr(fn)))
        return _COMPILED[fn]


class _Bound:
    """A module's forward while its model's pieces are fused: the class's compiled forward on a thread inside
    `FusedPieces.active`, the class's own forward on any other thread."""

    def __init__(self, module: nn.Module, fn: _Compiled):
        self._module, self._fn = weakref.ref(module), fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn if getattr(_local, "depth", 0) else self._fn.fn
        return fn(self._module(), *args, **kwargs)


class FusedPieces:
    """Which pieces of a model are compiled for its one-token decode steps, and the switch that swaps them in.

    Args:
        modeling (`module`): the model's modeling module (the classes whose norms and MLPs are compiled).
        rotary (`Callable`, *optional*): the modeling module's own `apply_rotary_pos_emb` (unwrapped); None for none.
    """

    def __init__(self, modeling: Any, rotary: Callable | None):
        self.modeling_name = modeling.__name__
        self.rotary = rotary
        self._users: dict[int, int] = {}  # id(model) -> contexts open on it (any thread)
        self._lock = threading.Lock()

    def modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of `model` that are compiled: classes of the modeling module named `*Norm` or `*MLP`, without
        a `forward` of their own set on the instance (an accelerate hook's)."""
        return [
            module
            for module in model.modules()
            if type(module).__module__ == self.modeling_name
            and type(module).__name__.endswith(("Norm", "MLP"))
            and not _own_forward(module)
        ]

    @contextmanager
    def active(self, model: nn.Module) -> Iterator[None]:
        """Run `model`'s pieces compiled on this thread until the block ends. The modules' compiled forwards are set
        while any thread is inside; each module's own forward comes back when the last one leaves, whatever ends it."""
        with self._lock:
            if not self._users.get(id(model)):
                for module in self.modules(model):
                    forward = type(module).forward
                    module.forward = _Bound(module, compiled(forward, type(module).__qualname__))
            self._users[id(model)] = self._users.get(id(model), 0) + 1
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            rotary = nullcontext()
            if self.rotary is not None:
                name = f"{self.modeling_name}.apply_rotary_pos_emb"
                rotary = rotary_replaced(self.rotary, compiled(self.rotary, name))
            with rotary:
                yield
        finally:
            _local.depth -= 1
            with self._lock:
                self._users[id(model)] -= 1
                if not self._users[id(model)]:
                    del self._users[id(model)]
                    for module in model.modules():
                        if isinstance(vars(module).get("forward"), _Bound):
                            del module.forward


def _own_forward(module: nn.Module) -> bool:
    forward = vars(module).get("forward")
    return forward is not None and not isinstance(forward, _Bound)
