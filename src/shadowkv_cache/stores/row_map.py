"""Which stored row each cache row reads: reordering or repeating rows (beam search, several questions over one
document) changes this map, never the host data.

Legend: B cache rows.
"""

from __future__ import annotations

import torch

__all__ = ["RowMap"]


class RowMap:
    """`[B]` int64 stored-row indices on the host, with a copy on one device made once (a decode step must not copy
    it from the host: that would synchronise).

    Args:
        host (`torch.Tensor`): `[B]` int64 on the CPU.
        device (`torch.device`, *optional*): make the device copy now.
    """

    def __init__(self, host: torch.Tensor, device: torch.device | None = None):
        self.host = host
        self._device: torch.Tensor | None = host.to(device) if device is not None else None

    @classmethod
    def identity(cls, rows: int, device: torch.device | None = None) -> RowMap:
        """Cache row `i` reads stored row `i`; the device copy is made on `device` if it is CUDA."""
        on = device if device is not None and device.type == "cuda" else None
        return cls(torch.arange(rows), on)

    def __len__(self) -> int:
        return len(self.host)

    @property
    def device(self) -> torch.device | None:
        """Where the device copy is, if one was made."""
        return self._device.device if self._device is not None else None

    def on(self, device: torch.device) -> torch.Tensor:
        """The map on `device`, copied once."""
        if self._device is None or self._device.device != device:
            self._device = self.host.to(device)
        return self._device

    def select(self, index: torch.Tensor) -> RowMap:
        """The map of cache rows `index` (`[B']`, any device)."""
        out = RowMap(self.host[index.to("cpu")])
        if self._device is not None:
            out._device = self._device[index.to(self._device.device)]
        return out
