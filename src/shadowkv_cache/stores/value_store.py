"""Host-memory store of the offloaded values, chunk-major (ShadowKV §3.3).

Legend: R stored rows, B cache rows, Hkv KV heads, C chunks, c chunk size, D head dim, P payload elements
per value vector (D, or D/2 for 4-bit codes), M fetched chunks.

Layout `[R, Hkv, C, c, P]`: one (head, chunk) is one contiguous block (2 KiB for c=8, D=128 in bf16, 1 KiB
in fp8), the unit a fetch moves; a quantised format keeps its per-vector scales `[R, Hkv, C, c]` in the same
order, so a fetch is one block plus its `c` scales. The encoding is the store's codec (`stores/value_codecs.py`).
Cache rows reach stored rows through `row_map`, so reordering or repeating rows (beam search, several
questions over one document) never copies values.
"""

from __future__ import annotations

import torch

from .pinned_pool import host_copy, host_to_device, pinned_empty
from .row_map import RowMap
from .value_codecs import NativeCodec, ValueCodec, value_codec

__all__ = ["HostValueStore"]


class HostValueStore:
    """Values of one layer's compressed chunks in host memory.

    Args:
        data (`torch.Tensor`): `[R, Hkv, C, c, P]` the payload on the CPU (pinned when the model runs on CUDA):
            the values themselves for the native format, codes otherwise.
        row_map (`torch.Tensor` or `RowMap`): `[B]` int64, the stored row behind each cache row.
        scales (`torch.Tensor`, *optional*): `[R, Hkv, C, c]` one scale per value vector (quantised formats).
        codec (`ValueCodec`, *optional*): how `data` and `scales` decode; the native format by default.
    """

    def __init__(
        self,
        data: torch.Tensor,
        row_map: torch.Tensor | RowMap,
        scales: torch.Tensor | None = None,
        codec: ValueCodec | None = None,
    ):
        codec = codec or NativeCodec(data.shape[-1])
        if data.device.type != "cpu" or (scales is not None and scales.device.type != "cpu"):
            raise ValueError(f"HostValueStore holds host memory; got a tensor on {data.device}")
        if (scales is None) != (codec.scale_dtype is None):
            raise ValueError(f"The {codec.name} value format {'needs' if scales is None else 'has no'} scales.")
        self.data, self.scales, self.codec = data, scales, codec
        self.stored_rows = row_map if isinstance(row_map, RowMap) else RowMap(row_map)
        self._pointers: dict[tuple[str, torch.device], int] = {}  # ("data" or "scales", device) -> address

    @classmethod
    def offload(cls, values: torch.Tensor, pin: bool, value_format: str = "native") -> HostValueStore:
        """Encode `values` (`[B, Hkv, C, c, D]`, any device) in `value_format` and copy them to host memory,
        pinned if `pin`.

        Pinned stores come from the process-wide `pinned_pool()`, which pins once and reuses blocks across
        caches and requests (pinning fresh memory is slow). Quantised formats encode on the values' device,
        one (row, head) at a time, so the float32 temporaries stay that size (64 MiB at 128K tokens, D=128).
        """
        codec = value_codec(value_format, values.shape[-1])
        if codec.scale_dtype is None:
            return cls._adopt(values, None, codec, pin)
        heads = values.flatten(0, 1)  # [B*Hkv, C, c, D]
        pieces = [codec.encode(head) for head in heads.split(1)] or [codec.encode(heads)]
        payload = torch.cat([p for p, _ in pieces]).view(*values.shape[:-1], codec.payload_dim)
        scales = torch.cat([s for _, s in pieces]).view(values.shape[:-1])
        return cls._adopt(payload, scales, codec, pin)

    @classmethod
    def from_encoded(
        cls, payload: torch.Tensor, scales: torch.Tensor | None, codec: ValueCodec, pin: bool
    ) -> HostValueStore:
        """A store of an already encoded `payload` (`[R, Hkv, C, c, P]`) and `scales` (a loaded prefix)."""
        return cls._adopt(payload, scales, codec, pin)

    @classmethod
    def _adopt(cls, payload: torch.Tensor, scales: torch.Tensor | None, codec: ValueCodec, pin: bool):
        if payload.device.type == "cpu" and not pin:
            data, host_scales = (
                payload.contiguous().clone(),
                scales.contiguous().clone() if scales is not None else None,
            )
        else:
            data = host_copy(payload, pin, "value store")
            host_scales = host_copy(scales, pin, "value scales") if scales is not None else None
        # The device copy of the row map is made now, so the first decode step does not copy it (a synchronisation).
        store = cls(data, RowMap.identity(payload.shape[0], payload.device), host_scales, codec)
        if payload.is_cuda:
            codec.prepare(payload.device)
        return store

    @classmethod
    def concat(cls, stores: list[HostValueStore], pin: bool) -> HostValueStore:
        """One store whose cache rows are those of `stores`, in order: `[sum B, Hkv, max C, c, ...]`, pinned if
        `pin`. The stores must share one value format.

        Stores may hold different numbers of chunks (micro batches of one batch); the missing chunks are zeros,
        as in a store compressed from the whole batch (nothing selects them, a whole-prompt step masks them).
        """
        codec = stores[0].codec
        if any(s.codec.name != codec.name for s in stores):
            raise ValueError(f"Cannot join value stores of formats {sorted({s.codec.name for s in stores})}.")
        rows = sum(len(s.stored_rows) for s in stores)
        chunks = max(s.data.shape[2] for s in stores)

        def joined(parts: list[torch.Tensor]) -> torch.Tensor:
            first = parts[0]
            shape = (rows, first.shape[1], chunks, *first.shape[3:])
            out = (
                pinned_empty(shape, first.dtype, "joined value store") if pin else torch.empty(shape, dtype=first.dtype)
            )
            row = 0
            for store, part in zip(stores, parts):
                held = part.shape[2]
                for stored in store.row_map.tolist():  # row by row: no temporary copy of a whole part
                    out[row, :, :held] = part[stored]
                    out[row, :, held:] = 0  # pooled memory is uninitialised
                    row += 1
            return out

        data = joined([s.data for s in stores])
        scales = joined([s.scales for s in stores]) if stores[0].scales is not None else None
        device = next((s.stored_rows.device for s in stores if s.stored_rows.device is not None), None)
        return cls(data, RowMap.identity(rows, device), scales, codec)

    @property
    def nbytes(self) -> int:
        """Host bytes at their stored size: payload plus scales."""
        scales = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + scales

    def device_pointer(self, device: torch.device) -> int:
        """The address at which `device` reads the pinned `data` (for zero-copy kernels; needs cuda-python)."""
        return self._pointer("data", device)

    def scales_pointer(self, device: torch.device) -> int:
        """The address at which `device` reads the pinned `scales`."""
        return self._pointer("scales", device)

    def _pointer(self, name: str, device: torch.device) -> int:
        key = (name, device)
        if key not in self._pointers:
            from ..ops.loader import host_device_pointer

            self._pointers[key] = host_device_pointer(getattr(self, name), device)
        return self._pointers[key]

    @property
    def row_map(self) -> torch.Tensor:
        """`[B]` int64 on the host: the stored row behind each cache row."""
        return self.stored_rows.host

    def device_row_map(self, device: torch.device) -> torch.Tensor:
        """`row_map` on `device`, copied once."""
        return self.stored_rows.on(device)

    def select_rows(self, index: torch.Tensor) -> HostValueStore:
        """A store whose cache rows are `index` (`[B']`) of this one's; shares the host data."""
        out = HostValueStore(self.data, self.stored_rows.select(index), self.scales, self.codec)
        out._pointers = self._pointers  # the same host memory
        return out

    def gather(
        self,
        rows: torch.Tensor,
        heads: torch.Tensor,
        chunks: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Decoded value chunks `[M, c, D]` on `device`, in `dtype` (the payload's by default), for cache rows,
        heads and chunk ids (each `[M]`)."""
        # PyTorch path: index on the host, copy the encoded blocks, decode there. The kernels read in place.
        rows, heads, chunks = rows.to("cpu"), heads.to("cpu"), chunks.to("cpu")
        index = (self.row_map[rows], heads, chunks)
        payload = host_to_device(self.data[index], device)
        scales = host_to_device(self.scales[index], device) if self.scales is not None else None
        return self.codec.decode(payload, scales, dtype or self.data.dtype)

    def read_rows(self, rows: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Decoded values `[rows, Hkv, C*c, D]` of cache rows `0..rows-1` on `device` (a whole-prompt step).

        One row is read as a view of the (pinned) store; an index tensor would first copy it on the host.
        The encoded payload crosses to the device, which decodes it.
        """

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[int(self.row_map[0])][None] if rows == 1 else t[self.row_map[:rows]]

        payload = take(self.data).to(device, non_blocking=True)
        scales = take(self.scales).to(device, non_blocking=True) if self.scales is not None else None
        return self.codec.decode(payload, scales, dtype).flatten(2, 3)
