"""Fetch of the selected tokens' quantised keys and values from host memory, dequantised on the device (YAKV).

Legend: B batch, Hkv KV heads, K selected tokens per head, N stored tokens, E record bytes, D head dim.

`gather_dequant_reference` is the definition (and the CPU path): it indexes the store on the host (which needs
the ids there: one synchronisation per call on CUDA), copies the records to the device and dequantises them.
On CUDA with a pinned store, `kernels/gather_dequant.cu` reads each selected record in place through its
device-visible address (zero copy, ids stay on the device, no synchronisation) and decodes it on the way:
only the ~4-bit records cross PCIe. Tokens a device mirror holds (`QuantizedKVStore.mirror`) are read from it
instead, at HBM speed.

`gather_dequant_missed` refreshes a layer's held tokens in place (YAKV's token reuse, design.md §4): only the slots
flagged as missed by the temporal scan are read and written, so a step moves the records of its new tokens alone.
"""

from __future__ import annotations

import ctypes

import torch

from ..quant import HiggsQuantizer, check_tables, higgs_quantizer
from ..stores.quantized_store import QuantizedKVStore, record_bytes, unpack_records
from .library import define_op
from .loader import kernels_available, load_kernels

__all__ = [
    "dequant_records",
    "gather_dequant",
    "gather_dequant_missed",
    "gather_dequant_op",
    "gather_dequant_missed_reference",
    "gather_dequant_reference",
    "gather_records",
]

_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_DIM = 256  # 8 coordinates per lane; the kernel's record buffer holds (D + 4) bytes at most
_WARPS = 8  # warps per block
# Slots per warp, whose loads are all issued before the first record is decoded (GD_RECORDS in the kernel). Four were
# meant to keep more PCIe round trips in flight when most records come from the device mirror; at 128K batch 22 on an
# H200 machine they changed nothing measurable (docs/results.md), so one stays. A module setting so that benchmarks
# can compare (speed.py --gather-records).
RECORDS_PER_WARP = 1


def gather_records(store: QuantizedKVStore, ids: torch.Tensor) -> torch.Tensor:
    """Records `[B, Hkv, K, E]` on `ids.device` of the tokens `ids` (`[B, Hkv, K]` int64, `< N`)."""
    batch, heads, _ = ids.shape
    rows = store.row_map[:batch, None, None]
    return store.read(rows, torch.arange(heads)[None, :, None], ids.to("cpu"), ids.device)


def dequant_records(
    records: torch.Tensor, quantizer: HiggsQuantizer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[..., D]` in `dtype` from records `[..., E]`."""
    keys, values = unpack_records(records)
    return quantizer.dequantize(keys, dtype), quantizer.dequantize(values, dtype)


def gather_dequant_reference(
    store: QuantizedKVStore, ids: torch.Tensor, quantizer: HiggsQuantizer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch twin of `gather_dequant` (synchronises on CUDA)."""
    return dequant_records(gather_records(store, ids), quantizer, dtype)


def gather_dequant_missed_reference(
    store: QuantizedKVStore,
    ids: torch.Tensor,
    missed: torch.Tensor,
    quantizer: HiggsQuantizer,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """The PyTorch twin of `gather_dequant_missed` (synchronises on CUDA). Like the kernel it reads the missed
    slots' records alone, so the bytes a YAKV step counts are the bytes it moved on this path too."""
    rows, heads, slots = (i.to("cpu") for i in missed.nonzero(as_tuple=True))
    if not len(rows):
        return
    records = store.read(store.row_map[rows], heads, ids.to("cpu")[rows, heads, slots], keys.device)
    fresh_keys, fresh_values = dequant_records(records, quantizer, keys.dtype)
    keys[rows, heads, slots] = fresh_keys
    values[rows, heads, slots] = fresh_values


def gather_dequant(
    store: QuantizedKVStore, ids: torch.Tensor, quantizer: HiggsQuantizer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[B, Hkv, K, D]` in `dtype`, on `ids.device`, of the stored tokens `ids` `[B, Hkv, K]`.

    Cache row `b` reads stored row `store.row_map[b]`; `quantizer` is the host grid's (the one that made the
    records). The kernel's inverse rotation sums in another order than the twin's matmul: equal to float32
    round-off before the one rounding to `dtype`.
    """
    batch, heads, k = ids.shape
    if not _kernel_fits(store, ids, quantizer, dtype):
        return gather_dequant_reference(store, ids, quantizer, dtype)
    keys = torch.empty((batch, heads, k, quantizer.head_dim), dtype=dtype, device=ids.device)
    values = torch.empty_like(keys)
    _launch(store, ids, None, quantizer, keys, values)
    return keys, values


def gather_dequant_missed(
    store: QuantizedKVStore,
    ids: torch.Tensor,
    missed: torch.Tensor,
    quantizer: HiggsQuantizer,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write into `keys` and `values` (`[B, Hkv, K, D]`, contiguous) the tokens `ids` (`[B, Hkv, K]` int64) of the
    slots flagged in `missed` (`[B, Hkv, K]` bool); other slots are neither read from the store nor written (their
    ids may be -1). Same numerics as `gather_dequant`."""
    if not (_kernel_fits(store, ids, quantizer, keys.dtype) and keys.is_contiguous() and values.is_contiguous()):
        gather_dequant_missed_reference(store, ids, missed, quantizer, keys, values)
        return
    _launch(store, ids, missed.contiguous(), quantizer, keys, values)


