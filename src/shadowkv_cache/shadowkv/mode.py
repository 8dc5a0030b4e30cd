"""`ShadowKVMode`: what a compressed layer holds and does in ShadowKV mode (docs/design.md, "The decode step").

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, D head dim, K selected chunks, c chunk size, Tc compressed
tokens.

At prefill the prompt becomes a `CompressedPrompt` (low-rank pre-RoPE keys, landmarks, outliers, local window, values
on the host). A one-token step scores the landmarks, selects the top chunks per KV head, keeps the ones the
temporal cache already holds, rebuilds the missed keys and fetches the missed values, and attends exactly over
outliers, selected chunks, local window and the tokens after the prompt. Every tensor such a step touches keeps its
address, so the layer can capture it as a CUDA graph.
"""

from __future__ import annotations

import torch

from ..config import ShadowKVConfig
from ..core.attention import NO_TERMS, LogitTerms, Part
from ..ops.attend_parts import attend_parts
from ..ops.rebuild_keys import RopeFn
from ..policies.base import SelectionPolicy
from .prompt import CompressedPrompt, compress_prompt
from .temporal_cache import TemporalCache

__all__ = ["ShadowKVMode"]


class ShadowKVMode:
    """One layer's ShadowKV state: the compressed prompt and the temporal cache of selected chunks.

    Args:
        config (`ShadowKVConfig`): sizes and switches.
        policy (`SelectionPolicy`): scores chunks at each decode step (chunk granularity).
        rope (`RopeFn`): the model's rotary embedding, to rebuild keys at their true positions.
    """

    name = "shadowkv"
    graph_safe = True  # a one-token step never synchronises with the host

    def __init__(self, config: ShadowKVConfig, policy: SelectionPolicy, rope: RopeFn):
        self.config, self.policy, self.rope = config, policy, rope
        self.prompt: CompressedPrompt | None = None
        self.temporal: TemporalCache | None = None  # slots of the selected chunks, made with the prompt

    def empty_like(self) -> ShadowKVMode:
        """A mode of the same settings that holds nothing."""
        return ShadowKVMode(self.config, self.policy, self.rope)

    def make_prompt(
        self,
        keys_pre: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor,
        recent_queries: torch.Tensor | None,
        scaling: float | None,
        rank_queries: torch.Tensor | None = None,
    ) -> CompressedPrompt | None:
        """The compressed prompt of a prefill (`[B, Hkv, S, D]` keys before and after RoPE, values, `[B, S]` positions
        and real-token mask; the policy's observation window and the queries `rank="auto"` measures against, each
        `[B, Hq, W, D]`), or None when no row is long enough. Changes nothing here (`set_prompt` takes it)."""
        return compress_prompt(
            keys_pre,
            keys,
            values,
            positions,
            real,
            self.config,
            self.policy,
            recent_queries,
            scaling,
            rank_queries,
            self.rope,
        )

    def set_prompt(self, prompt: CompressedPrompt | None) -> None:
        """Hold `prompt` (a loaded, shared or joined one) with an empty temporal cache."""
        self.prompt, self.temporal = prompt, None
        if prompt is not None:  # made now, so that the memory report shows what decoding will hold
            self.temporal = TemporalCache.empty(prompt, prompt.max_budget_chunks)

    def drop_decode_state(self) -> None:
        """Free what only decoding needs (the temporal cache), e.g. in a cache that is only prefilled and joined;
        the next sparse step makes it again."""
        self.temporal = None

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep cache rows `index` (`[B']`, on the device), e.g. beam reordering."""
        self.prompt = self.prompt.select_rows(index)
        if self.temporal is not None:
            self.temporal = self.temporal.select_rows(index)

    def graph_key(self) -> tuple:
        """What a captured step depends on besides the query and the token buffer."""
        return id(self.prompt), id(self.temporal)

    def attend(
        self,
        query: torch.Tensor,
        scaling: float,
        query_mask: torch.Tensor | None,
        new_tokens: Part,
        terms: LogitTerms = NO_TERMS,
    ) -> torch.Tensor:
        """Exact attention of `query` (`[B, Hq, T, D]`) over outliers + selected (or, on a dense multi-token step,
        all) chunks + local window + `new_tokens`; `query_mask` (`[B, T]`, *optional*) marks a multi-token step's
        real tokens. Returns `[B, T, Hq, D]`."""
        prompt = self.prompt
        batch, _, q_len, _ = query.shape
        if q_len > 1 and self.config.dense_multi_token_steps:
            chunk_keys, chunk_values, chunk_valid = self._whole_prompt(batch, new_tokens[0].dtype)
        else:
            if self.temporal is None:
                self.temporal = TemporalCache.empty(prompt, prompt.max_budget_chunks)
            temporal = self.temporal
            slots = prompt.max_budget_chunks
            if slots:  # with every chunk an outlier there is nothing to select
                wanted = self.policy.select(query, prompt.policy_state, prompt.selectable, slots, scaling, query_mask)
                temporal.refresh(wanted, prompt, self.rope)
            chunk_keys, chunk_values = temporal.keys.flatten(2, 3), temporal.values.flatten(2, 3)
            chunk_valid = temporal.held.repeat_interleave(prompt.chunk_size, dim=-1)
        parts = [
            (prompt.outlier_keys, prompt.outlier_values, prompt.outlier_valid[:, None, None, :]),
            (chunk_keys, chunk_values, chunk_valid[:, :, None, :]),
            (prompt.local_keys, prompt.local_values, prompt.local_valid[:, None, None, :]),
            new_tokens,
        ]
        return attend_parts(query, parts, scaling, terms)

    def _whole_prompt(self, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every selectable chunk, for a multi-token step: keys `[B, Hkv, Tc, D]` rebuilt from the factors at
        their positions, values `[B, Hkv, Tc, D]` from host memory, and `[B, Hkv, Tc]` validity.

        A new chat turn or a question after a loaded prefix carries the information that decides what later
        steps need; attending to it sparsely (landmark scores summed over its tokens) loses facts at budgets
        where single-token decoding keeps them, so such steps read the whole prompt once, as a prefill would.
        """
        prompt = self.prompt
        # Rows of one shared document (stride 0) are rebuilt and fetched once.
        rows = 1 if prompt.a.stride(0) == 0 else batch
        a, b, positions = prompt.a[:rows], prompt.b[:rows], prompt.positions[:rows]
        pre_rope = torch.einsum("btr,brhd->bhtd", a, b)  # [B', Hkv, Tc, D]
        _, heads, tokens, dim = pre_rope.shape
        keys = self.rope(pre_rope.reshape(rows * heads, tokens, dim), positions.repeat_interleave(heads, dim=0))
        keys = keys.view(rows, heads, tokens, dim).to(dtype)
        values = prompt.values.read_rows(rows, keys.device, dtype)  # decoded from the store's format
        valid = prompt.selectable.repeat_interleave(prompt.chunk_size, dim=-1)
        return keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), valid

    def hit_counts(self) -> tuple[int, int] | None:
        """(chunks found in the temporal cache, chunks selected) so far; None before any sparse step."""
        if self.temporal is None:
            return None
        return int(self.temporal.hits), int(self.temporal.lookups)

    def reset_hit_counts(self) -> None:
        """Zero the counters behind `hit_counts`, in place (captured CUDA graphs go on counting in them)."""
        if self.temporal is not None:
            self.temporal.reset_counts()

    def sizes(self) -> tuple[int, int]:
        """(rank of the key factors, tokens selected per KV head and step), the largest over rows."""
        return self.prompt.a.shape[-1], self.prompt.max_budget_chunks * self.prompt.chunk_size

    def nbytes(self) -> tuple[int, int]:
        """(device bytes, host bytes) of the prompt and the temporal cache."""
        temporal = self.temporal.nbytes if self.temporal is not None else 0
        return self.prompt.device_nbytes + temporal, self.prompt.values.nbytes
