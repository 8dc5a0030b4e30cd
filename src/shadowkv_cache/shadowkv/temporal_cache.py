"""The temporal cache: chunks selected at the previous step stay on the device (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, K selected chunks (slots), c chunk size, D head dim, M missed chunks.

Consecutive decode steps select largely the same chunks, so only the misses are rebuilt (keys) and
fetched from host memory (values). The hit rate sets the PCIe bytes per step.

Held chunks never move: the scan keeps a slot while its chunk is still wanted and gives each new chunk a
freed slot, flagging it as a miss. On CUDA the three steps are kernels of fixed size (no host
synchronisation): the scan on the current stream; the value fetch from pinned host memory on a side stream,
overlapping the key rebuild on the current stream; the current stream then waits for the fetch.
"""

from __future__ import annotations

import torch

from ..ops.gather_values import gather_values
from ..ops.rebuild_keys import RopeFn, rebuild_missed_keys
from ..ops.temporal_scan import temporal_scan
from .prompt import CompressedPrompt

__all__ = ["TemporalCache"]

_SIDE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, main: torch.cuda.Stream) -> torch.cuda.Stream:
    """The fetch stream of steps that run on `main`: one per device and main stream, shared by all caches, so steps
    driven from two streams (two requests, two halves of a batch in one graph) fetch side by side, not one after the
    other on a shared stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, main.cuda_stream)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[key]


class TemporalCache:
    """Selected chunks of one layer: ids `[B, Hkv, K]` (-1 = empty slot), keys and values `[B, Hkv, K, c, D]`, and
    which slots each row's budget uses, `valid` `[B, Hkv, K]` bool (the first `budget_chunks[row]` of every head)."""

    def __init__(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor):
        self.ids, self.keys, self.values = ids.contiguous(), keys.contiguous(), values.contiguous()
        self.valid = valid.contiguous()
        # Counted on the device so that statistics never force a host synchronisation: the misses and the steps,
        # which the scan adds itself (`counts`). Every step looks up the same number of chunks, so that count is
        # taken once.
        self._lookups_per_step = self.valid.sum()
        self.counts = torch.zeros(2, dtype=torch.int64, device=ids.device)  # misses, steps
        self._before = torch.zeros(2, dtype=torch.int64, device=ids.device)  # misses, lookups of the rows it came from
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @classmethod
    def empty(cls, prompt: CompressedPrompt, num_slots: int) -> TemporalCache:
        batch, heads = prompt.selectable.shape[:2]
        c, d = prompt.chunk_size, prompt.outlier_keys.shape[-1]
        like = prompt.outlier_keys
        ids = torch.full((batch, heads, num_slots), -1, dtype=torch.int64, device=like.device)
        zeros = like.new_zeros((batch, heads, num_slots, c, d))
        valid = torch.arange(num_slots, device=like.device) < prompt.budget_chunks.to(like.device)[:, None, None]
        return cls(ids, zeros, zeros.clone(), valid.expand(batch, heads, num_slots))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.keys, self.values, self.valid))

    @property
    def lookups(self) -> torch.Tensor:
        """Chunks selected so far (a device scalar)."""
        return self._before[1] + self.counts[1] * self._lookups_per_step

    @property
    def hits(self) -> torch.Tensor:
        """Chunks selected so far that the cache already held (a device scalar)."""
        return self.lookups - self._before[0] - self.counts[0]

    def reset_counts(self) -> None:
        """Zero `hits` and `lookups`, in place (captured CUDA graphs go on counting in the same tensors)."""
        self.counts.zero_()
        self._before.zero_()

    @property
    def held(self) -> torch.Tensor:
        """`[B, Hkv, K]` bool: slots that hold a chunk (the attention mask of the selected part)."""
        return self.ids >= 0

    def refresh(self, wanted: torch.Tensor, prompt: CompressedPrompt, rope: RopeFn) -> None:
        """Hold the chunks `wanted` (`[B, Hkv, K]`, the entries where `self.valid` count): keep hits, rebuild and fetch
        misses."""
        units = prompt.selectable.shape[-1]
        self.ids, miss = temporal_scan(self.ids, wanted, self.valid, units=units, counts=self.counts)
        if self.keys.is_cuda:
            main = torch.cuda.current_stream(self.keys.device)
            side = _side_stream(self.keys.device, main)
            if self._events is None:
                self._events = (torch.cuda.Event(), torch.cuda.Event())
            scanned, fetched = self._events
            scanned.record(main)
            side.wait_event(scanned)
            # Tensors used on the side stream were made on the main stream, which waits for `fetched` below
            # before any later work, so the caching allocator cannot hand them out while the fetch runs.
            try:
                with torch.cuda.stream(side):
                    gather_values(self.values, self.ids, miss, prompt.values)
                rebuild_missed_keys(self.keys, self.ids, miss, prompt.a, prompt.b, prompt.positions, rope)
            finally:
                # Joined even when the step fails (out of memory while a CUDA graph is captured): a capture left
                # with unjoined work cannot end, and PyTorch's CUDA generator would stay in capture mode for the
                # rest of the process ("Offset increment outside graph capture").
                fetched.record(side)
                main.wait_event(fetched)
        else:
            gather_values(self.values, self.ids, miss, prompt.values)
            rebuild_missed_keys(self.keys, self.ids, miss, prompt.a, prompt.b, prompt.positions, rope)

    def select_rows(self, index: torch.Tensor) -> TemporalCache:
        out = TemporalCache(self.ids[index], self.keys[index], self.values[index], self.valid[index])
        lookups = self.lookups
        out._before = torch.stack((lookups - self.hits, lookups))  # counted on with the selected rows' lookups
        return out
