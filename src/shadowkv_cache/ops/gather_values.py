"""Fetch of missed value chunks from the host value store into the per-head value slots (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, M missed chunks.

On CUDA with a pinned store the kernel `kernels/gather_values.cu` reads each missed (row, head, chunk)
block straight from host memory over PCIe (zero copy: no staging buffer, no host synchronisation); one
block per slot, hits return at once. Otherwise the twin indexes the store on the host and copies.
"""

from __future__ import annotations

import ctypes

import torch

from ..kernel_loader import kernels_available, load_kernels
from ..value_store import HostValueStore

__all__ = ["gather_values", "gather_values_reference"]


def gather_values_reference(values: torch.Tensor, ids: torch.Tensor, miss: torch.Tensor, store: HostValueStore) -> None:
    """The PyTorch twin: `values[b, h, k] = store[row_map[b], h, ids[b, h, k]]` where `miss` (synchronises)."""
    rows, heads, slots = miss.nonzero(as_tuple=True)
    if rows.numel():
        values[rows, heads, slots] = store.gather(rows, heads, ids[rows, heads, slots], values.device).to(values.dtype)


def gather_values(values: torch.Tensor, ids: torch.Tensor, miss: torch.Tensor, store: HostValueStore) -> None:
    """Write the stored values of chunk `ids` into `values` where `miss`, in place.

    Args:
        values (`torch.Tensor`): `[B, Hkv, K, c, D]` the value slots (contiguous).
        ids (`torch.Tensor`): `[B, Hkv, K]` int64 chunk of each slot.
        miss (`torch.Tensor`): `[B, Hkv, K]` bool, slots to fetch.
        store (`HostValueStore`): `[rows, Hkv, C, c, D]` in host memory; cache row `b` reads stored row
            `store.row_map[b]`.
    """
    batch, heads, num_slots, c, dim = values.shape
    if not num_slots or not batch:
        return
    data = store.data
    if not (
        kernels_available(values.device)
        and values.is_contiguous()
        and data.dtype == values.dtype
        and data.stride()[2:] == (c * dim, dim, 1)
        and data.is_pinned()
    ):
        gather_values_reference(values, ids, miss, store)
        return
    item = data.element_size()
    chunk_bytes = c * dim * item
    host = store.device_pointer()
    row_stride, head_stride = data.stride(0) * item, data.stride(1) * item
    vec16 = all(x % 16 == 0 for x in (host, row_stride, head_stride, chunk_bytes, values.data_ptr()))
    load_kernels("gather_values", values.device).launch(
        "gather_values",
        grid=(num_slots, heads, batch),
        block=(128, 1, 1),
        args=[
            values,
            ids.contiguous(),
            miss.contiguous(),
            (host, ctypes.c_void_p),
            store.device_row_map(values.device),
            (row_stride, ctypes.c_longlong),
            (head_stride, ctypes.c_longlong),
            (heads, ctypes.c_int),
            (num_slots, ctypes.c_int),
            (chunk_bytes, ctypes.c_int),
            (int(vec16), ctypes.c_int),
        ],
    )
