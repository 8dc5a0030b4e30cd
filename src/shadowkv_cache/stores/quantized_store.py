"""Host-memory store of a YAKV prompt: ~4-bit keys and values, one record per (row, head, token) (design.md §4).

Legend: R stored rows, B cache rows, Hkv KV heads, N quantised tokens, M sub-vectors per head vector
(D / host grid dim), K fetched tokens, E = 2*M + 4 record bytes, N' mirrored tokens.

A record is `[key norm fp16 | value norm fp16 | key codes (M) | value codes (M)]`: everything one selected
token needs, in one contiguous block, so a fetch moves one block per (row, head, token) (132 bytes at
D = 128 with 4-bit codes). Cache rows reach stored rows through `row_map`, so reordering or repeating rows
never copies records.

A store may also keep a device mirror of each stored row's first N' tokens (`device_record_share`, design.md §4):
a GPU with memory to spare then reads those records at HBM speed and only the rest cross PCIe. The host copy stays
whole (prefix files, dense steps and the twins read it); the mirror is a copy and changes no result.
"""

from __future__ import annotations

import torch

from ..quant import QuantizedVectors
from .pinned_pool import host_copy, host_to_device, pinned_empty
from .row_map import RowMap

__all__ = ["QuantizedKVStore", "mirrored_tokens", "pack_records", "record_bytes", "unpack_records"]

_NORM_BYTES = 2


def record_bytes(num_subvectors: int) -> int:
    """E: bytes of one record for `num_subvectors` (M) codes per head vector: two fp16 norms + key and value codes."""
    return 2 * _NORM_BYTES + 2 * num_subvectors


