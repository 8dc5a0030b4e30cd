"""One layer's prompt in YAKV mode: quantised keys and values on the host, a scoring copy on the device (design.md §4).

Legend: B batch, S prompt slots (pads included), Hkv KV heads, D head dim, N quantised tokens (the longest
row's), W exact recent tokens, E record bytes.

Per row, the quantised tokens are the row's real tokens except its last `recent_window`, left-aligned in
`[0, N)`; the recent ones stay exact, right-aligned in `[0, W)`. Rows shorter than `min_compress_len` keep
all their tokens exact, so compressed and exact rows mix in one batch. Every padded slot is marked invalid,
so pads are never scored nor attended. Keys are stored after RoPE: nothing is rebuilt at decode.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..config import ShadowKVConfig
from ..core.rows import join_rows, local_window, share_rows, stored_once_nbytes, with_rows
from ..ops.quantize_higgs import quantize_vectors
from ..policies.base import SelectionPolicy
from ..quant import HiggsQuantizer
from ..stores.quantized_store import QuantizedKVStore, pack_records, record_bytes

__all__ = ["QuantizedPrompt", "quantize_prompt"]


@dataclass
class QuantizedPrompt:
    """Tensors (first dim = batch row) that stand for one layer's prompt in YAKV mode.

    Rows that hold one document (a prefix shared by several questions) are `expand` views of one copy: their
    first dim has stride 0. Nothing here writes into these tensors.
    """

    policy_state: dict[str, torch.Tensor]  # e.g. scoring codes [B, Hkv, N, D/p] and norms [B, Hkv, N]
    real: torch.Tensor  # [B, N] bool: quantised slots that hold a real token
    budget_tokens: torch.Tensor  # [B] int64 tokens to select per KV head
    local_keys: torch.Tensor  # [B, Hkv, W, D] post-RoPE, right-aligned
    local_values: torch.Tensor  # [B, Hkv, W, D]
    local_valid: torch.Tensor  # [B, W] bool
    store: QuantizedKVStore  # [rows, Hkv, N, E] in host memory (and its first tokens' on the device if mirrored)
    slots: int  # S: prompt length as `generate` counts it, pads included
    max_budget_tokens: int  # K = max over rows of budget_tokens

    ROW_FIELDS = ("real", "budget_tokens", "local_keys", "local_values", "local_valid")

    @property
    def selectable(self) -> torch.Tensor:
        """`[B, Hkv, N]` bool (a view): what the policy may select."""
        return self.real[:, None, :].expand(-1, self.local_keys.shape[1], -1)

    @property
    def is_one_document(self) -> bool:
        return self.real.shape[0] == 1 or self.real.stride(0) == 0

    def shared(self, batch_size: int) -> QuantizedPrompt:
        """This one-document prompt for `batch_size` rows that share it (stride-0 views, one host copy)."""
        if not self.is_one_document:
            raise ValueError(f"Only a one-document prompt can be shared; this one has {self.real.shape[0]} rows.")
        return self._with_rows(lambda t: share_rows(t, batch_size), torch.zeros(batch_size, dtype=torch.int64))

    def select_rows(self, index: torch.Tensor) -> QuantizedPrompt:
        """The same prompt for cache rows `index` (`[B']`); host records are shared, not copied."""
        if self.is_one_document:
            return self.shared(len(index))
        return self._with_rows(lambda t: t[index], index)

    def exact_rows(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor) -> QuantizedPrompt:
        """Rows of this prompt's batch that stayed exact (shorter than `min_compress_len`), as `quantize_prompt` holds
        such rows beside quantised ones: every real token in the right-aligned recent window, nothing quantised.

        Args:
            keys, values (`torch.Tensor`): `[B', Hkv, S, D]` the exact layer's post-RoPE keys and values.
            real (`torch.Tensor`): `[B', S]` bool, True on real tokens (left padding).
        """
        batch, heads, slots, _ = keys.shape
        lengths = real.sum(dim=-1).tolist()
        local_keys, local_values, local_valid = local_window(keys, values, lengths)
        return QuantizedPrompt(
            policy_state={k: v.new_zeros((batch, heads, 0, *v.shape[3:])) for k, v in self.policy_state.items()},
            real=torch.zeros((batch, 0), dtype=torch.bool, device=keys.device),
            budget_tokens=torch.zeros(batch, dtype=torch.int64, device=keys.device),
            local_keys=local_keys,
            local_values=local_values,
            local_valid=local_valid,
            store=QuantizedKVStore(
                self.store.data.new_zeros((batch, heads, 0, self.store.record_bytes)), torch.arange(batch)
            ),
            slots=slots,
            max_budget_tokens=0,
        )

    @classmethod
    def concat(cls, prompts: list[QuantizedPrompt], pin: bool) -> QuantizedPrompt:
        """One prompt whose rows are those of `prompts` in order (micro batches of one batch, same `slots`).

        Each field is padded to the largest size among the parts (quantised tokens `N`, recent window `W`) with
        zeros and invalid slots, as `quantize_prompt` pads rows of one batch: the result equals quantising the whole
        batch at once, but for the scoring codes of padded slots, which no step reads (they are not `real`). The
        recent window is right-aligned, so it is padded on the left. Host records are joined into one store, pinned
        if `pin`. Policy state tensors hold tokens on dim 2 (`[B, Hkv, N, ...]`).
        """
        first = prompts[0]
        odd = next(
            (p for p in prompts if (p.slots, sorted(p.policy_state)) != (first.slots, sorted(first.policy_state))), None
        )
        if odd is not None:
            raise ValueError(
                "QuantizedPrompt.concat needs prompts of one batch (same slots and policy state names); got "
                f"{(first.slots, sorted(first.policy_state))} and {(odd.slots, sorted(odd.policy_state))}."
            )
        changes = join_rows(prompts, cls.ROW_FIELDS)
        changes["store"] = QuantizedKVStore.concat([p.store for p in prompts], pin)
        changes["max_budget_tokens"] = max(p.max_budget_tokens for p in prompts)
        kept = {f.name: getattr(first, f.name) for f in fields(first)}
        return cls(**{**kept, **changes})

    def _with_rows(self, take, index: torch.Tensor) -> QuantizedPrompt:
        """A copy whose device tensors are `take(tensor)` and whose host parts are rows `index` (`[B']`)."""
        index = index.to("cpu")
        return with_rows(self, take, "store", index)

    @property
    def device_nbytes(self) -> int:
        """Bytes held on the device (the records' mirror included); rows shared through a stride-0 view count once."""
        tensors = [*(getattr(self, name) for name in self.ROW_FIELDS), *self.policy_state.values()]
        return stored_once_nbytes(tensors) + self.store.mirror_nbytes

    @property
    def num_real_tokens(self) -> int:
        """Quantised real tokens over all rows (a shared document counts once per row, as each row reads it)."""
        return int(self.real.sum())


def quantize_prompt(
    keys: torch.Tensor,
    values: torch.Tensor,
    real: torch.Tensor,
    config: ShadowKVConfig,
    policy: SelectionPolicy,
    quantizer: HiggsQuantizer,
    recent_queries: torch.Tensor | None = None,
    scaling: float | None = None,
) -> QuantizedPrompt | None:
    """Quantise a prefilled prompt, or return `None` when no row is long enough.

    Args:
        keys (`torch.Tensor`): `[B, Hkv, S, D]` post-RoPE keys.
        values (`torch.Tensor`): `[B, Hkv, S, D]`.
        real (`torch.Tensor`): `[B, S]` bool, True on real tokens (a left-padded suffix of each row).
        quantizer (`HiggsQuantizer`): the host grid (~4 bits) for keys and values.
        recent_queries (`torch.Tensor`, *optional*): `[B, Hq, W, D]` the last prefill queries, for policies
            with an observation window, with the attention `scaling`.
    """
    batch, heads, slots, dim = keys.shape
    n_real = real.sum(dim=-1).tolist()
    sizes = [config.resolve(n, heads * dim) for n in n_real]
    num = max(s.num_chunks for s in sizes)
    if num == 0:
        return None
    device = keys.device
    records = torch.zeros((batch, heads, num, record_bytes(quantizer.num_subvectors)), dtype=torch.uint8, device=device)
    token_keys = keys.new_zeros((batch, heads, num, dim))
    quantised = torch.zeros((batch, num), dtype=torch.bool, device=device)
    local_keys, local_values, local_valid = local_window(keys, values, [s.local for s in sizes])

    for row, (n, size) in enumerate(zip(n_real, sizes)):
        start, n_tok = slots - n, size.num_chunks
        if not n_tok:
            continue
        span = slice(start, start + n_tok)
        row_keys = keys[row, :, span]
        # In place on CUDA: the fused kernel reads these strided views and writes only codes and norms.
        records[row, :, :n_tok] = pack_records(
            quantize_vectors(quantizer, row_keys), quantize_vectors(quantizer, values[row, :, span])
        )
        token_keys[row, :, :n_tok] = row_keys
        quantised[row, :n_tok] = True

    units = token_keys[:, :, :, None]  # tokens as chunks of one, the policy interface's [B, Hkv, N, 1, D]
    if policy.observation_window:
        state = policy.prepare(units, recent_queries=recent_queries, scaling=scaling)
    else:
        state = policy.prepare(units)
    return QuantizedPrompt(
        policy_state=state,
        real=quantised,
        budget_tokens=torch.tensor([s.budget_chunks for s in sizes], dtype=torch.int64, device=device),
        local_keys=local_keys,
        local_values=local_values,
        local_valid=local_valid,
        store=QuantizedKVStore.offload(
            records, pin=config.pin_memory and device.type == "cuda", mirror_share=config.device_record_share
        ),
        slots=slots,
        max_budget_tokens=max(s.budget_chunks for s in sizes),
    )
