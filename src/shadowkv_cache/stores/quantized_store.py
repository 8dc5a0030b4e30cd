"""Host-memory store of a YAKV prompt: ~4-bit keys and values, one record per (row, head, token) (design.md §4).

Legend: R stored rows, B cache rows, Hkv KV heads, N quantised tokens, M sub-vectors per head vector
(D / host grid dim), K fetched tokens, E = 2*M + 4 record bytes.

A record is `[key norm fp16 | value norm fp16 | key codes (M) | value codes (M)]`: everything one selected
token needs, in one contiguous block, so a fetch moves one block per (row, head, token) (132 bytes at
D = 128 with 4-bit codes). Cache rows reach stored rows through `row_map`, so reordering or repeating rows
never copies records.
"""

from __future__ import annotations

import torch

from ..quant import QuantizedVectors
from .pinned_pool import host_copy, pinned_empty
from .row_map import RowMap

__all__ = ["QuantizedKVStore", "pack_records", "record_bytes", "unpack_records"]

_NORM_BYTES = 2


def record_bytes(num_subvectors: int) -> int:
    """E: bytes of one record for `num_subvectors` (M) codes per head vector: two fp16 norms + key and value codes."""
    return 2 * _NORM_BYTES + 2 * num_subvectors


def pack_records(keys: QuantizedVectors, values: QuantizedVectors) -> torch.Tensor:
    """Records `[..., E]` uint8 from quantised keys and values (codes `[..., M]`, norms `[...]`)."""
    return torch.cat(
        [
            keys.norms.contiguous()[..., None].view(torch.uint8),
            values.norms.contiguous()[..., None].view(torch.uint8),
            keys.codes,
            values.codes,
        ],
        dim=-1,
    )


def unpack_records(records: torch.Tensor) -> tuple[QuantizedVectors, QuantizedVectors]:
    """Quantised keys and values of records `[..., E]` (views where the layout allows)."""
    records = records.contiguous()
    m = (records.shape[-1] - 2 * _NORM_BYTES) // 2
    norms = records[..., : 2 * _NORM_BYTES].view(torch.float16)  # [..., 2]
    codes = records[..., 2 * _NORM_BYTES :]
    return (
        QuantizedVectors(codes[..., :m], norms[..., 0]),
        QuantizedVectors(codes[..., m:], norms[..., 1]),
    )


class QuantizedKVStore:
    """Records of one layer's quantised prompt tokens in host memory.

    Args:
        data (`torch.Tensor`): `[R, Hkv, N, E]` uint8 on the CPU (pinned when the model runs on CUDA).
        row_map (`torch.Tensor` or `RowMap`): `[B]` int64, the stored row behind each cache row.
    """

    def __init__(self, data: torch.Tensor, row_map: torch.Tensor | RowMap):
        if data.device.type != "cpu" or data.dtype != torch.uint8 or data.ndim != 4:
            raise ValueError(
                f"QuantizedKVStore holds uint8 [R, Hkv, N, E] host memory; got {data.dtype} {tuple(data.shape)} "
                f"on {data.device}"
            )
        self.data = data
        self.stored_rows = row_map if isinstance(row_map, RowMap) else RowMap(row_map)
        self._pointers: dict[torch.device, int] = {}  # where each device reads `data`

    @classmethod
    def offload(cls, records: torch.Tensor, pin: bool) -> QuantizedKVStore:
        """Copy `records` (`[B, Hkv, N, E]` uint8, any device) to host memory, pinned (from the pool) if `pin`."""
        # The device copy of the row map is made now, so that a decode step never copies it from the host.
        return cls(host_copy(records, pin, "YAKV store"), RowMap.identity(records.shape[0], records.device))

    @classmethod
    def from_records(cls, records: torch.Tensor, pin: bool, device: torch.device) -> QuantizedKVStore:
        """A store of records already made (`[R, Hkv, N, E]` uint8 on the CPU, e.g. views of a prefix file), copied
        into memory of its own, pinned if `pin`, for a layer on `device`."""
        return cls(host_copy(records, pin, "YAKV store"), RowMap.identity(records.shape[0], device))

    @classmethod
    def concat(cls, stores: list[QuantizedKVStore], pin: bool) -> QuantizedKVStore:
        """One store whose cache rows are those of `stores`, in order: `[sum B, Hkv, max N, E]`, pinned if `pin`.

        Stores may hold different numbers of tokens (micro batches of one batch); the missing records are zeros, as
        in a store quantised from the whole batch (nothing selects them, a whole-prompt step masks them).
        """
        widths = {s.data.shape[-1] for s in stores}
        if len(widths) != 1:
            raise ValueError(f"Cannot join YAKV stores of record sizes {sorted(widths)} (another host grid).")
        first = stores[0].data
        shape = (sum(len(s.stored_rows) for s in stores), first.shape[1], max(s.data.shape[2] for s in stores), *widths)
        out = pinned_empty(shape, torch.uint8, "joined YAKV store") if pin else torch.empty(shape, dtype=torch.uint8)
        row = 0
        for store in stores:
            held = store.data.shape[2]
            for stored in store.row_map.tolist():  # row by row: no temporary copy of a whole part
                out[row, :, :held] = store.data[stored]
                out[row, :, held:] = 0  # pooled memory is uninitialised
                row += 1
        device = next((s.stored_rows.device for s in stores if s.stored_rows.device is not None), None)
        return cls(out, RowMap.identity(shape[0], device))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def record_bytes(self) -> int:
        """E: bytes moved per fetched (row, head, token)."""
        return self.data.shape[-1]

    def device_pointer(self, device: torch.device) -> int:
        """The address at which `device` reads the pinned `data` (for the zero-copy kernel; needs cuda-python)."""
        if device not in self._pointers:
            from ..ops.loader import host_device_pointer

            self._pointers[device] = host_device_pointer(self.data, device)
        return self._pointers[device]

    @property
    def row_map(self) -> torch.Tensor:
        """`[B]` int64 on the host: the stored row behind each cache row."""
        return self.stored_rows.host

    def device_row_map(self, device: torch.device) -> torch.Tensor:
        """`row_map` on `device`, copied once."""
        return self.stored_rows.on(device)

    def select_rows(self, index: torch.Tensor) -> QuantizedKVStore:
        """A store whose cache rows are `index` (`[B']`) of this one's; shares the host data."""
        out = QuantizedKVStore(self.data, self.stored_rows.select(index))
        out._pointers = self._pointers  # the same host memory
        return out

    def rows(self, count: int) -> torch.Tensor:
        """Every record of the first `count` cache rows, `[count, Hkv, N, E]`: a view of the store when
        `count == 1` (an index tensor would first copy the document on the host)."""
        if count == 1:
            return self.data[int(self.row_map[0])][None]
        return self.data[self.row_map[:count]]
