"""Host-memory store of the offloaded values, chunk-major (ShadowKV §3.3).

Legend: R stored rows, B cache rows, Hkv KV heads, C chunks, c chunk size, D head dim, M fetched chunks.

Layout `[R, Hkv, C, c, D]`: one (head, chunk) is one contiguous block (2 KiB for c=8, D=128 in bf16), the
unit a fetch moves. Cache rows reach stored rows through `row_map`, so reordering or repeating rows (beam
search, several questions over one document) never copies values.
"""

from __future__ import annotations

import torch

from .pinned_pool import pinned_pool

__all__ = ["HostValueStore"]


class HostValueStore:
    """Values of one layer's compressed chunks in host memory.

    Args:
        data (`torch.Tensor`): `[R, Hkv, C, c, D]` on the CPU (pinned when the model runs on CUDA).
        row_map (`torch.Tensor`): `[B]` int64, the stored row behind each cache row.
    """

    def __init__(self, data: torch.Tensor, row_map: torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"HostValueStore holds host memory; got a tensor on {data.device}")
        self.data = data
        self.row_map = row_map
        self._device_pointer: int | None = None
        self._device_row_map: torch.Tensor | None = None

    @classmethod
    def offload(cls, values: torch.Tensor, pin: bool) -> HostValueStore:
        """Copy `values` (`[B, Hkv, C, c, D]`, any device) to host memory, pinned if `pin`.

        Pinned stores come from the process-wide `pinned_pool()`, which pins once and reuses blocks across
        caches and requests (pinning fresh memory is slow).
        """
        if values.device.type == "cpu" and not pin:
            data = values.contiguous().clone()
        elif not pin:
            data = values.to("cpu")
        else:
            try:
                data = pinned_pool().allocate(values.shape, values.dtype)
            except RuntimeError as err:
                raise RuntimeError(
                    f"Could not pin {values.numel() * values.element_size() / 2**30:.2f} GiB of host memory for "
                    "the ShadowKV value store. Free host memory, lower the batch size, or pass pin_memory=False "
                    "(slower fetches)."
                ) from err
            # A blocking copy: the store is read by host-side gathers right after prefill.
            data.copy_(values)
        store = cls(data, torch.arange(values.shape[0]))
        if values.is_cuda:  # made now, so the first decode step does not copy it (a host synchronisation)
            store._device_row_map = torch.arange(values.shape[0], device=values.device)
        return store

    @classmethod
    def concat(cls, stores: list[HostValueStore], pin: bool) -> HostValueStore:
        """One store whose cache rows are those of `stores`, in order: `[sum B, Hkv, max C, c, D]`, pinned if `pin`.

        Stores may hold different numbers of chunks (micro batches of one batch); the missing chunks are zeros,
        as in a store compressed from the whole batch (nothing selects them, a whole-prompt step masks them).
        """
        first = stores[0].data
        rows = sum(len(s.row_map) for s in stores)
        shape = (rows, first.shape[1], max(s.data.shape[2] for s in stores), *first.shape[3:])
        if pin:
            try:
                data = pinned_pool().allocate(shape, first.dtype)
            except RuntimeError as err:
                raise RuntimeError(
                    f"Could not pin {torch.Size(shape).numel() * first.element_size() / 2**30:.2f} GiB of host "
                    "memory for the joined ShadowKV value store. Free host memory, lower the batch size, or pass "
                    "pin_memory=False."
                ) from err
        else:
            data = torch.empty(shape, dtype=first.dtype)
        row = 0
        for s in stores:
            chunks = s.data.shape[2]
            for stored in s.row_map.tolist():  # row by row: no temporary copy of a whole part
                data[row, :, :chunks] = s.data[stored]
                data[row, :, chunks:] = 0  # pooled memory is uninitialised
                row += 1
        store = cls(data, torch.arange(shape[0]))
        device_maps = [s._device_row_map for s in stores if s._device_row_map is not None]
        if device_maps:  # made now, as `offload` does, so that the first decode step does not copy it
            store._device_row_map = torch.arange(shape[0], device=device_maps[0].device)
        return store

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def device_pointer(self) -> int:
        """The device-visible address of the pinned `data` (for zero-copy kernels; needs cuda-python)."""
        if self._device_pointer is None:
            from .kernel_loader import host_device_pointer

            self._device_pointer = host_device_pointer(self.data)
        return self._device_pointer

    def device_row_map(self, device: torch.device) -> torch.Tensor:
        """`row_map` on `device`, copied once."""
        if self._device_row_map is None or self._device_row_map.device != device:
            self._device_row_map = self.row_map.to(device)
        return self._device_row_map

    def select_rows(self, index: torch.Tensor) -> HostValueStore:
        """A store whose cache rows are `index` (`[B']`) of this one's; shares the host data."""
        out = HostValueStore(self.data, self.row_map[index.to("cpu")])
        if self._device_row_map is not None:
            out._device_row_map = self._device_row_map[index.to(self._device_row_map.device)]
        out._device_pointer = self._device_pointer
        return out

    def gather(
        self, rows: torch.Tensor, heads: torch.Tensor, chunks: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """Value chunks `[M, c, D]` on `device` for cache rows, heads and chunk ids (each `[M]`)."""
        # PyTorch path: index on the host, then one copy. The CUDA kernel path reads pinned memory in place.
        rows, heads, chunks = rows.to("cpu"), heads.to("cpu"), chunks.to("cpu")
        block = self.data[self.row_map[rows], heads, chunks]
        if device.type == "cuda":
            return block.pin_memory().to(device, non_blocking=True)
        return block.to(device)
