"""One layer's one-token decode step captured as a CUDA graph and replayed.

Legend: B batch, Hq query heads, D head dim.

Eagerly, a sparse decode step is ~40 small launches per layer (score, top-k, scan, rebuild, fetch, gather
of the attended set, attention), and at long context with a large batch the host spends more time
launching them than the GPU spends running them. Every tensor such a step reads or writes keeps its address
from step to step (the compressed prompt, the temporal cache, the token buffer; the kernels write in place),
so the step is captured once and replayed: one launch per layer. Anything that moves those tensors (rows
reordered or selected, a new prefix, the token buffer growing) changes the graph's key and the next step
captures again.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch

from ..notices import logger

__all__ = ["DecodeGraph", "GraphSwitch", "capture_or_none", "capture_stream", "collector_paused"]

_LAST: dict[int, weakref.ref] = {}
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


class GraphSwitch:
    """Whether the layers of one cache may capture their decode steps: on until a capture fails, then off for that
    cache (and the caches forked from it later), so a setup that cannot be captured is not retried at every layer.

    `per_layer` is cleared by the whole-step graph (hf/step_graph.py) for the eager steps that precede its own
    capture: each layer capturing its step there would only be replaced one step later.

    Args:
        enabled (`bool`, *optional*, defaults to True): the starting state.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._per_layer = True

    @property
    def per_layer(self) -> bool:
        """Whether a layer may capture its own one-token step now."""
        return self.enabled and self._per_layer

    def disable(self) -> None:
        self.enabled = False

    def set_per_layer(self, allowed: bool) -> None:
        self._per_layer = allowed


def _pool(device: torch.device) -> tuple:
    """The memory pool of the newest live graph on `device`, or a new one.

    Graphs replay one after another on one stream, so their temporaries can share memory (a pool per layer
    would hold ~32 copies of the attended set). A pool lives while a graph uses it: a handle kept after its
    graphs are gone must not be reused, hence the reference to a live graph rather than to a handle.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    last = _LAST.get(index)
    graph = last() if last is not None else None
    return graph.graph.pool() if graph is not None else torch.cuda.graph_pool_handle()


_PAUSES = threading.Lock()
_paused = [0, False]  # captures in progress (any thread), whether the collector was on before the first


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off for a capture: a collection inside it may destroy the graph of an
    unreachable object (a dropped cache), a call CUDA refuses while the thread captures, which invalidates the
    capture and leaves PyTorch's CUDA generator in capture mode for the rest of the process. Counted across threads:
    the collector comes back when the last capture in progress ends."""
    with _PAUSES:
        if _paused[0] == 0:
            _paused[1] = gc.isenabled()
            gc.disable()
        _paused[0] += 1
    try:
        yield
    finally:
        with _PAUSES:
            _paused[0] -= 1
            if _paused[0] == 0 and _paused[1]:
                gc.enable()


def capture_stream(index: int) -> torch.cuda.Stream:
    """One capture stream per device. `torch.cuda.graph`'s default is one stream for the whole process, made on the
    device current at the first capture: a layer on another GPU (a split model, design.md §11) would launch its work
    on its own device's streams, outside the capture."""
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


class DecodeGraph:
    """`step(query)` captured for one `key`; call it with a query `[B, Hq, 1, D]` of the captured shape.

    Args:
        step (`Callable`): the eager decode step, `query -> output`; it must not synchronise with the host.
        query (`torch.Tensor`): an example query (its shape, dtype and device are captured).
        key (`Hashable`): what the capture depends on besides the query's shape (compare before reuse).
    """

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor, key: Hashable):
        self.key = key
        self.device = query.device
        self.query = query.clone()
        self.graph = torch.cuda.CUDAGraph()
        index = query.device.index if query.device.index is not None else torch.cuda.current_device()
        # The query's device is made current: the capture, its pool and the kernels' contexts are that device's.
        # "thread_local": the capture does not forbid what other threads do (a data loader, a tokenizer).
        with (
            collector_paused(),
            torch.cuda.device(index),
            torch.cuda.graph(
                self.graph,
                pool=_pool(query.device),
                stream=capture_stream(index),
                capture_error_mode="thread_local",
            ),
        ):
            self.output = step(self.query)
        _LAST[index] = weakref.ref(self)

    def __call__(self, query: torch.Tensor) -> torch.Tensor:
        """The step's output for `query`; valid until the next replay of this graph (the next decode step)."""
        self.query.copy_(query)
        with torch.cuda.device(self.device):  # replayed on the current stream of the graph's own device
            self.graph.replay()
        return self.output


def capture_or_none(step: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor, key: Hashable):
    """A `DecodeGraph`, or `None` when the step cannot be captured on this setup. The failure is logged (logger
    "shadowkv_cache"); the caller switches graphs off for its cache, so a cache logs it once."""
    try:
        return DecodeGraph(step, query, key)
    except RuntimeError as err:
        logger.warning(
            "ShadowKV could not capture its decode step as a CUDA graph (%s); this cache decodes eagerly from now "
            "on. Pass cuda_graphs=False to skip the attempt.",
            err,
        )
        return None
