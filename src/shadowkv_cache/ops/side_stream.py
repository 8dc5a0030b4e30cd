"""Host-to-device fetches on a side stream, beside the work queued on the current stream (design.md §3).

A decode step's fetch from pinned host memory is bound by PCIe and needs few SM cycles, so it runs beside compute
that does not depend on it: ShadowKV's value fetch beside the key rebuild (`shadowkv/temporal_cache.py`). It only
overlaps where the kernels beside it leave SM room: a YAKV step's scoring holds the register file of every SM, and
halving its batch so that one half's fetch ran beside the other's scoring made the step slower on an H200 machine
(docs/results.md). Recorded events order the two streams, so the same code runs eagerly and inside a
captured CUDA graph (where they become the graph's edges).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["SideFetch"]

_STREAMS: dict[int, torch.cuda.Stream] = {}


def _fetch_stream(index: int) -> torch.cuda.Stream:
    """One fetch stream per device, shared by all caches."""
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


class SideFetch:
    """Fetches on the device's side stream: each `run` starts after what the current stream has queued so far, and
    leaving `joined()` makes the current stream wait for every one of them.

    Tensors the fetches read were made on the current stream: keep them referenced until `joined()` ends, so that
    the caching allocator cannot hand their memory out while a fetch still reads it.

    Args:
        device (`torch.device`): a CUDA device.
    """

    def __init__(self, device: torch.device):
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._started, self._done = torch.cuda.Event(), torch.cuda.Event()

    @contextmanager
    def joined(self) -> Iterator[SideFetch]:
        main = torch.cuda.current_stream(self.index)
        try:
            yield self
        finally:
            # Joined even when the step fails (out of memory while a CUDA graph is captured): a capture left with
            # unjoined work cannot end, and PyTorch's CUDA generator would stay in capture mode for the rest of the
            # process ("Offset increment outside graph capture").
            self._done.record(_fetch_stream(self.index))
            main.wait_event(self._done)

    def run(self, fetch: Callable[..., None], *args) -> None:
        """Call `fetch(*args)` with the side stream current, after the work queued so far on the current stream."""
        side = _fetch_stream(self.index)
        self._started.record(torch.cuda.current_stream(self.index))
        side.wait_event(self._started)
        with torch.cuda.stream(side):
            fetch(*args)
