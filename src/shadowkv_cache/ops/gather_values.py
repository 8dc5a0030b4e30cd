"""Fetch of missed value chunks from the host value store into the per-head value slots (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, P payload elements per vector, M missed
chunks.

On CUDA with a pinned store the kernels of `kernels/gather_values.cu` read each missed (row, head, chunk)
block straight from host memory over PCIe (zero copy: no staging buffer, no host synchronisation); one
block per slot, hits return at once. A quantised store's block (codes plus its `c` scales) is decoded on
the way into the slots, so only the encoded bytes cross PCIe. Otherwise the twin indexes the store on the
host, copies and decodes with the codec (`stores/value_codecs.py`, the definition).
"""

from __future__ import annotations

import ctypes

import torch

from ..stores.value_store import HostValueStore
from .loader import kernels_available, load_kernels

__all__ = ["gather_values", "gather_values_reference"]

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_SHARED_LIMIT = 48 << 10  # dynamic shared memory a kernel gets without opting in (c=8, D=128 needs 4 KiB)


def gather_values_reference(values: torch.Tensor, ids: torch.Tensor, miss: torch.Tensor, store: HostValueStore) -> None:
    """The PyTorch twin: `values[b, h, k] = decode(store[row_map[b], h, ids[b, h, k]])` where `miss`
    (synchronises)."""
    rows, heads, slots = miss.nonzero(as_tuple=True)
    if rows.numel():
        values[rows, heads, slots] = store.gather(rows, heads, ids[rows, heads, slots], values.device, values.dtype)


def gather_values(values: torch.Tensor, ids: torch.Tensor, miss: torch.Tensor, store: HostValueStore) -> None:
    """Write the decoded stored values of chunk `ids` into `values` where `miss`, in place.

    Args:
        values (`torch.Tensor`): `[B, Hkv, K, c, D]` the value slots (contiguous).
        ids (`torch.Tensor`): `[B, Hkv, K]` int64 chunk of each slot.
        miss (`torch.Tensor`): `[B, Hkv, K]` bool, slots to fetch.
        store (`HostValueStore`): `[rows, Hkv, C, c, P]` (plus scales `[rows, Hkv, C, c]`) in host memory;
            cache row `b` reads stored row `store.row_map[b]`.
    """
    batch, heads, num_slots, c, dim = values.shape
    if not num_slots or not batch:
        return
    if not _kernel_fits(values, store):
        gather_values_reference(values, ids, miss, store)
        return
    data = store.data
    item = data.element_size()
    chunk_bytes = c * data.shape[-1] * item
    host = store.device_pointer(values.device)
    row_stride, head_stride = data.stride(0) * item, data.stride(1) * item
    common = [
        values,
        ids.contiguous(),
        miss.contiguous(),
        (host, ctypes.c_void_p),
        store.device_row_map(values.device),
        (row_stride, ctypes.c_longlong),
        (head_stride, ctypes.c_longlong),
        (heads, ctypes.c_int),
        (num_slots, ctypes.c_int),
    ]
    kernels = load_kernels("gather_values", values.device)
    if store.codec.name == "native":
        vec16 = all(x % 16 == 0 for x in (host, row_stride, head_stride, chunk_bytes, values.data_ptr()))
        kernels.launch(
            "gather_values",
            grid=(num_slots, heads, batch),
            block=(128, 1, 1),
            args=[*common, (chunk_bytes, ctypes.c_int), (int(vec16), ctypes.c_int)],
        )
        return
    scales = store.scales
    scale_item = scales.element_size()
    # 16 codes per 16-byte load. fp8 decodes each load into 16 outputs of one vector (D a multiple of 16)
    # and writes them with 16-byte stores; higgs4 decodes into shared memory first.
    aligned = [host, row_stride, head_stride, chunk_bytes]
    if store.codec.name == "fp8":
        aligned += [values.data_ptr(), c * dim * values.element_size(), dim]
    vec16 = all(x % 16 == 0 for x in aligned)
    args = [
        *common,
        (store.scales_pointer(values.device), ctypes.c_void_p),
        (scales.stride(0) * scale_item, ctypes.c_longlong),
        (scales.stride(1) * scale_item, ctypes.c_longlong),
        (c, ctypes.c_int),
        (dim, ctypes.c_int),
        (int(vec16), ctypes.c_int),
    ]
    if store.codec.name == "higgs4":
        args += list(store.codec.tables(values.device))
    kernels.launch(
        f"gather_values_{store.codec.name}_{_KERNEL_DTYPES[values.dtype]}",
        grid=(num_slots, heads, batch),
        block=(128, 1, 1),
        args=args,
        shared_bytes=_shared_bytes(store.codec.name, c, dim),
    )


def _shared_bytes(name: str, c: int, dim: int) -> int:
    """fp8: the block's `c` scales; higgs4: its `c*D` coordinates (transformed in place) and `c` norms."""
    return 4 * c if name == "fp8" else 4 * (c * dim + c)


def _kernel_fits(values: torch.Tensor, store: HostValueStore) -> bool:
    """Whether a kernel handles this store and slot buffer (CUDA, pinned chunk-major store, known format)."""
    data, scales, c = store.data, store.scales, values.shape[-2]
    if not (kernels_available(values.device) and values.is_contiguous() and data.is_pinned()):
        return False
    if data.stride()[2:] != (c * data.shape[-1], data.shape[-1], 1):
        return False
    if store.codec.name == "native":
        return data.dtype == values.dtype
    return (
        store.codec.name in ("fp8", "higgs4")
        and values.dtype in _KERNEL_DTYPES
        and scales.is_pinned()
        and scales.stride()[2:] == (c, 1)
        and _shared_bytes(store.codec.name, c, values.shape[-1]) <= _SHARED_LIMIT
    )
