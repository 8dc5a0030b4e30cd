"""YAKV's token reuse: tokens selected at the previous step stay on the device, dequantised (design.md §4).

Legend: B batch, Hkv KV heads, K slots (tokens selected per KV head and step), D head dim.

Consecutive decode steps select largely the same tokens, as ShadowKV's steps select the same chunks (its temporal
cache, `shadowkv/temporal_cache.py`). Without reuse every selected token's record crosses PCIe at every step; with
it only the tokens new to the selection do. The same scan decides hits and slots (`ops/temporal_scan.py`: held
tokens never move, a new token takes a freed slot), then the missed slots are fetched and dequantised in place
(`ops/gather_dequant.gather_dequant_missed`). Attention reads the slots in whatever order they hold their tokens,
which changes only the order of the softmax sums.
"""

from __future__ import annotations

import torch

from ..ops.gather_dequant import gather_dequant_missed
from ..ops.temporal_scan import temporal_scan
from ..quant import HiggsQuantizer
from ..stores.quantized_store import QuantizedKVStore

__all__ = ["HeldTokens"]


class HeldTokens:
    """Selected tokens of one layer: ids `[B, Hkv, K]` (-1 = empty slot), keys and values `[B, Hkv, K, D]`.

    What the refreshes did is counted on the device, so a step never waits for the host to count: `counts` holds
    (misses, refreshes, lookups); the scan adds the first two itself, a refresh adds its valid selection to the third,
    and with a device mirror it counts the records read from host memory (`host_records`), which the scan cannot tell
    from the mirrored ones. Hits are lookups less misses, taken when read (counting them in each refresh took three
    more reductions and four additions per layer and step).
    """

    def __init__(self, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        self.ids, self.keys, self.values = ids.contiguous(), keys.contiguous(), values.contiguous()
        self.counts = torch.zeros(3, dtype=torch.int64, device=ids.device)  # misses, refreshes, lookups
        self.host_records = torch.zeros((), dtype=torch.int64, device=ids.device)  # with a mirror

    @classmethod
    def empty(cls, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> HeldTokens:
        """Empty slots of `shape` `(B, Hkv, K, D)`."""
        ids = torch.full(shape[:3], -1, dtype=torch.int64, device=device)
        keys = torch.zeros(shape, dtype=dtype, device=device)
        return cls(ids, keys, keys.clone())

    def totals(self, mirrored: bool) -> torch.Tensor:
        """`[4]` int64 on the device: (misses, refreshes, lookups, records read from host memory) so far; without a
        device mirror (`mirrored` false) every miss was read from host memory."""
        return torch.cat((self.counts, (self.host_records if mirrored else self.counts[0])[None]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.keys, self.values))

    @property
    def held(self) -> torch.Tensor:
        """`[B, Hkv, K]` bool: slots that hold a token (the attention mask of the selected part)."""
        return self.ids >= 0

    def fits(self, wanted: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether this step's selection (`[B, Hkv, K']`) and KV dtype match the slots."""
        return self.ids.shape == wanted.shape and self.keys.dtype == dtype

    def refresh(
        self,
        wanted: torch.Tensor,
        valid: torch.Tensor,
        store: QuantizedKVStore,
        quantizer: HiggsQuantizer,
    ) -> None:
        """Hold the tokens `wanted` (`[B, Hkv, K]` int64, distinct where `valid` `[B, Hkv, K]` bool): keep the ones
        already held, fetch and dequantise the rest into freed slots."""
        units = store.data.shape[2]
        self.ids, missed = temporal_scan(self.ids, wanted, valid, units=units, counts=self.counts[:2])
        gather_dequant_missed(store, self.ids, missed, quantizer, self.keys, self.values)
        self.counts[2] += valid.sum()
        if store.mirror is not None:
            self.host_records += store.host_reads(self.ids, missed)

    def select_rows(self, index: torch.Tensor) -> HeldTokens:
        """Rows `index` (`[B']`) of these slots (copied), counting from zero (the owner keeps what these counted)."""
        return HeldTokens(self.ids[index], self.keys[index], self.values[index])