def mirrored_tokens(share: float, num_tokens: int) -> int:
    """N': tokens per stored row and head whose records a `share` of `num_tokens` mirrors on the device."""
    return min(num_tokens, int(share * num_tokens))


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
        mirror (`torch.Tensor`, *optional*): `[R, Hkv, N', E]` uint8 on a GPU, a copy of `data[:, :, :N']`
            (`with_mirror` makes it).
    """

    def __init__(self, data: torch.Tensor, row_map: torch.Tensor | RowMap, mirror: torch.Tensor | None = None):
        if data.device.type != "cpu" or data.dtype != torch.uint8 or data.ndim != 4:
            raise ValueError(
                f"QuantizedKVStore holds uint8 [R, Hkv, N, E] host memory; got {data.dtype} {tuple(data.shape)} "
                f"on {data.device}"
            )
        if mirror is not None and (
            mirror.dtype != torch.uint8
            or mirror.ndim != 4
            or mirror.shape[:2] != data.shape[:2]
            or mirror.shape[2] > data.shape[2]
            or mirror.shape[3] != data.shape[3]
        ):
            raise ValueError(
                f"A YAKV store's device mirror must be uint8 [R, Hkv, N' <= N, E] of its records "
                f"{tuple(data.shape)}; got {mirror.dtype} {tuple(mirror.shape)}"
            )
        self.data = data
        self.mirror = mirror
        self.stored_rows = row_map if isinstance(row_map, RowMap) else RowMap(row_map)
        self._pointers: dict[torch.device, int] = {}  # where each device reads `data`

    @classmethod
    def offload(cls, records: torch.Tensor, pin: bool, mirror_share: float = 0.0) -> QuantizedKVStore:
        """Copy `records` (`[B, Hkv, N, E]` uint8, any device) to host memory, pinned (from the pool) if `pin`; on a
        GPU, keep a `mirror_share` of each row's tokens there too (`with_mirror`)."""
        # The device copy of the row map is made now, so that a decode step never copies it from the host.
        store = cls(host_copy(records, pin, "YAKV store"), RowMap.identity(records.shape[0], records.device))
        return store.with_mirror(mirror_share, records.device, records)

    @classmethod
    def from_records(
        cls, records: torch.Tensor, pin: bool, device: torch.device, mirror_share: float = 0.0
    ) -> QuantizedKVStore:
        """A store of records already made (`[R, Hkv, N, E]` uint8 on the CPU, e.g. views of a prefix file), copied
        into memory of its own, pinned if `pin`, for a layer on `device` (mirrored there as `offload` does)."""
        store = cls(host_copy(records, pin, "YAKV store"), RowMap.identity(records.shape[0], device))
        return store.with_mirror(mirror_share, device)

    def with_mirror(self, share: float, device: torch.device, records: torch.Tensor | None = None) -> QuantizedKVStore:
        """This store (the same host data and rows) with each stored row's first `mirrored_tokens(share, N)` records
        also on `device`, copied from `records` (this store's records already on `device`) or from the host. A CPU
        device, or a share that mirrors no token, gives a store without a mirror."""
        count = mirrored_tokens(share, self.data.shape[2]) if device.type == "cuda" else 0
        return self._mirrored(count, device, records)

    def _mirrored(self, count: int, device: torch.device, records: torch.Tensor | None = None) -> QuantizedKVStore:
        """This store with its first `count` tokens' records mirrored on `device` (no mirror for 0)."""
        if count == 0:
            mirror = None
        elif records is not None and records.device == device:
            mirror = records[:, :, :count].clone()
        else:  # row by row: a strided host slice is copied through a contiguous temporary
            mirror = torch.empty((*self.data.shape[:2], count, self.data.shape[3]), dtype=torch.uint8, device=device)
            for row in range(self.data.shape[0]):
                mirror[row].copy_(self.data[row, :, :count])
        out = QuantizedKVStore(self.data, self.stored_rows, mirror)
        out._pointers = self._pointers  # the same host memory
        return out

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
        joined = cls(out, RowMap.identity(shape[0], device))
        # Parts mirror floor(share * N_i) tokens; the largest part's count is floor(share * max N_i), the whole's.
        mirrors = [s.mirror for s in stores if s.mirror is not None]
        if not mirrors:
            return joined
        return joined._mirrored(max(m.shape[2] for m in mirrors), mirrors[0].device)

    @property
    def nbytes(self) -> int:
        """Host bytes."""
        return self.data.numel()

    @property
    def mirror_nbytes(self) -> int:
        """Device bytes of the mirror (0 without one)."""
        return 0 if self.mirror is None else self.mirror.numel()

    @property
    def mirrored_tokens(self) -> int:
        """N': tokens per stored row and head that the device mirror holds."""
        return 0 if self.mirror is None else self.mirror.shape[2]

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
        out = QuantizedKVStore(self.data, self.stored_rows.select(index), self.mirror)
        out._pointers = self._pointers  # the same host memory
        return out

    def read(self, rows: torch.Tensor, heads: torch.Tensor, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Records `[..., E]` on `device` of the (stored row, head, token) indices `rows`, `heads`, `tokens` (int64 on
        the CPU, broadcast together): tokens below `mirrored_tokens` from the mirror, the others from the host (the
        definition of what the fetch kernel reads; synchronous)."""
        rows, heads, tokens = torch.broadcast_tensors(rows, heads, tokens)
        out = host_to_device(self.data[rows, heads, tokens], device)
        close = tokens < self.mirrored_tokens
        if self.mirror is not None and bool(close.any()):
            near = [index[close].to(self.mirror.device) for index in (rows, heads, tokens)]
            out[close.to(device)] = self.mirror[tuple(near)].to(device)
        return out

    def host_reads(self, ids: torch.Tensor, fetch: torch.Tensor) -> torch.Tensor:
        """Of the tokens `ids` (`[B, Hkv, K]`) flagged in `fetch` (bool, same shape), how many are read from host
        memory (a device scalar: no synchronisation), the others being in the mirror."""
        if self.mirror is None:
            return fetch.sum()
        return (fetch & (ids >= self.mirrored_tokens)).sum()

    def rows_on(self, count: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """Every record of the first `count` cache rows on `device`, `[count, Hkv, N, E]`, and the bytes that crossed
        from the host: the mirrored tokens are copied on the device, only the others come from host memory."""
        if self.mirror is None or self.mirror.device != device:
            records = self.rows(count).to(device, non_blocking=True)
            return records, records.numel()
        near = self.mirrored_tokens
        far = self.rows(count, near)
        out = torch.empty((count, *self.data.shape[1:]), dtype=torch.uint8, device=device)
        out[:, :, :near] = self.mirror[self.device_row_map(device)[:count]]
        out[:, :, near:] = far.to(device, non_blocking=True)
        return out, far.numel()

    def rows(self, count: int, first_token: int = 0) -> torch.Tensor:
        """The records of tokens `first_token` on of the first `count` cache rows, `[count, Hkv, N - first_token, E]`:
        a view of the store when `count == 1` (an index tensor would first copy the document on the host)."""
        if count == 1:
            return self.data[int(self.row_map[0]), :, first_token:][None]
        return self.data[self.row_map[:count], :, first_token:]
