"""Fetch of missed value chunks from the host value store into the per-head value slots (ShadowKV §3.3).

Legend: B batch, Hkv KV heads, K slots, c chunk size, D head dim, P payload elements per vector, M missed
chunks.

On CUDA with a pinned store the kernels of `kernels/gather_values.cu` read each missed (row, head, chunk)
block straight from host memory over PCIe (zero copy: no staging buffer, no host synchronisation). A
quantised store's block (codes plus its `c` scales) is decoded on the way into the slots, so only the encoded
bytes cross PCIe. Otherwise the twin indexes the store on the host, copies and decodes with the codec
(`stores/value_codecs.py`, the definition).

The kernels stride over the slots, hits skipped; the native copy and the higgs4 warp kernel with at most
`FETCH_BLOCKS_PER_SM` blocks per SM. The fetch is bound by PCIe, and the temporal cache runs it on a side stream
beside the key rebuild: a grid of one block per slot (tens of thousands at batch 32) fills every SM until its last
block starts, and the rebuild waits behind it (docs/design.md, "The decode step").
"""

from __future__ import annotations

import ctypes

import torch

from ..stores.value_codecs import value_codec
from ..stores.value_store import HostValueStore
from .library import define_op
from .loader import kernels_available, load_kernels, strided_grid

__all__ = ["gather_values", "gather_values_op", "gather_values_reference"]

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_SHARED_LIMIT = 48 << 10  # dynamic shared memory a kernel gets without opting in (c=8, D=128 needs 4 KiB)
# Blocks of 128 threads per SM at most, for the kernels that keep enough PCIe reads in flight with a few blocks: the
# native copy (a block reads a whole chunk with one 16-byte load per thread) and the higgs4 warp kernel (each warp
# reads its next slot while it decodes the current one). Half a block per SM gave the shortest batch-32 step at 128K
# on an H200 machine (docs/results.md). With the fused key rebuild beside it, half a block still beat two at the best
# batch: 692.4 against 630.1 tok/s at batch 44, 128K (`throughput_cuda_128k_b44_fetch05` and
# `throughput_cuda_128k_b44_fetch2`). The fp8 kernel and the general higgs4 kernel read a slot's scales, wait at a
# barrier, then read its codes: two round trips per slot, so they keep one block per slot (not re-measured).
FETCH_BLOCKS_PER_SM = 0.5
HIGGS_WARPS_PER_BLOCK = 4  # the higgs4 warp kernel's block: at most 8 warps (its launch bounds)


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
    device = values.device
    scales = store.scales
    gather_values_op(
        values, ids.contiguous(), miss.contiguous(), store.data, store.device_pointer(device), scales,
        store.scales_pointer(device) if scales is not None else 0, store.device_row_map(device), store.codec.name,
        list(store.codec.tables(device)) if store.codec.name == "higgs4" else [],
    )  # fmt: skip


def _gather_values_twin(values, ids, miss, data, data_address, scales, scales_address, row_map, codec, tables):
    store = HostValueStore(data, row_map.cpu(), scales, value_codec(codec, values.shape[-1]))
    gather_values_reference(values, ids, miss, store)


