"""One-token attention over YAKV's selected tokens read in place from the device mirror of their records (design.md §4).

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, K selected slots per KV head, N stored tokens, E record bytes,
D head dim, p grid dim, S shares per (row, KV head).

When a store mirrors every token on the device (`device_record_share=1`), a decode step needs neither the fetch nor
the held tokens: `kernels/attend_records.cu` reads each selected token's ~4-bit record where the mirror keeps it (132
bytes per token and head at D = 128, where the dequantised key and value take 512) and attends over it in the
rotated domain, into split shares that `kernels/attend_parts.cu` merges with its own over the other parts (the recent
window, the tokens after the prompt). The held tokens' memory then goes to the batch.

The twin (`attend_records_reference`, the definition) dequantises the selected records as `gather_dequant` does, in
the query's dtype, and attends over them and the other parts as `attend_parts` does. The kernel keeps the
dequantised keys and values in float32 (it never forms them), so it differs from the twin by their rounding to the
query's dtype.
"""

from __future__ import annotations

import ctypes

import torch

from ..core.attention import NO_TERMS, LogitTerms, Part
from ..core.attention import attend_parts as attend_parts_definition
from ..quant import HiggsQuantizer, check_tables, higgs_quantizer
from ..stores.quantized_store import QuantizedKVStore, record_bytes
from . import attend_parts as split_op
from .gather_dequant import gather_dequant_reference
from .library import define_op
from .loader import load_kernels

__all__ = ["attend_records", "attend_records_op", "attend_records_reference", "records_kernel_fits"]

_THREADS, _TILE = 128, 64  # as kernels/attend_records.cu


def attend_records_reference(
    query: torch.Tensor,
    store: QuantizedKVStore,
    ids: torch.Tensor,
    valid: torch.Tensor,
    quantizer: HiggsQuantizer,
    parts: list[Part],
    scaling: float,
    terms: LogitTerms = NO_TERMS,
) -> torch.Tensor:
    """The definition: attention of `query` `[B, Hq, T, D]` over the stored tokens `ids` (`[B, Hkv, K]` int64, read
    where `valid` `[B, Hkv, K]` bool), dequantised in the query's dtype, then `parts`; `[B, T, Hq, D]`."""
    keys, values = gather_dequant_reference(store, ids.clamp_min(0), quantizer, query.dtype)
    return attend_parts_definition(query, [(keys, values, valid[:, :, None, :]), *parts], scaling, terms)


def attend_records(
    query: torch.Tensor,
    store: QuantizedKVStore,
    ids: torch.Tensor,
    valid: torch.Tensor,
    quantizer: HiggsQuantizer,
    parts: list[Part],
    scaling: float,
    terms: LogitTerms = NO_TERMS,
) -> torch.Tensor:
    """Attention of `query` `[B, Hq, 1, D]` over the selected records and `parts`, as `attend_records_reference`;
    `[B, 1, Hq, D]`. The kernels when `records_kernel_fits`, else the twin (which synchronises on CUDA)."""
    if not records_kernel_fits(query, store, ids, valid, quantizer, parts, terms):
        return attend_records_reference(query, store, ids, valid, quantizer, parts, scaling, terms)
    sinks = None if terms.sinks is None else terms.sinks.to(device=query.device, dtype=torch.float32).contiguous()
    grid, signs = quantizer.device_tables(query.device)
    keys, values, masks = (list(t) for t in zip(*parts))
    return attend_records_op(
        query, ids.contiguous(), valid.contiguous(), store.mirror, store.device_row_map(query.device), grid, signs,
        quantizer.grid_dim, quantizer.seed, keys, values, masks, scaling, terms.softcap, sinks,
    )  # fmt: skip


