"""`YakvMode`: what a compressed layer holds and does in YAKV mode, the context-intensive study's method
(docs/design.md, "YAKV mode").

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, N quantised prompt tokens, W exact recent tokens, K selected
tokens per KV head, D head dim.

At prefill the prompt's post-RoPE keys and values are quantised ~4-bit into host memory and a ~2-bit copy of every
key stays on the device. Each decode step scores every token from that copy, selects the top-K tokens per KV head,
keeps the ones the previous step already fetched (`HeldTokens`), fetches and dequantises the others, and attends
exactly over them, the recent window and the tokens after the prompt. No SVD, landmarks or outliers. Nothing in a
one-token step waits for the host (the counters live on the device, the scan and the fetch write in place) when
the records are pinned, so the layer captures it as a CUDA graph and replays it (`hf/decode_graph.py`), as in
ShadowKV mode. When the store's device mirror holds every token (`device_record_share=1`), a one-token step attends
over the selected records where the mirror keeps them (`ops/attend_records.py`): nothing is fetched and no token is
held, so the held tokens' memory goes to the batch.

A policy that shares the budget across heads (`SharedBudgetTopK`) gives each head up to `Hkv*k` slots, of which
`k` are valid on average: holding them all would take `Hkv` times the memory, so such a step fetches its valid
selection afresh (no reuse).
"""

from __future__ import annotations

import torch

from ..config import ShadowKVConfig
from ..core.attention import NO_TERMS, LogitTerms, Part
from ..ops.attend_parts import attend_parts
from ..ops.attend_records import attend_records, records_kernel_fits
from ..ops.gather_dequant import dequant_records, gather_dequant_missed
from ..policies.base import SelectionPolicy
from ..quant import HiggsQuantizer
from .held_tokens import HeldTokens
from .prompt import QuantizedPrompt, quantize_prompt

__all__ = ["YakvMode"]


