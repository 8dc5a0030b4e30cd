"""A token budget shared by the KV heads of a layer (the study's "top-kp", a YAKV extension).

"KV Cache Offloading for Context-Intensive Tasks" (the YAKV study, §4.3 and
Appendix F): instead of `k` tokens per KV head, the layer's `Hkv*k` tokens go to the (head, token) pairs with
the highest approximate attention score, so heads that spread their attention get more tokens and peaked heads
fewer. Scores must be comparable across heads: softmax-normalised attention (as `QuantizedKeyTopK` and
`ResidualLandmarkTopK` return), not raw logits.

Legend: B batch, Hkv KV heads, N tokens, k tokens per KV head on average, K' = min(Hkv*k, N) id slots per head.

Heads get different counts, so the selection is `ids` plus a validity mask (`SelectionPolicy.select_valid`);
YAKV layers attend to the valid entries only. The shapes stay static (no host synchronisation): every head has
`K'` slots. The fetch reads the valid entries only (`ops/gather_dequant.gather_dequant_missed`); YAKV mode does not
keep a shared selection from step to step (`yakv/mode.py`).
"""

from __future__ import annotations

import torch

from .base import SelectionPolicy

__all__ = ["SharedBudgetTopK"]


class SharedBudgetTopK(SelectionPolicy):
    """Spends a layer's `Hkv*k` token budget (per row) on the best (head, token) pairs of `inner`'s scores.

    Args:
        inner (`SelectionPolicy`): a token-granularity policy whose scores are approximate attention
            probabilities (default `QuantizedKeyTopK`); its state and scores are used unchanged.

    Use: `ShadowKVCache(model, mode="yakv", policy=SharedBudgetTopK(QuantizedKeyTopK()))`.
    """

    granularity = "token"
    shares_budget = True

    def __init__(self, inner: SelectionPolicy | None = None):
        if inner is None:
            from .quantized_keys import QuantizedKeyTopK

            inner = QuantizedKeyTopK()
        if not isinstance(inner, SelectionPolicy):
            raise TypeError(f"inner must be a SelectionPolicy, got {type(inner).__name__}")
        if inner.granularity != "token" or isinstance(inner, SharedBudgetTopK):
            raise ValueError(
                f"SharedBudgetTopK shares a budget of tokens across heads; {type(inner).__name__} "
                f"({inner.granularity} granularity) cannot be wrapped. Use QuantizedKeyTopK or ResidualLandmarkTopK."
            )
        self.inner = inner
        self.observation_window = inner.observation_window

    def prepare(self, chunk_keys, recent_queries=None, scaling=None) -> dict[str, torch.Tensor]:
        extra = {"recent_queries": recent_queries, "scaling": scaling} if self.observation_window else {}
        return self.inner.prepare(chunk_keys, **extra)

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return self.inner.score(query, state, selectable, scaling)

    def select(self, query, state, selectable, k, scaling, query_mask=None) -> torch.Tensor:
        raise NotImplementedError(
            "SharedBudgetTopK gives heads different counts, so it selects through select_valid (ids and a "
            "validity mask); YAKV layers (mode='yakv') call that."
        )

    def select_valid(
        self,
        query: torch.Tensor,
        state: dict[str, torch.Tensor],
        selectable: torch.Tensor,
        k: int,
        scaling: float,
        query_mask: torch.Tensor | None = None,
        budget: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids `[B, Hkv, K']` and validity `[B, Hkv, K']`: row `b` has `Hkv*budget[b]` valid entries in all
        (`Hkv*k` without `budget`), each head's best first; never a token that is not selectable."""
        scores = self.masked_scores(query, state, selectable, scaling, query_mask)  # [B, Hkv, N], -inf masked
        batch, heads, num = scores.shape
        if not 0 < k <= num:
            raise ValueError(f"k must be in [1, {num}] (the selectable tokens per head), got {k}")
        total = heads * k
        flat = scores.flatten(1).topk(total, dim=-1)  # the layer's best (head, token) pairs, best first
        device = scores.device
        per_row = heads * (budget.to(device) if budget is not None else torch.full((batch,), k, device=device))
        valid = (torch.arange(total, device=device) < per_row[:, None]) & flat.values.gt(float("-inf"))
        head, token = flat.indices // num, flat.indices % num  # [B, Hkv*k]
        # Slot of each pair within its head: how many valid pairs of that head rank above it.
        same_head = (head[:, :, None] == torch.arange(heads, device=device)) & valid[:, :, None]
        slot = (same_head.cumsum(dim=1) - 1).gather(-1, head[:, :, None]).squeeze(-1)
        width = min(total, num)
        slot = torch.where(valid, slot, width)  # invalid pairs go to a spare slot, dropped below
        ids = torch.zeros((batch, heads, width + 1), dtype=torch.int64, device=device)
        mask = torch.zeros((batch, heads, width + 1), dtype=torch.bool, device=device)
        rows = torch.arange(batch, device=device)[:, None]
        ids[rows, head, slot] = token
        mask[rows, head, slot] = valid
        return ids[..., :width], mask[..., :width]
