"""`ShadowKVLayer`: one layer's cache, exact until a long prefill, then a compressed prompt plus exact new tokens.

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, S prompt slots, G tokens after the prompt,
D head dim, K selected chunks, c chunk size, N attended keys.

Before compression the layer is a plain `DynamicLayer` (`keys`/`values` hold everything). When the first
fill is long enough, `compress` replaces the prompt by a `CompressedPrompt`; from then on `keys`/`values`
are views of a `TokenBuffer` holding only the tokens that came after the prompt (generated tokens, new chat
turns), kept exact. On CUDA one-token steps replay a captured graph (`decode_graph.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import DynamicLayer

from .compressed_prompt import CompressedPrompt, compress_prompt
from .config import ShadowKVConfig
from .decode_graph import DecodeGraph, capture_or_none
from .kernel_loader import kernels_available
from .ops.rebuild_keys import RopeFn
from .policies.base import SelectionPolicy
from .temporal_cache import TemporalCache
from .token_buffer import TokenBuffer

__all__ = ["ShadowKVLayer"]

_SPARSE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class ShadowKVLayer(DynamicLayer):
    """One layer of a `ShadowKVCache`.

    Args:
        config (`ShadowKVConfig`): sizes and switches.
        policy (`SelectionPolicy`): scores chunks at each decode step.
        rope (`RopeFn`): the model's rotary embedding, used to rebuild keys at their true positions.
    """

    def __init__(self, config: ShadowKVConfig, policy: SelectionPolicy, rope: RopeFn):
        super().__init__()
        self.config, self.policy, self.rope = config, policy, rope
        self.prompt: CompressedPrompt | None = None
        self.temporal: TemporalCache | None = None
        self.new: TokenBuffer | None = None  # the tokens after a compressed prompt
        self._graph: DecodeGraph | None = None
        self._graph_ready = False  # one eager step ran (kernels loaded, workspaces made): capture may follow

    @property
    def is_compressed(self) -> bool:
        return self.prompt is not None

    # -- lifecycle ---------------------------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return super().get_seq_length() + (self.prompt.slots if self.prompt is not None else 0)

    def reset(self) -> None:
        self.prompt = self.temporal = self.new = self._graph = None
        # Dropped, not zeroed: Transformers < 5.18 zeroes the tensors in place and keeps their length.
        self.keys = self.values = None
        self.is_initialized = False
        super().reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `[B, Hkv, T, D]` keys and values; after compression they go into the token buffer in place."""
        if self.new is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if self.new.append(key_states, value_states):
            self._graph = None
        self.keys, self.values = self.new.held()
        return self.keys, self.values

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end: a negative value removes that many; a positive one is the length to keep
        (Transformers < 5.18); 0 removes nothing."""
        length = self.get_seq_length()
        keep = length + max_length if max_length <= 0 else max_length
        if keep >= length or not self.is_initialized:
            return
        prompt_slots = self.prompt.slots if self.prompt is not None else 0
        if keep < prompt_slots:
            raise NotImplementedError(
                f"Cannot crop a ShadowKV cache to {keep} tokens: its first {prompt_slots} tokens are compressed. "
                "Crop only tokens added after the compressed prompt, or start a new cache."
            )
        if self.new is not None:
            self.new.crop(keep - prompt_slots)
            self.keys, self.values = self.new.held()
            return
        self.keys = self.keys[..., : keep - prompt_slots, :]
        self.values = self.values[..., : keep - prompt_slots, :]

    def activate_past_recording(self) -> None:
        # Assisted decoding verifies drafts in the same fill as the prompt, then crops the rejected ones,
        # which would already be compressed.
        raise NotImplementedError(
            "ShadowKVCache does not support assisted decoding or prompt-lookup decoding; drop "
            "`assistant_model` / `prompt_lookup_num_tokens`, or use DynamicCache for them."
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(beam_idx)

    def _select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.keys.device)
        if self.prompt is not None:
            self.prompt = self.prompt.select_rows(index)
        if self.temporal is not None:
            self.temporal = self.temporal.select_rows(index)
        if self.new is not None:  # the buffer's rows are copied; `keys`/`values` are views of them
            self.new = self.new.select_rows(index)
            self.keys, self.values = self.new.held()
        else:
            self.keys, self.values = self.keys[index], self.values[index]
        self._graph = None

    # -- prefix reuse -------------------------------------------------------------------------------------------

    def set_prefix(self, prompt: CompressedPrompt | None, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from a prefix (a loaded or shared document), with an empty temporal cache.

        Args:
            prompt (`CompressedPrompt`, *optional*): the compressed document; `None` for an exact layer.
            keys, values (`torch.Tensor`): `[B, Hkv, G, D]` the exact tokens: the whole document of an exact
                layer, none (`G = 0`) after a compressed prompt.
        """
        self.prompt = prompt
        self.temporal = TemporalCache.empty(prompt, prompt.max_budget_chunks) if prompt is not None else None
        self.new = TokenBuffer(keys, values) if prompt is not None else None
        self.keys, self.values = self.new.held() if self.new is not None else (keys, values)
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True
        self._graph = None

    def fork(self, batch_size: int) -> ShadowKVLayer:
        """A layer of `batch_size` rows that starts from this one-row prefix and shares it: `expand` views of its
        tensors and of its host values, no copy. Each row gets its own temporal cache and new tokens."""
        layer = type(self)(self.config, self.policy, self.rope)
        if self.is_initialized:
            shape = (batch_size, *self.keys.shape[1:])
            prompt = self.prompt.shared(batch_size) if self.prompt is not None else None
            layer.set_prefix(prompt, self.keys.expand(shape), self.values.expand(shape))
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
        """Compress the prompt just stored by the first `update`, if any row is long enough.

        Args:
            keys_pre (`torch.Tensor`): `[B, Hkv, S, D]` the same keys before RoPE.
            positions (`torch.Tensor`): `[B or 1, S]` their RoPE positions.
            attention_mask (`torch.Tensor`, *optional*): the prefill mask `[B, 1, S, S]` (bool, True = attend,
                or additive float); `None` when no row is padded.
            query (`torch.Tensor`, *optional*): `[B, Hq, S, D]` the prefill queries; the policy's observation
                window (its last tokens, real in every row since pads are on the left) goes to `prepare`.
            scaling (`float`, *optional*): the model's attention scaling, for the same.
        """
        keys, values = self.keys, self.values
        batch, _, slots, _ = keys.shape
        real = real_tokens(attention_mask, batch, slots, keys.device)
        positions = positions.expand(batch, slots).to(torch.int64)
        window = self.policy.observation_window
        recent = query[:, :, -window:] if window and query is not None else None
        prompt = compress_prompt(keys_pre, keys, values, positions, real, self.config, self.policy, recent, scaling)
        if prompt is None:
            return
        self.prompt = prompt
        self.temporal = TemporalCache.empty(prompt, prompt.max_budget_chunks)
        self.new = TokenBuffer(keys[..., :0, :], values[..., :0, :])
        self.keys, self.values = self.new.held()
        self._graph = None

    # -- sparse attention at decode ------------------------------------------------------------------------

    def sparse_attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """Exact attention of `query` (`[B, Hq, T, D]`) over outliers + selected chunks + local + new tokens.

        Called after `update` appended this step's keys and values. Returns `[B, T, Hq, D]` like the
        Transformers attention functions.
        """
        q_len = query.shape[2]
        if q_len > 1:
            real = new_token_validity(attention_mask, self.prompt.slots, self.new.length, q_len, query.device)
            if real is not None:
                self.new.mark(real)
            return self._attend(query, attention_mask, scaling)
        if not (self.config.cuda_graphs and query.is_cuda and kernels_available(query.device)):
            return self._attend(query, None, scaling)
        key = (query.shape, query.dtype, scaling, id(self.prompt), id(self.temporal), self.new.keys.data_ptr())
        if self._graph is None or self._graph.key != key:
            self._graph = None
            if not self._graph_ready:  # the first step runs eagerly: it loads kernels and makes workspaces
                self._graph_ready = True
                return self._attend(query, None, scaling)
            self._graph = capture_or_none(lambda q: self._attend(q, None, scaling), query, key)
            if self._graph is None:
                self.config.cuda_graphs = False
                return self._attend(query, None, scaling)
        return self._graph(query)

    def _attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The step itself; on one-token steps it reads only tensors whose addresses persist (graph-safe)."""
        prompt, temporal, new = self.prompt, self.temporal, self.new
        batch, num_q_heads, q_len, _ = query.shape
        num_kv_heads = new.keys.shape[1]
        c = prompt.chunk_size
        if q_len > 1 and self.config.dense_multi_token_steps:
            chunk_keys, chunk_values, chunk_valid = self._whole_prompt(batch)
        else:
            slots = prompt.max_budget_chunks
            valid = torch.arange(slots, device=query.device) < prompt.budget_chunks[:, None, None]  # [B, 1, K]
            valid = valid.expand(-1, num_kv_heads, -1)
            if slots:  # with every chunk an outlier there is nothing to select
                real = real_queries(attention_mask, prompt.slots, new.length, query)
                wanted = self.policy.select(query, prompt.policy_state, prompt.selectable, slots, scaling, real)
                temporal.refresh(wanted, valid, prompt, self.rope)
            chunk_keys, chunk_values = temporal.keys.flatten(2, 3), temporal.values.flatten(2, 3)
            chunk_valid = temporal.held.repeat_interleave(c, dim=-1)

        heads = (batch, num_kv_heads, q_len)
        if q_len == 1:  # the whole buffer, so that shapes and addresses stay fixed from step to step
            new_valid = new.valid[:, None, None, :].expand(*heads, -1)
        else:
            seen = new_token_mask(attention_mask, prompt.slots, new.length, q_len, query.device)
            new_valid = F.pad(seen, (0, new.capacity - new.length), value=False).expand(*heads, -1)
        keys = torch.cat([prompt.outlier_keys, chunk_keys, prompt.local_keys, new.keys], dim=2)
        values = torch.cat([prompt.outlier_values, chunk_values, prompt.local_values, new.values], dim=2)
        mask = torch.cat(
            [
                prompt.outlier_valid[:, None, None, :].expand(*heads, -1),
                chunk_valid[:, :, None, :].expand(*heads, -1),
                prompt.local_valid[:, None, None, :].expand(*heads, -1),
                new_valid,
            ],
            dim=-1,
        )  # [B, Hkv, T, N]
        return grouped_attention(query, keys, values, mask, scaling)

    def _whole_prompt(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        keys = keys.view(rows, heads, tokens, dim).to(self.keys.dtype)
        values = prompt.values.read_rows(rows, keys.device, keys.dtype)  # decoded from the store's format
        valid = prompt.selectable.repeat_interleave(prompt.chunk_size, dim=-1)
        return keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), valid

    # -- accounting ---------------------------------------------------------------------------------------

    def nbytes(self) -> tuple[int, int, int]:
        """(device bytes, host bytes, bytes a `DynamicCache` would hold for the same tokens)."""
        if not self.is_initialized:
            return 0, 0, 0
        if self.prompt is None:
            exact = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
            return exact, 0, exact
        batch, heads, _, dim = self.keys.shape
        full = 2 * batch * heads * self.get_seq_length() * dim * self.keys.element_size()
        # The token buffer's whole capacity is held, not only the tokens in it.
        device = self.new.nbytes + self.prompt.device_nbytes + self.temporal.nbytes
        return device, self.prompt.values.nbytes, full


def grouped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Exact attention of `query` `[B, Hq, T, D]` over `keys`/`values` `[B, Hkv, N, D]` where `mask`
    (`[B, Hkv, T, N]` bool) allows; returns `[B, T, Hq, D]` like the Transformers attention functions."""
    batch, num_q_heads, q_len, dim = query.shape
    num_kv_heads = keys.shape[1]
    # GQA without copying K/V per query head: the G query heads of a KV head become G*T query rows.
    groups = num_q_heads // num_kv_heads
    folded = query.reshape(batch, num_kv_heads, groups * q_len, dim)
    mask = mask.expand(-1, -1, groups, -1) if q_len == 1 else mask.repeat(1, 1, groups, 1)
    # Not cuDNN: its attention rebuilds a graph for every new key count (2 ms of CPU per call measured).
    with sdpa_kernel(_SPARSE_BACKENDS):
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(batch, num_q_heads, q_len, dim).transpose(1, 2).contiguous()