class YakvMode:
    """One layer's YAKV state: the quantised prompt, the tokens held from the previous step, and the bytes fetched.

    Args:
        config (`ShadowKVConfig`): sizes and switches (`mode="yakv"`).
        policy (`SelectionPolicy`): a token-granularity policy (`QuantizedKeyTopK` by default).

    Attributes:
        held (`HeldTokens` or `None`): the selected tokens, dequantised on the device, made with the prompt (never
            with a policy that shares the budget across heads).
    """

    name = "yakv"

    def __init__(self, config: ShadowKVConfig, policy: SelectionPolicy, quantizer: HiggsQuantizer | None = None):
        self.config, self.policy = config, policy
        self.prompt: QuantizedPrompt | None = None
        self.held: HeldTokens | None = None
        self._quantizer = quantizer
        self._pinned = False  # whether the prompt's records are in pinned memory (graph_safe)
        self._dense_bytes = 0  # read by dense multi-token steps (known on the host)
        # What single-token steps did, on the device: (misses, steps, lookups, records read from host memory), banked
        # from held tokens when they are replaced or dropped (a new prefix, rows reordered, a rolled-back call), and
        # counted here by steps that hold nothing (a policy that shares the budget). The live held tokens count
        # their own (`HeldTokens.totals`).
        self._bank: torch.Tensor | None = None
        self._hit_base: torch.Tensor | None = None  # (misses, lookups) at the last reset_hit_counts

    def empty_like(self) -> YakvMode:
        """A mode of the same settings that holds nothing; it shares the quantiser, whose tables are already on the
        device."""
        return YakvMode(self.config, self.policy, self._quantizer)

    def quantizer(self, head_dim: int) -> HiggsQuantizer:
        """The host grid's quantiser (keys and values), made once (it caches its tensors per device)."""
        if self._quantizer is None or self._quantizer.head_dim != head_dim:
            self._quantizer = HiggsQuantizer(head_dim, self.config.host_grid_dim)
        return self._quantizer

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
    ) -> QuantizedPrompt | None:
        """The quantised prompt of a prefill (same arguments as `ShadowKVMode.make_prompt`; keys are kept after RoPE
        and not factorised, so the pre-RoPE keys, positions and `rank_queries` are not needed), or None when no row is
        long enough. Changes nothing here (`set_prompt` takes it)."""
        quantizer = self.quantizer(keys.shape[-1])
        return quantize_prompt(keys, values, real, self.config, self.policy, quantizer, recent_queries, scaling)

    @property
    def fetched_bytes(self) -> int:
        """Host-to-device bytes of quantised records read so far: the selected tokens single-token steps did not
        hold, every token of dense multi-token steps, but those the device mirror holds (reading it waits for the
        device's counter)."""
        records = 0 if self._bank is None else int(self._totals()[3])
        record_bytes = 0 if self.prompt is None else self.prompt.store.record_bytes
        return self._dense_bytes + records * record_bytes

    @property
    def sparse_steps(self) -> int:
        """Decode steps that selected tokens (reading it waits for the device's counter)."""
        return 0 if self._bank is None else int(self._totals()[1])

    @property
    def graph_safe(self) -> bool:
        """Whether a one-token step never synchronises with the host, so the layer may capture it: true unless the
        records sit in pageable host memory (`pin_memory=False`), which only the twin's fetch reads, waiting for
        the host."""
        return self._pinned

    @property
    def reuses(self) -> bool:
        """Whether steps keep the previous step's tokens (every policy but one that shares the budget)."""
        return not self.policy.shares_budget

    def set_prompt(self, prompt: QuantizedPrompt | None) -> None:
        """Hold `prompt` (a loaded, shared or joined one) with no token held yet."""
        self._retire_held()
        self.prompt = prompt
        self._pinned = prompt is not None and prompt.store.data.is_pinned()
        if prompt is not None:
            # Counters are made here, never inside a step: a step captured as a graph would replay their creation
            # and zero them at every replay (a cache reset keeps its layers' readiness to capture).
            device = prompt.local_keys.device
            if self._bank is None or self._bank.device != device:
                self._bank = torch.zeros(4, dtype=torch.int64, device=device)
                self._hit_base = torch.zeros(2, dtype=torch.int64, device=device)
        if prompt is not None and self.reuses and not self.attends_in_place:
            # made now, so that the memory report shows what decoding will hold
            batch, heads, _ = prompt.selectable.shape
            like = prompt.local_keys
            self.held = self._empty_held(
                (batch, heads, prompt.max_budget_tokens, like.shape[-1]), like.dtype, like.device
            )

    def drop_decode_state(self) -> None:
        """Free what only decoding needs (the held tokens); the next sparse step makes them again."""
        self._retire_held()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep cache rows `index` (`[B']`, on the device), e.g. beam reordering."""
        self.prompt = self.prompt.select_rows(index)
        if self.held is not None:
            held = self.held.select_rows(index)
            self._retire_held()
            self.held = held

    def _retire_held(self) -> None:
        """Bank what the held tokens counted, and drop them. Their counts are zeroed, so slots that come back (a
        call rolled back restores the mode's attributes) are not banked twice."""
        if self.held is not None and self._bank is not None:
            self._bank += self.held.totals(self._mirrored).to(self._bank.device)
            self.held.counts.zero_()
            self.held.host_records.zero_()
        self.held = None

    @property
    def attends_in_place(self) -> bool:
        """Whether one-token steps read the selected records in place: the store's device mirror holds every token.
        Where the kernels do not serve the model's shape (`ops/attend_records.records_kernel_fits`) a step falls back
        to fetching into held tokens, made at that step (the memory report counts them from then on)."""
        store = None if self.prompt is None else self.prompt.store
        return store is not None and store.mirror is not None and store.mirrored_tokens == store.data.shape[2] > 0

    @property
    def _mirrored(self) -> bool:
        return self.prompt is not None and self.prompt.store.mirror is not None

    def _totals(self) -> torch.Tensor:
        """(misses, steps, lookups, host records) of every single-token step so far (a device tensor)."""
        if self.held is None:
            return self._bank
        return self._bank + self.held.totals(self._mirrored).to(self._bank.device)

    def graph_key(self) -> tuple:
        return id(self.prompt), id(self.held)

    def _empty_held(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> HeldTokens:
        """Empty slots of `shape` `(B, Hkv, K, D)`, after banking what the slots before them counted."""
        self._retire_held()
        return HeldTokens.empty(shape, dtype, device)

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
        # the recent window and the tokens after the prompt, attended exactly beside the selection
        exact = [(prompt.local_keys, prompt.local_values, prompt.local_valid[:, None, None, :]), new_tokens]
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
            quantizer = self.quantizer(dim)
            in_place = self.attends_in_place
            if in_place and records_kernel_fits(query, prompt.store, ids, sel_valid, quantizer, exact, terms):
                self._bank[1] += 1  # a step; nothing held, looked up or read from host memory
                return attend_records(query, prompt.store, ids, sel_valid, quantizer, exact, scaling, terms)
            sel_keys, sel_values, sel_valid = self._fetch(ids, sel_valid, dtype)
        return attend_parts(query, [(sel_keys, sel_values, sel_valid[:, :, None, :]), *exact], scaling, terms)

    def _fetch(
        self, ids: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values `[B, Hkv, K', D]` of the selection `ids` (`[B, Hkv, K']`, where `valid`) and their validity:
        the held tokens refreshed, or (no reuse) the valid ones fetched into zeroed buffers."""
        store, quantizer = self.prompt.store, self.quantizer(self.prompt.local_keys.shape[-1])
        if not self.reuses:
            # Zeroed, not empty: invalid slots are masked, but their values still meet a zero probability.
            keys = torch.zeros((*ids.shape, quantizer.head_dim), dtype=dtype, device=ids.device)
            values = torch.zeros_like(keys)
            gather_dequant_missed(store, ids, valid, quantizer, keys, values)
            self._bank[1] += 1  # a step (no lookups are counted: no token is held)
            self._bank[3] += store.host_reads(ids, valid)
            return keys, values, valid
        if self.held is None or not self.held.fits(ids, dtype):
            self.held = self._empty_held((*ids.shape, quantizer.head_dim), dtype, ids.device)
        self.held.refresh(ids, valid, store, quantizer)
        return self.held.keys, self.held.values, self.held.held

    def _whole_prompt(
        self, batch: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every quantised token, dequantised, for a multi-token step (a new chat turn, a question after a
        shared document): keys and values `[B, Hkv, N, D]` and validity `[B, Hkv, N]`. As in ShadowKV mode
        (`dense_multi_token_steps`), such a step reads the whole prompt once, as a prefill would."""
        prompt = self.prompt
        # Rows of one shared document are fetched and dequantised once.
        rows = 1 if prompt.is_one_document else batch
        records, moved = prompt.store.rows_on(rows, device)
        keys, values = dequant_records(records, self.quantizer(dim), dtype)
        self._dense_bytes += moved
        shape = (batch, *keys.shape[1:])
        return keys.expand(shape), values.expand(shape), prompt.selectable

    def hit_counts(self) -> tuple[int, int] | None:
        """(selected tokens found held from the previous step, tokens selected) so far; None when this layer never
        held tokens (a policy that shares the budget, or the records read in place)."""
        if self._bank is None or not self.reuses or (self.attends_in_place and self.held is None):
            return None
        totals = self._totals()
        misses, lookups = (totals[[0, 2]] - self._hit_base).tolist()
        return lookups - misses, lookups

    def reset_hit_counts(self) -> None:
        """Zero the counts behind `hit_counts` (from now on: in place, so captured steps go on counting)."""
        if self._bank is not None:
            self._hit_base.copy_(self._totals()[[0, 2]])

    def sizes(self) -> tuple[None, int]:
        """(None: keys are quantised, not factorised; tokens selected per KV head and step, the largest over rows)."""
        return None, self.prompt.max_budget_tokens

    def nbytes(self) -> tuple[int, int]:
        """(device bytes, host bytes) of the prompt and the held tokens."""
        held = self.held.nbytes if self.held is not None else 0
        return self.prompt.device_nbytes + held, self.prompt.store.nbytes
