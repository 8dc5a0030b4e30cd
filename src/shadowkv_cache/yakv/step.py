"""`YakvLayer`: one layer of a `ShadowKVCache` in YAKV mode (SPEC §4, the context-intensive study).

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, N quantised prompt tokens, W exact recent tokens,
G tokens after the prompt, K selected tokens per KV head, D head dim.

Same life cycle as `ShadowKVLayer` (exact until a long prefill, then a compressed prompt plus exact new
tokens), different storage and selection: at compression the prompt's post-RoPE keys and values are
quantised ~4-bit into host memory and a ~2-bit copy of every key stays on the device; each decode step scores
every token from that copy, fetches and dequantises the top-K tokens per KV head, and attends exactly over
them, the recent window and the tokens after the prompt. No SVD, landmarks, outliers or temporal cache.
"""

from __future__ import annotations

import torch

from .config import ShadowKVConfig
from .layer import ShadowKVLayer, grouped_attention, new_token_mask, real_queries, real_tokens
from .ops.gather_dequant import dequant_records, gather_dequant
from .ops.rebuild_keys import RopeFn
from .policies.base import SelectionPolicy
from .quant import HiggsQuantizer
from .quantized_prompt import QuantizedPrompt, quantize_prompt

__all__ = ["YakvLayer"]


class YakvLayer(ShadowKVLayer):
    """One layer of a `ShadowKVCache(mode="yakv")`.

    Args:
        config (`ShadowKVConfig`): sizes and switches (`mode="yakv"`).
        policy (`SelectionPolicy`): a token-granularity policy (`QuantizedKeyTopK` by default).
        rope (`RopeFn`): the model's rotary embedding (unused: keys are stored after RoPE).

    Attributes:
        fetched_bytes (`int`): host-to-device bytes of quantised records read so far (selected tokens of
            single-token steps, every token of dense multi-token steps), counted without synchronising.
        sparse_steps (`int`): decode steps that selected tokens.
    """

    prompt: QuantizedPrompt | None

    def __init__(self, config: ShadowKVConfig, policy: SelectionPolicy, rope: RopeFn):
        super().__init__(config, policy, rope)
        self.fetched_bytes = 0
        self.sparse_steps = 0
        self._quantizer: HiggsQuantizer | None = None

    def quantizer(self, head_dim: int) -> HiggsQuantizer:
        """The host grid's quantiser (keys and values), made once (it caches its tensors per device)."""
        if self._quantizer is None or self._quantizer.head_dim != head_dim:
            self._quantizer = HiggsQuantizer(head_dim, self.config.host_grid_dim)
        return self._quantizer

    # -- prefix sharing -----------------------------------------------------------------------------------

    def set_prefix(self, prompt: QuantizedPrompt | None, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().set_prefix(None, keys, values)
        self.prompt = prompt

    def fork(self, batch_size: int) -> YakvLayer:
        layer = super().fork(batch_size)
        layer._quantizer = self._quantizer  # its tables are already on the device: no copy at the first step
        return layer

    # -- compression at prefill ----------------------------------------------------------------------------

    def compress(
        self,
        keys_pre: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None,
        query: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> None:
        """Quantise the prompt just stored by the first `update`, if any row is long enough (same arguments as
        `ShadowKVLayer.compress`; the pre-RoPE keys and positions are not needed)."""
        keys, values = self.keys, self.values
        batch, _, slots, dim = keys.shape
        real = real_tokens(attention_mask, batch, slots, keys.device)
        window = self.policy.observation_window
        recent = query[:, :, -window:] if window and query is not None else None
        prompt = quantize_prompt(keys, values, real, self.config, self.policy, self.quantizer(dim), recent, scaling)
        if prompt is None:
            return
        self.prompt = prompt
        self.keys, self.values = keys[..., :0, :], values[..., :0, :]

    # -- sparse attention at decode ------------------------------------------------------------------------

    def sparse_attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Exact attention of `query` (`[B, Hq, T, D]`) over the selected (dequantised) tokens, the recent
        window and the tokens after the prompt. Returns `[B, T, Hq, D]`."""
        prompt = self.prompt
        batch, _, q_len, dim = query.shape
        num_kv_heads = self.keys.shape[1]
        store = prompt.store
        if q_len > 1 and self.config.dense_multi_token_steps:
            sel_keys, sel_values, sel_valid = self._whole_prompt(batch, dim)
        else:
            k = prompt.max_budget_tokens
            real = real_queries(attention_mask, prompt.slots, self.keys.shape[2], query)
            # [B, Hkv, K'] ids and validity: K' = k and each row's first budget_tokens valid, unless the policy
            # shares the budget across heads (then heads hold different counts and K' may exceed k).
            ids, sel_valid = self.policy.select_valid(
                query, prompt.policy_state, prompt.selectable, k, scaling, real, prompt.budget_tokens
            )
            sel_keys, sel_values = gather_dequant(store, ids, self.quantizer(dim), self.keys.dtype)
            self.fetched_bytes += prompt.budget_total * num_kv_heads * store.record_bytes
            self.sparse_steps += 1

        keys = torch.cat([sel_keys, prompt.local_keys, self.keys], dim=2)
        values = torch.cat([sel_values, prompt.local_values, self.values], dim=2)
        heads = (batch, num_kv_heads, q_len)
        mask = torch.cat(
            [
                sel_valid[:, :, None, :].expand(*heads, -1),
                prompt.local_valid[:, None, None, :].expand(*heads, -1),
                new_token_mask(attention_mask, prompt.slots, self.keys.shape[2], q_len, query.device).expand(
                    *heads, -1
                ),
            ],
            dim=-1,
        )  # [B, Hkv, T, N]
        return grouped_attention(query, keys, values, mask, scaling)

    def _whole_prompt(self, batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every quantised token, dequantised, for a multi-token step (a new chat turn, a question after a
        shared document): keys and values `[B, Hkv, N, D]` and validity `[B, Hkv, N]`. As in ShadowKV mode
        (`dense_multi_token_steps`), such a step reads the whole prompt once, as a prefill would."""
        prompt = self.prompt
        # Rows of one shared document are fetched and dequantised once.
        rows = 1 if prompt.is_one_document else batch
        records = prompt.store.rows(rows).to(self.keys.device, non_blocking=True)
        keys, values = dequant_records(records, self.quantizer(dim), self.keys.dtype)
        self.fetched_bytes += records.numel()
        shape = (batch, *keys.shape[1:])
        return keys.expand(shape), values.expand(shape), prompt.selectable

    # -- accounting ---------------------------------------------------------------------------------------

    def nbytes(self) -> tuple[int, int, int]:
        """(device bytes, host bytes, bytes a `DynamicCache` would hold for the same tokens)."""
        if not self.is_initialized:
            return 0, 0, 0
        exact = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        if self.prompt is None:
            return exact, 0, exact
        batch, heads, _, dim = self.keys.shape
        full = 2 * batch * heads * self.get_seq_length() * dim * self.keys.element_size()
        return exact + self.prompt.device_nbytes, self.prompt.store.nbytes, full