def real_tokens(attention_mask: torch.Tensor | None, batch: int, slots: int, device: torch.device) -> torch.Tensor:
    """`[B, S]` bool, True on real prompt tokens, from the prefill mask (its last query row sees them all)."""
    if attention_mask is None:
        return torch.ones((batch, slots), dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, -slots:]
    real = last if last.dtype == torch.bool else last == 0
    real = real.expand(batch, slots)
    # Chunks assume each row's real tokens are one left-padded run.
    first = real.int().argmax(dim=-1, keepdim=True)
    if not torch.equal(real, torch.arange(slots, device=device)[None] >= first):
        raise NotImplementedError(
            "ShadowKVCache needs left padding (tokenizer.padding_side = 'left'); this batch has pads after "
            "or between real tokens."
        )
    return real


def new_token_mask(
    attention_mask: torch.Tensor | None, prompt_slots: int, num_new: int, q_len: int, device: torch.device
) -> torch.Tensor:
    """`[B or 1, 1, T, G]` bool: which of the `G` tokens after the prompt each query token may see."""
    if attention_mask is not None:
        part = attention_mask[..., prompt_slots : prompt_slots + num_new]
        return part if part.dtype == torch.bool else part == 0
    seen = (
        torch.arange(num_new, device=device)[None, :] <= torch.arange(num_new - q_len, num_new, device=device)[:, None]
    )
    return seen[None, None]


def new_token_validity(
    attention_mask: torch.Tensor | None, prompt_slots: int, num_new: int, q_len: int, device: torch.device
) -> torch.Tensor | None:
    """`[B or 1, T]` bool: which of a step's `T` new tokens are real (a pad cannot see itself); `None` = all."""
    if attention_mask is None:
        return None
    seen = new_token_mask(attention_mask, prompt_slots, num_new, q_len, device)[:, 0]  # [B or 1, T, G]
    steps = torch.arange(q_len, device=device)
    return seen[:, steps, num_new - q_len + steps]


def real_queries(
    attention_mask: torch.Tensor | None, prompt_slots: int, num_new: int, query: torch.Tensor
) -> torch.Tensor | None:
    """`[B, T]` bool: the real tokens of a multi-token `query` step, or `None` when all are real, as on every
    one-token step. Pads sit among the new tokens when left-padded questions follow a shared document."""
    batch, _, q_len, _ = query.shape
    if q_len == 1:
        return None
    real = new_token_validity(attention_mask, prompt_slots, num_new, q_len, query.device)
    return None if real is None or bool(real.all()) else real.expand(batch, -1)
