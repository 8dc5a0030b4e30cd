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

    The counters `hits` (selected tokens found held) and `lookups` (tokens selected) live on the device, so a step
    never waits for the host to count; pass `counts` (`(hits, lookups)`, int64 scalars on the device) to go on
    counting in the tensors of slots made earlier.
    """

    def __init__(
        self,
        ids: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        counts: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.ids, self.keys, self.values = ids.contiguous(), keys.contiguous(), values.contiguous()
        if counts is None:
            counts = tuple(torch.zeros((), dtype=torch.int64, device=ids.device) for _ in range(2))
        self.hits, self.lookups = counts

    @classmethod
    def empty(
        cls,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        counts: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> HeldTokens:
        """Empty slots of `shape` `(B, Hkv, K, D)`."""
        ids = torch.full(shape[:3], -1, dtype=torch.int64, device=device)
        keys = torch.zeros(shape, dtype=dtype, device=device)
        return cls(ids, keys, keys.clone(), counts)

    @property
    def counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(hits, lookups)`, the counters' tensors."""
        return self.hits, self.lookups

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
    ) -> torch.Tensor:
        """Hold the tokens `wanted` (`[B, Hkv, K]` int64, distinct where `valid` `[B, Hkv, K]` bool): keep the ones
        already held, fetch and dequantise the rest into freed slots. Returns the records read from host memory (a
        device scalar): the fetched tokens but those the store's device mirror holds."""
        self.ids, missed = temporal_scan(self.ids, wanted, valid, units=store.data.shape[2])
        gather_dequant_missed(store, self.ids, missed, quantizer, self.keys, self.values)
        selected, fetched = valid.sum(), missed.sum()
        self.hits += (selected - fetched).clamp(min=0)
        self.lookups += selected
        # Without a mirror every fetched token was read from the host: no second reduction in the step.
        return fetched if store.mirror is None else store.host_reads(self.ids, missed)

    def select_rows(self, index: torch.Tensor) -> HeldTokens:
        """Rows `index` (`[B']`) of these slots (copied); the counters are shared."""
        return HeldTokens(self.ids[index], self.keys[index], self.values[index], self.counts)