@define_op(
    "gather_values(Tensor(a!) values, Tensor ids, Tensor miss, Tensor data, int data_address, Tensor? scales, "
    "int scales_address, Tensor row_map, str codec, Tensor[] tables) -> ()",
    cpu=_gather_values_twin,
    fake=lambda *args: None,
)
def gather_values_op(
    values: torch.Tensor,
    ids: torch.Tensor,
    miss: torch.Tensor,
    data: torch.Tensor,
    data_address: int,
    scales: torch.Tensor | None,
    scales_address: int,
    row_map: torch.Tensor,
    codec: str,
    tables: list[torch.Tensor],
) -> None:
    """`torch.ops.shadowkv.gather_values`: the kernels on what `gather_values` checked. Writes the decoded chunks
    `data[row_map[b], h, ids[b, h, k]]` (format `codec`, with `scales` where it has them) into `values`
    `[B, Hkv, K, c, D]` where `miss`; `data` and `scales` are pinned host memory read at `data_address` and
    `scales_address` (their device-visible addresses, cached by the store); `row_map` `[B]` int64 on the device;
    `tables` the higgs4 codec's device tables (empty for other formats)."""
    batch, heads, num_slots, c, dim = values.shape
    item = data.element_size()
    chunk_bytes = c * data.shape[-1] * item
    host = data_address
    row_stride, head_stride = data.stride(0) * item, data.stride(1) * item
    common = [
        values,
        ids,
        miss,
        (host, ctypes.c_void_p),
        row_map,
        (row_stride, ctypes.c_longlong),
        (head_stride, ctypes.c_longlong),
        (heads, ctypes.c_int),
        (num_slots, ctypes.c_int),
    ]
    total = (batch * heads * num_slots, ctypes.c_longlong)
    kernels = load_kernels("gather_values", values.device)
    if codec == "native":
        vec16 = all(x % 16 == 0 for x in (host, row_stride, head_stride, chunk_bytes, values.data_ptr()))
        kernels.launch(
            "gather_values",
            grid=_grid(values.device, total[0]),
            block=(128, 1, 1),
            args=[*common, (chunk_bytes, ctypes.c_int), (int(vec16), ctypes.c_int), total],
        )
        return
    # 16 codes per 16-byte load. fp8 decodes each load into 16 outputs of one vector (D a multiple of 16)
    # and writes them with 16-byte stores; higgs4 decodes in a lane's registers (usual head sizes) or in shared
    # memory.
    aligned = [host, row_stride, head_stride, chunk_bytes]
    if codec == "fp8":
        aligned += [values.data_ptr(), c * dim * values.element_size(), dim]
    vec16 = all(x % 16 == 0 for x in aligned)
    scale_args = [
        (scales_address, ctypes.c_void_p),
        (scales.stride(0) * scales.element_size(), ctypes.c_longlong),
        (scales.stride(1) * scales.element_size(), ctypes.c_longlong),
    ]
    name = f"gather_values_{codec}_{_KERNEL_DTYPES[values.dtype]}"
    if codec == "higgs4" and vec16 and _warp_fits(values, c, dim):
        kernels.launch(
            name.replace("higgs4", "higgs4_warp"),
            grid=_grid(values.device, -(-total[0] // HIGGS_WARPS_PER_BLOCK)),  # a slot per warp at a time
            block=(32 * HIGGS_WARPS_PER_BLOCK, 1, 1),
            args=[*common, *scale_args, (c, ctypes.c_int), (dim, ctypes.c_int), *tables, total],
        )
        return
    args = [*common, *scale_args, (c, ctypes.c_int), (dim, ctypes.c_int), (int(vec16), ctypes.c_int), *tables]
    kernels.launch(
        name,
        grid=(total[0], 1, 1),  # one block per slot: see FETCH_BLOCKS_PER_SM
        block=(128, 1, 1),
        args=[*args, total],
        shared_bytes=_shared_bytes(codec, c, dim),
    )


def _grid(device: torch.device, blocks: int) -> tuple[int, int, int]:
    """`blocks`, but at most `FETCH_BLOCKS_PER_SM` per SM; the kernels stride over the rest."""
    return strided_grid(device, blocks, FETCH_BLOCKS_PER_SM)


def _warp_fits(values: torch.Tensor, c: int, dim: int) -> bool:
    """Whether `gather_values_higgs4_warp` serves these slots: a lane decodes 32 coordinates of one vector (D a
    power of two in [32, 1024]), at most two 16-byte loads per lane (c*D/32 <= 64), 16-byte aligned outputs."""
    return 32 <= dim <= 1024 and dim & (dim - 1) == 0 and c * dim <= 2048 and values.data_ptr() % 16 == 0


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
