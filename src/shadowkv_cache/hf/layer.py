"""`CompressedLayer`: one layer's cache, exact until a long prefill, then a compressed prompt plus exact new tokens.

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, S prompt slots, G tokens after the prompt, P their buffer's
capacity, D head dim.

Before compression the layer is a plain `DynamicLayer` (`keys`/`values` hold everything). When the first fill is
long enough, its mode object (`ShadowKVMode` or `YakvMode`) compresses the prompt; from then on `keys`/`values` are
views of a `TokenBuffer` holding only the tokens that came after the prompt (generated tokens, new chat turns), kept
exact. This class owns what both modes share: the cache-layer life cycle Transformers drives, row operations,
prefix sharing, the token buffer and the CUDA graphs of one-token steps (`decode_graph.py`); the mode owns what it
keeps of the prompt and how a step selects from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from ..config import AUTO_QUERIES, ShadowKVConfig
from ..core.attention import NO_TERMS, LogitTerms, Part, new_token_mask, new_token_validity, real_queries, real_tokens
from ..ops.loader import kernels_available
from ..stores.token_buffer import TokenBuffer
from .background import PendingPrompt, compress_beside
from .decode_graph import DecodeGraph, GraphSwitch, capture_or_none
from .held_ids import kept_length
from .layer_mode import LayerMode

__all__ = ["CompressedLayer", "LayerMode"]


class CompressedLayer(DynamicLayer):
    """One full-attention layer of a `ShadowKVCache`.

    Args:
        mode (`LayerMode`): the mode's state and step (`ShadowKVMode` or `YakvMode`), empty.
        graphs (`GraphSwitch`): the cache's switch for CUDA graphs, shared by its layers.
    """

    def __init__(self, mode: LayerMode, graphs: GraphSwitch):
        super().__init__()
        self.mode, self.graphs = mode, graphs
        self.new: TokenBuffer | None = None  # the tokens after a compressed prompt
        self._graph: DecodeGraph | None = None
        self._graph_ready = False  # one eager step ran (kernels loaded, workspaces made): capture may follow
        self._pending: PendingPrompt | None = None  # the prompt being compressed beside the forward (background.py)

    @property
    def config(self) -> ShadowKVConfig:
        return self.mode.config

    @property
    def prompt(self):
        """The compressed prompt (`CompressedPrompt` or `QuantizedPrompt`), or None while the layer is exact."""
        self.finish_compression()
        return self.mode.prompt

    @property
    def is_compressed(self) -> bool:
        return self._pending is not None or self.mode.prompt is not None

    def finish_compression(self) -> None:
        """Hold the prompt compressed beside the forward, once it is done (a no-op when none is pending)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.mode.set_prompt(pending.result())

    # -- lifecycle ---------------------------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return super().get_seq_length() + (self.prompt.slots if self.prompt is not None else 0)

    def reset(self) -> None:
        self.mode, self.new, self._graph, self._pending = self.mode.empty_like(), None, None, None
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

    def cannot_crop(self, keep: int) -> str | None:
        """Why this layer cannot be cropped to `keep` tokens, or None when it can."""
        prompt_slots = self.prompt.slots if self.prompt is not None else 0
        if self.is_initialized and keep < min(prompt_slots, self.get_seq_length()):
            return (
                f"Cannot crop a ShadowKV cache to {keep} tokens: its first {prompt_slots} tokens are compressed. "
                "Crop only tokens added after the compressed prompt, or start a new cache."
            )
        return None

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end: a negative value removes that many; a positive one is the length to keep
        (Transformers < 5.18); 0 removes nothing."""
        length = self.get_seq_length()
        keep = kept_length(length, max_length)
        if keep >= length or not self.is_initialized:
            return
        if (reason := self.cannot_crop(keep)) is not None:
            raise NotImplementedError(reason)
        prompt_slots = self.prompt.slots if self.prompt is not None else 0
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
            self.mode.select_rows(index)
        if self.new is not None:  # the buffer's rows are copied; `keys`/`values` are views of them
            self.new = self.new.select_rows(index)
            self.keys, self.values = self.new.held()
        else:
            self.keys, self.values = self.keys[index], self.values[index]
        self._graph = None

    def checkpoint(self) -> tuple:
        """What `restore` needs to undo every later update, compression and row operation of this layer.

        References only, nothing is copied: an exact layer's update concatenates into new tensors, compression and row
        operations replace the prompt and the token buffer, and appends to the token buffer happen in place past its
        length, which `restore` crops away.
        """
        return dict(vars(self)), dict(vars(self.mode)), self.new.length if self.new is not None else None

    def restore(self, saved: tuple, ran_on_device: bool = True) -> None:
        """Go back to a `checkpoint` (after a failed call). `ran_on_device=False`: the call only recorded kernels (a
        failed capture), so the decode state on the device is as the checkpoint left it and is kept."""
        layer_state, mode_state, length = saved
        vars(self).clear()
        vars(self).update(layer_state)
        vars(self.mode).clear()
        vars(self.mode).update(mode_state)
        if self.new is not None:
            self.new.crop(length)
            self.keys, self.values = self.new.held()
        if self.prompt is not None and ran_on_device:
            # A step that failed part way may have left the selection half refreshed. Made again, the temporal cache
            # holds its chunks in other slots, so attention sums in another order: kept when nothing ran, a failed
            # capture changes no rounding of later steps.
            self.mode.drop_decode_state()
        self._graph = None

    def drop_decode_state(self) -> None:
        """Free what only decoding needs (ShadowKV's temporal cache, YAKV's held tokens) in a cache that is only
        prefilled (a micro batch that is joined next); a later sparse step makes it again."""
        if self.prompt is not None:
            self.mode.drop_decode_state()

    # -- prefix reuse -------------------------------------------------------------------------------------------

    def set_prefix(self, prompt, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from a prefix (a loaded, shared or joined document).

        Args:
            prompt (*optional*): the compressed document (the mode's prompt type); `None` for an exact layer.
            keys, values (`torch.Tensor`): `[B, Hkv, G, D]` the exact tokens: the whole document of an exact
                layer, none (`G = 0`) after a compressed prompt.
        """
        self.mode.set_prompt(prompt)
        self.new = TokenBuffer(keys, values) if prompt is not None else None
        self.keys, self.values = self.new.held() if self.new is not None else (keys, values)
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True
        self._graph = None

    def fork(self, batch_size: int, graphs: GraphSwitch) -> CompressedLayer:
        """A layer of `batch_size` rows that starts from this one-row prefix and shares it: `expand` views of its
        tensors and of its host values, no copy. Each row gets its own selection state and new tokens."""
        layer = CompressedLayer(self.mode.empty_like(), graphs)
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
        batch, heads, slots, dim = keys.shape
        real = real_tokens(attention_mask, batch, slots, keys.device)
        lengths = [slots] * batch if attention_mask is None else real.sum(dim=-1).tolist()
        if not any(self.config.resolve(n, heads * dim).num_chunks for n in lengths):
            return  # no row is long enough: the layer stays exact
        positions = positions.expand(batch, slots).to(torch.int64)
        window = self.mode.policy.observation_window
        recent = query[:, :, -window:] if window and query is not None else None
        rank_queries = query[:, :, -AUTO_QUERIES:] if query is not None else None
        inputs = (keys_pre, keys, values, positions, real, recent, scaling, rank_queries)
        mode = self.mode
        self._pending = compress_beside(lambda: mode.make_prompt(*inputs), inputs, keys.device)
        if self._pending is None:
            mode.set_prompt(mode.make_prompt(*inputs))
        self.new = TokenBuffer(keys[..., :0, :], values[..., :0, :])
        self.keys, self.values = self.new.held()
        self._graph = None

    # -- sparse attention at decode ------------------------------------------------------------------------

    def sparse_attention(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        terms: LogitTerms = NO_TERMS,
    ) -> torch.Tensor:
        """Exact attention of `query` (`[B, Hq, T, D]`) over what the mode selects of the prompt and the tokens
        after it, with the model's soft-capping or sinks (`terms`). Called after `update` appended this step's keys
        and values. Returns `[B, T, Hq, D]` like the Transformers attention functions."""
        q_len = query.shape[2]
        if q_len > 1:
            real = new_token_validity(attention_mask, self.prompt.slots, self.new.length, q_len, query.device)
            if real is not None:
                self.new.mark(real)
            return self._attend(query, attention_mask, scaling, terms)
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or not (self.graph_safe and self.graphs.per_layer):
            # A whole-step graph (hf/step_graph.py) holds this step or is about to: the layer's own graph is freed,
            # but before that capture (a graph destroyed inside a capture invalidates it).
            if not capturing:
                self._graph = None
            return self._attend(query, None, scaling, terms)
        key = (query.shape, query.dtype, scaling, terms.key(), *self.step_graph_key())
        if self._graph is None or self._graph.key != key:
            self._graph = None
            if not self._graph_ready:  # the first step runs eagerly: it loads kernels and makes workspaces
                self._graph_ready = True
                return self._attend(query, None, scaling, terms)
            self._graph = capture_or_none(lambda q: self._attend(q, None, scaling, terms), query, key)
            if self._graph is None:
                self.graphs.disable()
                return self._attend(query, None, scaling, terms)
        return self._graph(query)

    @property
    def graph_safe(self) -> bool:
        """Whether this layer's one-token step may be captured now (compressed, never waits for the host, on CUDA)."""
        return (
            self.prompt is not None
            and self.mode.graph_safe
            and self.graphs.enabled
            and self.config.cuda_graphs
            and self.new.keys.is_cuda
            and kernels_available(self.new.keys.device)
        )

    def step_graph_key(self) -> tuple:
        """What a captured one-token step of this layer depends on besides the query: the mode's state and the token
        buffer's addresses (they change when rows are reordered, the prompt is replaced or the buffer grows)."""
        new = self.new
        return (*self.mode.graph_key(), new.capacity, new.keys.data_ptr(), new.values.data_ptr(), new.cursor.data_ptr())

    def replayed_step(self, steps: int = 1) -> None:
        """`update`'s host side, for a step a replayed whole-step graph ran (hf/step_graph.py)."""
        self.new.advance(steps)
        self.keys, self.values = self.new.held()

    def _attend(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, terms: LogitTerms
    ) -> torch.Tensor:
        """The step itself; on one-token steps it reads only tensors whose addresses persist (graph-safe)."""
        return self.mode.attend(
            query,
            scaling,
            real_queries(attention_mask, self.prompt.slots, self.new.length, query),
            self._new_tokens(query, attention_mask),
            terms,
        )

    def _new_tokens(self, query: torch.Tensor, attention_mask: torch.Tensor | None) -> Part:
        """The token buffer as one attended part: keys and values `[B, Hkv, P, D]` and validity `[B or 1, 1, T, P]`."""
        new, q_len = self.new, query.shape[2]
        if q_len == 1:  # the whole buffer, so that shapes and addresses stay fixed from step to step
            valid = new.valid[:, None, None, :]
        else:
            seen = new_token_mask(attention_mask, self.prompt.slots, new.length, q_len, query.device)
            valid = F.pad(seen, (0, new.capacity - new.length), value=False)
        return new.keys, new.values, valid

    # -- accounting ---------------------------------------------------------------------------------------

    def kind(self) -> tuple[str, int | None, int | None]:
        """How the layer holds its tokens, for `memory_report`: (mode name or "exact", rank, budget)."""
        return ("exact", None, None) if self.prompt is None else (self.mode.name, *self.mode.sizes())

    def hit_counts(self) -> tuple[int, int] | None:
        """(selected units found on the device, units selected) so far, where the mode keeps such a cache."""
        return self.mode.hit_counts() if self.prompt is not None else None

    def nbytes(self) -> tuple[int, int, int]:
        """(device bytes, host bytes, bytes a `DynamicCache` would hold for the same tokens)."""
        if not self.is_initialized:
            return 0, 0, 0
        if self.prompt is None:
            exact = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
            return exact, 0, exact
        batch, heads, _, dim = self.keys.shape
        full = 2 * batch * heads * self.get_seq_length() * dim * self.keys.element_size()
        device, host = self.mode.nbytes()
        # The token buffer's whole capacity is held, not only the tokens in it.
        return device + self.new.nbytes, host, full
