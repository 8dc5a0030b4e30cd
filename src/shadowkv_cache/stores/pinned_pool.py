"""A process-wide pool of pinned (page-locked) host memory for the value stores.

Pinning fresh host memory is slow (about 1.5 GB/s was measured on the H200 machine: 75 s for 112 GiB), so
the value stores of all caches and requests draw from one pool that pins once and reuses: a block freed by
a dropped cache goes back to the pool and serves the next prefill of a similar size.

Blocks are plain host allocations registered with `cudaHostRegister`, sized exactly (rounded up to 2 MiB).
PyTorch's own pinned allocator rounds every request up to a power of two, which would waste up to half of
the host memory the stores need at long context. A tensor handed out by `allocate` returns its block to the
pool when that tensor object is garbage-collected, so its owner must keep it (views alone do not count).
`release_cached()` unpins the free blocks; the pool also does it by itself when pinning a new block fails.

`HUGE_PAGES` (off by default) backs new blocks with 2 MiB pages where the kernel's transparent huge pages allow
(`madvise(MADV_HUGEPAGE)` on an anonymous mapping before it is pinned). The GPU reads the value stores in place,
a few hundred bytes at a time spread over tens of GiB, and a page of 4 KiB holds few of those reads: whether larger
pages make that fetch faster is what `benchmarks/throughput.py --huge-pages` measures (not yet measured).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["HUGE_PAGES", "PinnedPool", "host_copy", "pinned_empty", "pinned_pool", "use_huge_pages"]

_ALIGN = 2 << 20
HUGE_PAGES = False  # new blocks on 2 MiB pages (see the module docstring); read when a block is made


def use_huge_pages(enabled: bool) -> None:
    """Make the pool's new blocks on 2 MiB pages (`enabled`) or on the allocator's own; pinned blocks keep theirs."""
    global HUGE_PAGES
    HUGE_PAGES = bool(enabled)


def _huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` (a multiple of 2 MiB) uint8 of an anonymous mapping, 2 MiB aligned and advised to use huge pages.
    The tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, nbytes + _ALIGN, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    start = -ctypes.addressof(view) % _ALIGN
    del view  # a live export would keep the mapping from being closed when the tensor dies
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the block is an aligned mapping of normal pages
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return torch.frombuffer(mapping, dtype=torch.uint8)[start : start + nbytes]


def _cuda_register(tensor: torch.Tensor) -> None:
    # portable | mapped: every GPU's context may read it in place (a model split over GPUs, design.md §11).
    err = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 3))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {err}")


def _cuda_unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


@dataclass
class _Block:
    buffer: torch.Tensor  # [nbytes] uint8, registered (pinned)
    in_use: bool = False


class PinnedPool:
    """Best-fit reuse of pinned blocks; grows when no free block fits.

    Args:
        register, unregister: pin / unpin a uint8 CPU tensor (CUDA's by default; tests pass fakes).
        max_slack (`float`, *optional*, defaults to 0.25): a free block is reused for a request only if it
            is at most this share larger, so one large free block is not spent on a small request.
    """

    def __init__(
        self,
        register: Callable[[torch.Tensor], None] = _cuda_register,
        unregister: Callable[[torch.Tensor], None] = _cuda_unregister,
        max_slack: float = 0.25,
    ):
        self._register, self._unregister, self._max_slack = register, unregister, max_slack
        self._blocks: list[_Block] = []
        self._lock = threading.Lock()

    @property
    def pinned_bytes(self) -> int:
        return sum(b.buffer.numel() for b in self._blocks)

    @property
    def used_bytes(self) -> int:
        return sum(b.buffer.numel() for b in self._blocks if b.in_use)

    def allocate(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised pinned tensor of `shape` and `dtype`; its block returns when it is collected."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            block = self._best_fit(nbytes)
            if block is None:
                block = self._new_block(max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN))
            block.in_use = True
        tensor = block.buffer[:nbytes].view(dtype).view(shape)
        weakref.finalize(tensor, self._give_back, block)
        return tensor

    def release_cached(self) -> int:
        """Unpin and free every block not in use; returns the bytes released."""
        with self._lock:
            return self._release_free()

    def _best_fit(self, nbytes: int) -> _Block | None:
        fits = [
            b
            for b in self._blocks
            if not b.in_use and nbytes <= b.buffer.numel() <= nbytes * (1 + self._max_slack) + _ALIGN
        ]
        return min(fits, key=lambda b: b.buffer.numel(), default=None)

    def _new_block(self, nbytes: int) -> _Block:
        for attempt in range(2):
            try:
                buffer = _huge_page_buffer(nbytes) if HUGE_PAGES else torch.empty(nbytes, dtype=torch.uint8)
                self._register(buffer)
                break
            except RuntimeError:
                if attempt or not self._release_free():
                    raise
        block = _Block(buffer)
        self._blocks.append(block)
        return block

    def _release_free(self) -> int:
        free = [b for b in self._blocks if not b.in_use]
        for b in free:
            self._unregister(b.buffer)
        self._blocks = [b for b in self._blocks if b.in_use]
        return sum(b.buffer.numel() for b in free)

    def _give_back(self, block: _Block) -> None:
        with self._lock:
            block.in_use = False


_POOL: PinnedPool | None = None


def pinned_pool() -> PinnedPool:
    """The process-wide pool (created on first use)."""
    global _POOL
    if _POOL is None:
        _POOL = PinnedPool()
    return _POOL


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, what: str) -> torch.Tensor:
    """An uninitialised pinned tensor from the pool, or a `RuntimeError` that says how much could not be pinned
    for `what` and what to do about it."""
    try:
        return pinned_pool().allocate(shape, dtype)
    except RuntimeError as err:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raise RuntimeError(
            f"Could not pin {nbytes / 2**30:.2f} GiB of host memory for the ShadowKV {what}. Free host memory, lower "
            "the batch size, store values as fp8/higgs4 (value_format), or pass pin_memory=False (slower fetches)."
        ) from err


def host_to_device(block: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`block` (host memory, e.g. gathered rows) on `device`: through pinned memory to a GPU, asynchronously."""
    if device.type == "cuda":
        return block.pin_memory().to(device, non_blocking=True)
    return block.to(device)


def host_copy(tensor: torch.Tensor, pin: bool, what: str) -> torch.Tensor:
    """A host copy of `tensor` (any device), pinned from the pool if `pin` (`what` names it in errors)."""
    if not pin:
        return tensor.to("cpu", copy=True).contiguous()
    data = pinned_empty(tensor.shape, tensor.dtype, what)
    data.copy_(tensor)  # blocking: the store may be read by host-side gathers right away
    return data
