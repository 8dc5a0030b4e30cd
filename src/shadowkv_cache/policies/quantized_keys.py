"""YAKV's token selection: every key scored from a ~2-bit HIGGS copy kept on the device.

"KV Cache Offloading for Context-Intensive Tasks" (the YAKV study, §3.2 and
§4.3): no chunks and no landmarks; each key's quantised copy is scored against the query through a lookup
table and the top tokens per KV head are fetched.
"""

from __future__ import annotations

import torch

from ..ops.quantize_higgs import quantize_vectors
from ..ops.score_codes import attention_scores, code_scores
from ..quant import HiggsQuantizer
from .base import SelectionPolicy

__all__ = ["QuantizedKeyTopK", "attention_scores"]


class QuantizedKeyTopK(SelectionPolicy):
    """Scores each token by the attention its quantised key would get: softmax over the tokens of each query
    head, summed over query tokens, max over the query heads of each GQA group (as ShadowKV's landmarks).

    Args:
        grid_dim (`int`, *optional*, defaults to 4): grid dimension of the scoring copy (4 -> ~2 bits per value).
        seed (`int`, *optional*, defaults to 0): the quantiser's seed.
    """

    granularity = "token"

    def __init__(self, grid_dim: int = 4, seed: int = 0):
        self.grid_dim, self.seed = grid_dim, seed
        self._quantizers: dict[int, HiggsQuantizer] = {}

    def quantizer(self, head_dim: int) -> HiggsQuantizer:
        """The scoring quantiser for head dim `head_dim` (made once)."""
        if head_dim not in self._quantizers:
            self._quantizers[head_dim] = HiggsQuantizer(head_dim, self.grid_dim, self.seed)
        return self._quantizers[head_dim]

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """Codes `[B, Hkv, N, D/p]` and norms `[B, Hkv, N]` of the post-RoPE keys `[B, Hkv, N, 1, D]`."""
        keys = chunk_keys.flatten(2, 3)
        packed = quantize_vectors(self.quantizer(keys.shape[-1]), keys)
        return {"codes": packed.codes, "norms": packed.norms}

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return code_scores(query, state["codes"], state["norms"], selectable, self.quantizer(query.shape[-1]), scaling)

    def masked_scores(
        self,
        query: torch.Tensor,
        state: dict[str, torch.Tensor],
        selectable: torch.Tensor,
        scaling: float,
        query_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # A subclass that scores otherwise keeps the base class's masking of its own `score`.
        if query_mask is not None or type(self).score is not QuantizedKeyTopK.score:
            return super().masked_scores(query, state, selectable, scaling, query_mask)
        # -inf where not selectable as the scores are written (the tensor-core kernels), not in a pass over them.
        quantizer = self.quantizer(query.shape[-1])
        return code_scores(query, state["codes"], state["norms"], selectable, quantizer, scaling, masked=True)