def _launch(
    store: QuantizedKVStore,
    ids: torch.Tensor,
    fetch: torch.Tensor | None,
    quantizer: HiggsQuantizer,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """The kernel over every slot of `ids`, or only those flagged in `fetch` (bool, same shape)."""
    if not ids.numel():
        return
    grid, signs = quantizer.device_tables(ids.device)
    gather_dequant_op(
        keys, values, ids.contiguous(), fetch, store.data, store.device_pointer(ids.device), store.mirror,
        store.device_row_map(ids.device), grid, signs, quantizer.grid_dim, quantizer.seed,
    )  # fmt: skip


def _gather_dequant_twin(
    keys, values, ids, fetch, data, data_address, mirror, row_map, grid, signs, grid_dim, seed
) -> None:
    store = QuantizedKVStore(data, row_map.cpu(), mirror)
    quantizer = higgs_quantizer(keys.shape[-1], grid_dim, seed)
    check_tables(quantizer, grid, signs)
    if fetch is None:
        fetch = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    gather_dequant_missed_reference(store, ids, fetch, quantizer, keys, values)


@define_op(
    "gather_dequant(Tensor(a!) keys, Tensor(b!) values, Tensor ids, Tensor? fetch, Tensor data, int data_address, "
    "Tensor? mirror, Tensor row_map, Tensor grid, Tensor signs, int grid_dim, int seed) -> ()",
    cpu=_gather_dequant_twin,
    fake=lambda *args: None,
)
def gather_dequant_op(
    keys: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    fetch: torch.Tensor | None,
    data: torch.Tensor,
    data_address: int,
    mirror: torch.Tensor | None,
    row_map: torch.Tensor,
    grid: torch.Tensor,
    signs: torch.Tensor,
    grid_dim: int,
    seed: int,
) -> None:
    """`torch.ops.shadowkv.gather_dequant`: writes into `keys` and `values` (`[B, Hkv, K, D]`, contiguous) the
    dequantised records `data[row_map[b], h, ids[b, h, k]]` of every slot, or of those flagged in `fetch`; `data`
    `[R, Hkv, N, E]` pinned host records, read at `data_address` (its device-visible address, cached by the
    store); `mirror` `[R, Hkv, N', E]` on the device, a copy of `data[:, :, :N']` read for tokens below N' (or
    None); `row_map` `[B]` int64 on the device; `grid`, `signs` the quantiser's `device_tables`, which
    `(grid_dim, seed)` name for the twin."""
    batch, heads, k = ids.shape
    total = batch * heads * k
    dim = keys.shape[-1]
    record = data.shape[-1]
    row_stride, head_stride = data.stride(0), data.stride(1)  # bytes: uint8
    near = mirror if mirror is not None and mirror.shape[2] else None
    near_strides = (near.stride(0), near.stride(1)) if near is not None else (0, 0)
    aligned = [data_address, row_stride, head_stride, record, *near_strides]
    if near is not None:
        aligned.append(near.data_ptr())
    per_lane = max(1, dim // 32)
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    load_kernels("gather_dequant", ids.device, (("GD_RECORDS", RECORDS_PER_WARP),)).launch(
        f"gather_dequant_{_KERNEL_DTYPES[keys.dtype]}_e{per_lane}",
        grid=(-(-total // (_WARPS * RECORDS_PER_WARP)), 1, 1),
        block=(32 * _WARPS, 1, 1),
        args=[
            keys,
            values,
            ids,
            fetch if fetch is not None else (0, ctypes.c_void_p),
            (data_address, ctypes.c_void_p),
            near if near is not None else (0, ctypes.c_void_p),
            (near.shape[2] if near is not None else 0, i64),
            (near_strides[0], i64),
            (near_strides[1], i64),
            row_map,
            (row_stride, i64),
            (head_stride, i64),
            (heads, i32),
            (k, i32),
            (total, i64),
            (dim, i32),
            (grid_dim, i32),
            (record, i32),
            (int(all(x % 4 == 0 for x in aligned)), i32),
            grid,
            signs,
        ],
    )


def _kernel_fits(store: QuantizedKVStore, ids: torch.Tensor, quantizer: HiggsQuantizer, dtype: torch.dtype) -> bool:
    """Whether the kernel handles this fetch (CUDA, pinned store with token-major records, a mirror, if any, on the
    same device, D <= 256)."""
    data, mirror = store.data, store.mirror
    return (
        kernels_available(ids.device)
        and dtype in _KERNEL_DTYPES
        and ids.dtype == torch.int64
        and data.is_pinned()
        and data.stride()[2:] == (data.shape[-1], 1)
        and (mirror is None or (mirror.device == ids.device and mirror.stride()[2:] == (mirror.shape[-1], 1)))
        and data.shape[-1] == record_bytes(quantizer.num_subvectors)
        and quantizer.head_dim <= _MAX_DIM
        and len(store.row_map) >= ids.shape[0]
    )