def records_kernel_fits(
    query: torch.Tensor,
    store: QuantizedKVStore,
    ids: torch.Tensor,
    valid: torch.Tensor,
    quantizer: HiggsQuantizer,
    parts: list[Part],
    terms: LogitTerms = NO_TERMS,
) -> bool:
    """Whether the kernels serve this call: the other parts fit `attend_parts`' kernels (one CUDA query token, ...),
    the store's device mirror holds every token (token-major, 4-byte aligned) on the query's device, the selection
    (int64 ids, bool validity of one shape) is there too, and the shape is one the records kernel has (D/p codes a
    power of two from 8 to 128, G*p <= 16)."""
    mirror = store.mirror
    if mirror is None or not parts or not split_op.kernel_fits(query, parts, terms):
        return False
    batch, num_q_heads, _, dim = query.shape
    heads, p = parts[0][0].shape[1], quantizer.grid_dim
    codes = dim // p
    return (
        mirror.device == query.device
        and mirror.shape[2] == store.data.shape[2]
        and mirror.shape[1] == heads
        and mirror.shape[3] == record_bytes(codes)
        and mirror.stride()[2:] == (mirror.shape[3], 1)
        and all(s % 4 == 0 for s in mirror.stride()[:2])
        and mirror.data_ptr() % 4 == 0
        and quantizer.head_dim == dim
        and codes in (8, 16, 32, 64, 128)
        and (num_q_heads // heads) * p <= 16
        and ids.dtype == torch.int64
        and valid.dtype == torch.bool
        and ids.device == valid.device == query.device
        and ids.dim() == 3
        and valid.shape == ids.shape
        and tuple(ids.shape[:2]) == (batch, heads)
        and len(store.row_map) >= batch
    )


def _attend_records_twin(
    query, ids, valid, mirror, row_map, grid, signs, grid_dim, seed, keys, values, masks, scaling, softcap, sinks
) -> torch.Tensor:
    split_op.check_args(query, softcap, "attend_records")
    quantizer = higgs_quantizer(query.shape[-1], grid_dim, seed)
    check_tables(quantizer, grid, signs)
    store = QuantizedKVStore(mirror, row_map.cpu())
    parts = list(zip(keys, values, masks))
    return attend_records_reference(query, store, ids, valid, quantizer, parts, scaling, LogitTerms(softcap, sinks))


def _out_like(
    query, ids, valid, mirror, row_map, grid, signs, grid_dim, seed, keys, values, masks, scaling, softcap, sinks
) -> torch.Tensor:
    split_op.check_args(query, softcap, "attend_records")  # tracing refuses what the kernel would refuse
    batch, num_q_heads, steps, dim = query.shape
    return query.new_empty((batch, steps, num_q_heads, dim))


@define_op(
    "attend_records(Tensor query, Tensor ids, Tensor valid, Tensor mirror, Tensor row_map, Tensor grid, Tensor signs, "
    "int grid_dim, int seed, Tensor[] keys, Tensor[] values, Tensor[] valid_parts, float scaling, float? softcap, "
    "Tensor? sinks) -> Tensor",
    cpu=_attend_records_twin,
    fake=_out_like,
)
def attend_records_op(
    query: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    mirror: torch.Tensor,
    row_map: torch.Tensor,
    grid: torch.Tensor,
    signs: torch.Tensor,
    grid_dim: int,
    seed: int,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid_parts: list[torch.Tensor],
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`torch.ops.shadowkv.attend_records`: the kernels on what `attend_records` checked: `ids`, `valid`
    `[B, Hkv, K]` contiguous; `mirror` `[R, Hkv, N, E]` every stored token's records on the device; `row_map` `[B]`
    int64 there; `grid`, `signs` the quantiser's `device_tables`, which `(grid_dim, seed)` name for the twin; the
    other parts as three lists. `[B, 1, Hq, D]`."""
    split_op.check_args(query, softcap, "attend_records")
    batch, num_q_heads, _, dim = query.shape
    heads, slots = ids.shape[1], ids.shape[2]
    splits, span = split_op.splits_for(slots, batch * heads, _TILE, query.device) if slots else (0, _TILE)
    other_splits, other_span = split_op.part_splits(query, keys)
    part_acc, part_ml = split_op.empty_shares(query, heads, splits + other_splits)
    kernels = split_op.split_kernels(query, heads)
    if splits:
        i64 = ctypes.c_longlong
        defines = (*split_op.shape_defines(query, heads), ("RECORDS_PG", grid_dim))
        load_kernels("attend_records", query.device, defines).launch(
            "attend_records",
            grid=(splits, heads, batch),
            block=(_THREADS, 1, 1),
            args=[
                query, (query.stride(0), i64), (query.stride(1), i64), ids, valid, (slots, i64), mirror,
                (mirror.stride(0), i64), (mirror.stride(1), i64), row_map, grid, signs, (scaling, ctypes.c_float),
                (softcap or 0.0, ctypes.c_float), (span, i64), (splits + other_splits, ctypes.c_int), part_acc, part_ml,
            ],
        )  # fmt: skip
    split_op.launch_split(kernels, query, keys, values, valid_parts, scaling, softcap, part_acc, part_ml, splits,
                          other_span)  # fmt: skip
    return split_op.launch_merge(kernels, part_acc, part_ml, sinks, query)
