"""`ShadowKVCache`: the drop-in `transformers.Cache` (ShadowKV, Sun et al., ICML 2025, arXiv:2410.21465)."""

from __future__ import annotations

import copy
import dataclasses
import os
import weakref
from collections.abc import Mapping

import torch
from torch import nn
from transformers.cache_utils import Cache

from .. import prefix
from ..config import ShadowKVConfig
from ..memory_report import MemoryReport
from ..model_keys import key_dims
from ..notices import Notices
from ..placement import check_placement
from ..policies import LandmarkTopK, QuantizedKeyTopK, SelectionPolicy
from ..shadowkv.mode import ShadowKVMode
from ..stores.value_codecs import check_value_format
from ..yakv.mode import YakvMode
from . import microbatch
from .adapters import patch_model
from .architectures import check_supported, sliding_windows
from .decode_graph import GraphSwitch
from .held_ids import HeldIds, TracksIds
from .layer import CompressedLayer
from .prefill import prefill as prefill_document
from .sliding_layer import SlidingLayer
from .state import CacheState, CheckedUpdates
from .step_graph import StepGraphs

__all__ = ["ShadowKVCache"]


class ShadowKVCache(CheckedUpdates, TracksIds, Cache):
    """A KV cache that keeps long prompts compressed on the accelerator and their values in host memory.

    At prefill each layer keeps a low-rank factorisation of the pre-RoPE keys, chunk landmarks, a few exact
    outlier chunks and the local window on the device, and moves the values to (pinned) host memory. Each
    decode step selects the top chunks per KV head, rebuilds only missed keys and fetches only missed values.
    Prompts shorter than `min_compress_len` stay exact. With `mode="yakv"` the prompt's keys and values are
    instead quantised ~4-bit into host memory and every token is scored from a ~2-bit copy of its key kept on
    the device; the top tokens per KV head are fetched (design.md §4, `YakvMode`).

    Args:
        model (`PreTrainedModel`): a causal LM of a supported architecture (`SUPPORTED_ARCHITECTURES`: Llama,
            Mistral, Qwen, Gemma, OLMo, Granite, GPT-OSS, ...); it is patched (attention function, rotary hook)
            reversibly, see `shadowkv_cache.unpatch_model`. Layers of type `sliding_attention`
            (`config.layer_types`) stay exact sliding-window layers (`SlidingLayer`); only full-attention layers are
            compressed.
        config (`ShadowKVConfig`, *optional*): settings; the paper's defaults scaled to the model when omitted.
        policy (`SelectionPolicy`, *optional*, defaults to `LandmarkTopK()`, or `QuantizedKeyTopK()` in YAKV
            mode): how chunks (YAKV: tokens) are scored.
        **overrides: any `ShadowKVConfig` field, e.g. `sparse_budget=512`.

    >>> cache = ShadowKVCache(model, sparse_budget=1024)  # doctest: +SKIP
    >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP
    >>> print(cache.memory_report())  # doctest: +SKIP

    A document prefilled once serves many questions, in this process (`fork`) or later ones (`save_prefix`,
    `load_prefix`); `generate` gets the document ids followed by the question's:

    >>> doc = ShadowKVCache.prefill(model, doc_ids, sparse_budget=1024)  # doctest: +SKIP
    >>> doc.save_prefix("doc.safetensors")  # doctest: +SKIP
    >>> doc = ShadowKVCache.load_prefix(model, "doc.safetensors")  # doctest: +SKIP
    >>> ids = torch.cat([doc.prefix_ids, question_ids])[None]  # doctest: +SKIP
    >>> out = model.generate(ids, past_key_values=doc.fork(), max_new_tokens=64)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        config: ShadowKVConfig | None = None,
        policy: SelectionPolicy | None = None,
        **overrides,
    ):
        # Everything is checked before the model is touched.
        given = set(overrides) | (set(config) if isinstance(config, Mapping) else set())
        unknown = sorted(given - set(ShadowKVConfig.field_names()))
        if unknown:
            raise TypeError(
                f"Unknown ShadowKVCache option(s) {unknown}; valid options: {ShadowKVConfig.field_names()}."
            )
        if isinstance(config, Mapping):
            config = ShadowKVConfig(**{**config, **overrides})
        elif config is None or isinstance(config, ShadowKVConfig):
            config = dataclasses.replace(config or ShadowKVConfig(), **overrides)
        else:
            raise TypeError(
                f"config must be a ShadowKVConfig (the cache's own settings), got {type(config).__name__}; the model's "
                "config is read from the model. Pass ShadowKVConfig(...), a dict of its fields, or keyword options "
                "such as sparse_budget=1024."
            )
        check_supported(model)
        check_placement(model)  # a layer on disk or "meta" (design.md §11)
        text_config = model.config.get_text_config()
        kv_heads, head_dim = key_dims(text_config)
        config.validate(key_dim=kv_heads * head_dim, head_dim=head_dim)
        check_value_format(config.value_format, head_dim)
        if policy is not None and not isinstance(policy, SelectionPolicy):
            raise TypeError(f"policy must be a SelectionPolicy, got {type(policy).__name__}.")
        yakv = config.mode == "yakv"
        # ShadowKV mode selects chunks, YAKV mode single tokens.
        granularity = "token" if yakv else "chunk"
        if policy is not None and policy.granularity != granularity:
            raise ValueError(
                f"mode={config.mode!r} selects by {granularity}, but {type(policy).__name__} scores by "
                f"{policy.granularity}; pass a {granularity}-granularity policy or leave policy=None."
            )

        adapter = patch_model(model)
        self.config = config
        self.policy = policy or _default_policy(config)
        self._graphs = GraphSwitch()  # off for this cache once a capture fails
        self.notices = Notices()  # what this cache has told its user (logger "shadowkv_cache")

        def mode(layer_idx: int):
            if yakv:
                return YakvMode(config, self.policy)
            return ShadowKVMode(config, self.policy, adapter.layer_rope(layer_idx))

        layers = [
            CompressedLayer(mode(i), self._graphs) if window is None else SlidingLayer(window)
            for i, window in enumerate(sliding_windows(text_config))
        ]
        super().__init__(layers=layers)
        self._model = weakref.ref(model)  # for the model's identity when a prefix is saved
        self._state = CacheState(model, adapter.attention)  # bound to this model, one thread at a time, roll-back
        # The patched forward runs the model's calls through it: a one-token step replays as one CUDA graph.
        self.step_graphs = StepGraphs(self._graphs, self._state, adapter.pieces if config.compile_model_ops else None)
        self._prefix_ids: torch.Tensor | None = None  # [S] the document this cache started from, if known
        self._prefix_checked = False
        self._prefilled: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, P] ids and mask of prefill_batch
        self._held = HeldIds()  # the ids the rows hold, while known (hf/held_ids.py)

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        super().reset()
        self.step_graphs.reset()
        self._prefix_ids, self._prefix_checked, self._prefilled, self._held = None, False, None, HeldIds()
        self._state.broken = None  # a cache marked broken is usable again once empty

    # -- prefix reuse (format and checks in prefix/) -------------------------------------------------------

    @classmethod
    def prefill(
        cls,
        model: nn.Module,
        input_ids: torch.Tensor,
        config: ShadowKVConfig | None = None,
        policy: SelectionPolicy | None = None,
        progress: bool = False,
        **overrides,
    ) -> ShadowKVCache:
        """A new one-row cache holding the document `input_ids` (`[S]` or `[1, S]`), ready to `save_prefix` or
        `fork`: one forward pass (no generation), with a per-layer progress bar if `progress`."""
        cache = cls(model, config, policy, **overrides)
        ids = prefix.as_prefix_ids(input_ids)
        prefill_document(model, ids, cache, progress=progress)
        cache._prefix_ids = ids
        return cache

    @classmethod
    def prefill_batch(
        cls,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        micro_batch_size: int = 1,
        config: ShadowKVConfig | None = None,
        policy: SelectionPolicy | None = None,
        progress: bool = False,
        **overrides,
    ) -> ShadowKVCache:
        """A cache of B rows holding the left-padded batch `input_ids` (`[B, L]`) but its last token, prefilled
        `micro_batch_size` rows at a time, for `generate` to decode together.

        The device then holds one micro batch's prefill at a time (activations, one layer's full K/V) plus the
        compressed rows so far, instead of the whole batch's prefill. Rows get exactly what a batched prefill of
        `input_ids[:, :-1]` gives them. Pass `generate` the same `input_ids` and `attention_mask` (checked on its
        first step): it feeds the last token as a one-token step. Sampling, streaming and stopping criteria work
        as usual; beam search and `num_return_sequences > 1` do not (the cache has B rows).

        Args:
            input_ids (`torch.Tensor`): `[B, L]` token ids, left-padded, `L >= 2`.
            attention_mask (`torch.Tensor`, *optional*): `[B, L]` 1 on real tokens, 0 on (left) pads.
            micro_batch_size (`int`, *optional*, defaults to 1): rows per forward pass.
            progress (`bool`): progress bars over rows and, within each micro batch, over layers.
            config, policy, **overrides: as for `ShadowKVCache(model, ...)`.

        >>> cache = ShadowKVCache.prefill_batch(model, ids, mask, micro_batch_size=1)  # doctest: +SKIP
        >>> out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP
        """
        ids, mask = microbatch.check_batch(input_ids, attention_mask, micro_batch_size)
        cache = cls(model, config, policy, **overrides)
        ids, mask = ids[:, :-1], mask[:, :-1]

        def part() -> ShadowKVCache:  # one micro batch's cache; its notices are the joined cache's
            made = cls(model, cache.config, cache.policy)
            made.notices = cache.notices
            return made

        parts = microbatch.prefill_parts(model, ids, mask, micro_batch_size, part, progress)
        microbatch.join_parts(cache, parts, mask, cache.config.pin_memory)
        cache._prefilled, cache._held = (ids, mask), HeldIds(ids, mask)
        return cache

    @property
    def prefix_ids(self) -> torch.Tensor | None:
        """`[S]` int64 ids of the document this cache started from (`prefill`, `load_prefix`, `fork`), else None."""
        return self._prefix_ids

    def save_prefix(
        self, path: str | os.PathLike, input_ids: torch.Tensor | None = None, key: bytes | None = None
    ) -> None:
        """Save this one-row cache's document to a `.safetensors` file (atomically, with the usual file permissions;
        format in docs/prefix_format.md).

        Args:
            path (`str` or `os.PathLike`): the file to write (replaced if it exists).
            input_ids (`torch.Tensor`, *optional*): the document's ids (`[S]` or `[1, S]`), which the cache must
                hold exactly (save before generating); needed only when it was filled from embeddings.
            key (`bytes`, *optional*): sign with HMAC-SHA256 under this key (`load_prefix` then needs it); without
                a key the file's SHA-256 digests detect damage, not a deliberate change.
        """
        model = self._model()
        if model is None:
            raise prefix.PrefixCacheError("The model of this cache no longer exists; save while it is alive.")
        ids = prefix.ids_to_save(input_ids, self._prefix_ids, self._held.ids)
        with self._state.using():  # not while another thread's call changes the layers, nor when broken
            layers = [
                (layer.prompt, layer.keys, layer.values, layer.get_seq_length() if layer.is_initialized else 0)
                for layer in self.layers
            ]
            windows = sliding_windows(model.config.get_text_config())
            prefix.write_prefix(path, model, self.config, self.policy, ids, layers, windows, key=key)
        self._prefix_ids = ids

    @classmethod
    def load_prefix(
        cls,
        model: nn.Module,
        path: str | os.PathLike,
        config: ShadowKVConfig | None = None,
        policy: SelectionPolicy | None = None,
        verify: bool = True,
        key: bytes | None = None,
        **overrides,
    ) -> ShadowKVCache:
        """A new one-row cache holding the document saved at `path`, for `model` (the one that saved it).

        The file's model identity, config (`mode` included), version and every tensor's shape and dtype are checked
        before anything is built; a mismatch raises `PrefixCacheError` naming what differs. Only the decode-time
        settings (`sparse_budget`, `dense_multi_token_steps`, `pin_memory`, `cuda_graphs`, `compile_model_ops`) may
        differ from the saved config. ShadowKV's temporal cache starts empty; sliding-window layers start from the
        saved window. `verify=False` skips the header and tensor digests and the finiteness check (1.5 s per GiB on
        one CPU core) for a trusted file; `key` is a signed file's key; `policy` defaults to the mode's own.
        """
        windows = sliding_windows(model.config.get_text_config())  # unknown layer types raise here
        check_placement(model)  # before the file is read, as ShadowKVCache(model) would refuse it after
        state = prefix.read_prefix(
            model, path, config, policy, _default_policy, overrides, windows, verify=verify, key=key
        )
        cache = cls(model, state.config, state.policy)
        seen = len(state.token_ids)
        for layer, (prompt, keys, values) in zip(cache.layers, state.layers):
            if isinstance(layer, SlidingLayer):
                layer.set_window(keys, values, seen)
            else:
                layer.set_prefix(prompt, keys, values)
        cache._prefix_ids, cache._held = state.token_ids, HeldIds(state.token_ids[None])
        return cache

    def fork(self, batch_size: int = 1) -> ShadowKVCache:
        """A cache of `batch_size` rows that all start from this cache's one-row prefix and share it.

        The document's device tensors (factors, landmarks, outliers, local window, YAKV's scoring codes, sliding
        layers' windows) and host values are held once, whatever `batch_size`; each row has its own temporal cache
        and its own question and generated tokens. This cache is left as it is, so it can be forked again. For a
        batch of questions build the input with `shadowkv_cache.prefix.batch_questions` (for models with
        sliding-window layers, questions of one length: see `check_prefix_ids`).
        """
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (rows that share the document), got {batch_size!r}.")
        state = self._state.forked()  # its own conversation, so its own user (refused when this cache is broken)
        rows = {layer.keys.shape[0] for layer in self.layers if layer.is_initialized}
        after = {layer.keys.shape[2] for layer in self.layers if layer.is_compressed}
        seen = {layer.get_seq_length() for layer in self.layers if layer.is_initialized}
        known = self._prefix_ids is not None and seen != {len(self._prefix_ids)}
        if rows != {1} or after - {0} or known or not all(layer.is_initialized for layer in self.layers):
            raise prefix.PrefixCacheError(
                "fork() needs a one-row cache that holds only a document (right after prefill or load_prefix); "
                f"this one has {sorted(rows)} row(s) and {sorted(after)} token(s) after its compressed prompt."
            )
        forked = copy.copy(self)
        forked._state = state
        forked._graphs = GraphSwitch(self._graphs.enabled)
        forked.step_graphs = StepGraphs(forked._graphs, state, self.step_graphs.pieces)
        forked.layers = [layer.fork(batch_size, forked._graphs) for layer in self.layers]
        forked._prefix_checked, forked._prefilled, forked._held = False, None, self._held.repeated(batch_size)
        return forked

    def align_to(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        if not self._prefix_checked and len(input_ids) == self.rows():
            # A prefix or prefilled batch first, with its own errors; generate's first step checks again the rows it
            # expands (beams, several sequences).
            self.check_prefix_ids(input_ids, attention_mask)
            self._prefix_checked = False
        super().align_to(input_ids, attention_mask)

    def check_prefix_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Called with the full ids (and mask) `generate` got: they must start with this cache's prefix, or with
        the batch `prefill_batch` prefilled (once per cache)."""
        if self._prefix_checked:
            return
        if self._prefilled is not None:
            microbatch.check_generate_ids(*self._prefilled, input_ids, attention_mask)
        elif self._prefix_ids is not None:
            prefix.check_prefix_ids(self._prefix_ids, input_ids, rows=self.layers[0].keys.shape[0])
            if any(isinstance(layer, SlidingLayer) for layer in self.layers):
                prefix.refuse_pads_after_prefix(len(self._prefix_ids), attention_mask)
        else:
            return
        self._prefix_checked = True

    def memory_report(self) -> MemoryReport:
        """Device and host bytes per layer, per device and in total, the ratio to `DynamicCache`, and the hit rate."""
        return MemoryReport.of_layers(self.layers)

    def __repr__(self) -> str:
        compressed = sum(layer.is_compressed for layer in self.layers)
        return f"ShadowKVCache({self.config}, compressed_layers={compressed}/{len(self.layers)})"


def _default_policy(config: ShadowKVConfig) -> SelectionPolicy:
    """The mode's own policy: ShadowKV's landmarks, or YAKV's quantised keys at the config's scoring grid."""
    return QuantizedKeyTopK(config.score_grid_dim) if config.mode == "yakv" else LandmarkTopK()
