"""`YakvMode`: what a compressed layer holds and does in YAKV mode, the context-intensive study's method
(docs/design.md, "YAKV mode").

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, N quantised prompt tokens, W exact recent tokens, K selected
tokens per KV head, D head dim.

At prefill the prompt's post-RoPE keys and values are quantised ~4-bit into host memory and a ~2-bit copy of every
key stays on the device. Each decode step scores every token from that copy, fetches and dequantises the top-K
tokens per KV head, and attends exactly over them, the recent window and the tokens after the prompt. No SVD,
landmarks, outliers or temporal cache. The step still synchronises with the host (the fetched byte count), so it is
not captured as a CUDA graph.
"""

from __future__ import annotations

import torch

from ..config import ShadowKVConfig
from ..core.attention import NO_TERMS, LogitTerms, Part, attend_parts
from ..ops.gather_dequant import dequant_records, gather_dequant
from ..policies.base import SelectionPolicy
from ..quant import HiggsQuantizer
from .prompt import QuantizedPrompt, quantize_prompt

__all__ = ["YakvMode"]


class YakvMode:
    """One layer's YAKV state: the quantised prompt, and the bytes it has fetched.

    Args:
        config (`ShadowKVConfig`): sizes and switches (`mode="yakv"`).
        policy (`SelectionPolicy`): a token-granularity policy (`QuantizedKeyTopK` by default).

    Attributes:
        fetched_bytes (`int`): host-to-device bytes of quantised records read so far (selected tokens of
            single-token steps, every token of dense multi-token steps), counted without synchronising.
        sparse_steps (`int`): decode steps that selected tokens.
    """

    name = "yakv"
    graph_safe = False

    def __init__(self, config: ShadowKVConfig, policy: SelectionPolicy, quantizer: HiggsQuantizer | None = None):
        self.config, self.policy = config, policy
        self.prompt: QuantizedPrompt | None = None
        self.fetched_bytes = 0
        self.sparse_steps = 0
        self._quantizer = quantizer

    def empty_like(self) -> YakvMode:
        """A mode of the same settings that holds nothing; it shares the quantiser, whose tables are already on the
        device."""
        return YakvMode(self.config, self.policy, self._quantizer)

    def quantizer(self, head_dim: int) -> HiggsQuantizer:
        """The host grid's quantiser (keys and values), made once (it caches its tensors per device)."""
        if self._quantizer is None or self._quantizer.head_dim != head_dim:
            self._quantizer = HiggsQuantizer(head_dim, self.config.host_grid_dim)
        return self._quantizer

    def compress(
        self,
        keys_pre: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor,
        recent_queries: torch.Tensor | None,
        scaling: float | None,
        rank_queries: torch.Tensor | None = None,
    ) -> bool:
        """Quantise a prefilled prompt (same arguments as `ShadowKVMode.compress`; keys are kept after RoPE and not
        factorised, so the pre-RoPE keys, positions and `rank_queries` are not needed); False when no row is long
        enough."""
        quantizer = self.quantizer(keys.shape[-1])
        prompt = quantize_prompt(keys, values, real, self.config, self.policy, quantizer, recent_queries, scaling)
        self.set_prompt(prompt)
        return prompt is not None

    def set_prompt(self, prompt: QuantizedPrompt | None) -> None:
        self.prompt = prompt

    def drop_decode_state(self) -> None:
        """Nothing to free: YAKV keeps no state between steps."""

    def select_rows(self, index: torch.Tensor) -> None:
        self.prompt = self.prompt.select_rows(index)

    def graph_key(self) -> tuple:
        return (id(self.prompt),)

    def attend(
        self,
        query: torch.Tensor,
        scaling: float,
        query_mask: torch.Tensor | None,
        new_tokens: Part,
        terms: LogitTerms = NO_TERMS,
    ) -> torch.Tensor:
        """Exact attention of `query` (`[B, Hq, T, D]`) over the selected (dequantised) tokens, or every token on a
        dense multi-token step, the recent window and `new_tokens`. Returns `[B, T, Hq, D]`."""
        prompt = self.prompt
        batch, _, q_len, dim = query.shape
        dtype = new_tokens[0].dtype
        store = prompt.store
        if q_len > 1 and self.config.dense_multi_token_steps:
            sel_keys, sel_values, sel_valid = self._whole_prompt(batch, dim, dtype, query.device)
        else:
            # [B, Hkv, K'] ids and validity: K' = k and each row's first budget_tokens valid, unless the policy
            # shares the budget across heads (then heads hold different counts and K' may exceed k).
            ids, sel_valid = self.policy.select_valid(
                query,
                prompt.policy_state,
                prompt.selectable,
                prompt.max_budget_tokens,
                scaling,
                query_mask,
                prompt.budget_tokens,
            )
            sel_keys, sel_values = gather_dequant(store, ids, self.quantizer(dim), dtype)
            self.fetched_bytes += prompt.budget_total * prompt.local_keys.shape[1] * store.record_bytes
            self.sparse_steps += 1
        parts = [
            (sel_keys, sel_values, sel_valid[:, :, None, :]),
            (prompt.local_keys, prompt.local_values, prompt.local_valid[:, None, None, :]),
            new_tokens,
        ]
        return attend_parts(query, parts, scaling, terms)

    def _whole_prompt(
        self, batch: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every quantised token, dequantised, for a multi-token step (a new chat turn, a question after a
        shared document): keys and values `[B, Hkv, N, D]` and validity `[B, Hkv, N]`. As in ShadowKV mode
        (`dense_multi_token_steps`), such a step reads the whole prompt once, as a prefill would."""
        prompt = self.prompt
        # Rows of one shared document are fetched and dequantised once.
        rows = 1 if prompt.is_one_document else batch
        records = prompt.store.rows(rows).to(device, non_blocking=True)
        keys, values = dequant_records(records, self.quantizer(dim), dtype)
        self.fetched_bytes += records.numel()
        shape = (batch, *keys.shape[1:])
        return keys.expand(shape), values.expand(shape), prompt.selectable

    def hit_counts(self) -> None:
        """YAKV has no temporal cache: every selected token is fetched."""
        return None

    def sizes(self) -> tuple[None, int]:
        """(None: keys are quantised, not factorised; tokens selected per KV head and step, the largest over rows)."""
        return None, self.prompt.max_budget_tokens

    def nbytes(self) -> tuple[int, int]:
        """(device bytes, host bytes) of the prompt."""
        return self.prompt.device_nbytes, self.prompt.store.nbytes
