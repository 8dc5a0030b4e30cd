"""Fetch of the selected tokens' quantised keys and values from host memory, dequantised on the device (YAKV).

Legend: B batch, Hkv KV heads, K selected tokens per head, N stored tokens, E record bytes, D head dim.

This is the PyTorch twin that defines the meaning (and the CPU path): it indexes the store on the host
(which needs the ids there: one synchronisation per call on CUDA), copies the records to the device and
dequantises them. A zero-copy kernel reading the pinned records in place is the planned CUDA twin.
"""

from __future__ import annotations

import torch

from ..quant import HiggsQuantizer
from ..quantized_store import QuantizedKVStore, unpack_records

__all__ = ["gather_dequant", "gather_records", "dequant_records"]


def gather_records(store: QuantizedKVStore, ids: torch.Tensor) -> torch.Tensor:
    """Records `[B, Hkv, K, E]` on `ids.device` of the tokens `ids` (`[B, Hkv, K]` int64, `< N`)."""
    batch, heads, _ = ids.shape
    host_ids = ids.to("cpu")
    rows = store.row_map[:batch, None, None]
    block = store.data[rows, torch.arange(heads)[None, :, None], host_ids]
    if ids.device.type == "cuda":
        return block.pin_memory().to(ids.device, non_blocking=True)
    return block.to(ids.device)


def dequant_records(
    records: torch.Tensor, quantizer: HiggsQuantizer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[..., D]` in `dtype` from records `[..., E]`."""
    keys, values = unpack_records(records)
    return quantizer.dequantize(keys, dtype), quantizer.dequantize(values, dtype)


def gather_dequant(
    store: QuantizedKVStore, ids: torch.Tensor, quantizer: HiggsQuantizer, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[B, Hkv, K, D]` in `dtype`, on `ids.device`, of the stored tokens `ids` `[B, Hkv, K]`.

    Cache row `b` reads stored row `store.row_map[b]`; `quantizer` is the host grid's (the one that made the
    records).
    """
    return dequant_records(gather_records(store, ids), quantizer, dtype)
