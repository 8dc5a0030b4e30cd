"""One layer's compressed prompt: what ShadowKV keeps of the prefill (ShadowKV §3; design.md §2).

Legend: B batch, S prompt slots (pads included), Hkv KV heads, D head dim, c chunk size, C chunks,
Tc = C*c compressed tokens, R rank, O outlier chunks, W local-window tokens.

Per row, chunks start at the row's first real token; the ragged tail and the last `local_window` tokens
stay exact ("local"). Rows shorter than `min_compress_len` keep all their tokens in the local part, so
compressed and exact rows mix in one batch. Rows are padded to the batch's largest sizes and every
padded slot is marked invalid, so pads are never scored nor attended.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..config import ShadowKVConfig
from ..core.landmarks import chunk_landmarks, outlier_chunks
from ..core.low_rank import RankProbe, factorize_keys
from ..core.rows import join_rows, local_window, share_rows, stored_once_nbytes, with_rows
from ..ops.rebuild_keys import RopeFn
from ..policies.base import SelectionPolicy
from ..stores.value_store import HostValueStore

__all__ = ["CompressedPrompt", "compress_prompt", "local_only_prompt"]


@dataclass
class CompressedPrompt:
    """Tensors (first dim = batch row) that stand for one layer's prompt after compression.

    Rows that hold one document (a prefix shared by several questions) are `expand` views of one copy: their
    first dim has stride 0. Readers index rows as usual; nothing here writes into these tensors.
    """

    a: torch.Tensor  # [B, Tc, R] left factor, KV dtype
    b: torch.Tensor  # [B, R, Hkv, D] right factor, KV dtype
    positions: torch.Tensor  # [B, Tc] int64 RoPE positions of the compressed tokens
    policy_state: dict[str, torch.Tensor]  # e.g. landmarks [B, Hkv, C, D]
    selectable: torch.Tensor  # [B, Hkv, C] bool: real, non-outlier chunks
    budget_chunks: torch.Tensor  # [B] int64 chunks to select per head
    outlier_keys: torch.Tensor  # [B, Hkv, O*c, D] post-RoPE
    outlier_values: torch.Tensor  # [B, Hkv, O*c, D]
    outlier_valid: torch.Tensor  # [B, O*c] bool
    local_keys: torch.Tensor  # [B, Hkv, W, D] post-RoPE, right-aligned
    local_values: torch.Tensor  # [B, Hkv, W, D]
    local_valid: torch.Tensor  # [B, W] bool
    values: HostValueStore  # [rows, Hkv, C, c, D] in host memory, encoded in config.value_format
    chunk_size: int
    slots: int  # S: prompt length as `generate` counts it, pads included
    max_budget_chunks: int  # K = max over rows of budget_chunks

    ROW_FIELDS = (
        "a", "b", "positions", "selectable", "budget_chunks", "outlier_keys", "outlier_values",
        "outlier_valid", "local_keys", "local_values", "local_valid",
    )  # fmt: skip

    @property
    def is_one_document(self) -> bool:
        """True when every row holds the same document: one row, or rows that share one copy (`shared`)."""
        return self.a.shape[0] == 1 or self.a.stride(0) == 0

    def shared(self, batch_size: int) -> CompressedPrompt:
        """This one-document prompt for `batch_size` rows that share it: every device tensor becomes an `expand`
        view of the single copy (stride 0 over rows) and all rows reach the same host values. Nothing is copied;
        what is per row (temporal cache, question and generated tokens) lives in the layer."""
        if not self.is_one_document:
            raise ValueError(f"Only a one-document prompt can be shared; this one has {self.a.shape[0]} rows.")
        zeros = torch.zeros(batch_size, dtype=torch.int64)
        return with_rows(self, lambda t: share_rows(t, batch_size), "values", zeros)

    def select_rows(self, index: torch.Tensor) -> CompressedPrompt:
        """The same prompt for cache rows `index` (`[B']`); host values are shared, not copied, and so is a
        one-document prompt's device state (beam search or repeated rows over one prompt)."""
        if self.is_one_document:
            return self.shared(len(index))
        return with_rows(self, lambda t: t[index], "values", index)

    def exact_rows(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor) -> CompressedPrompt:
        """Rows of this prompt's batch that stayed exact (`keys`/`values` `[B', Hkv, S, D]`, `real` `[B', S]`), as a
        prompt that `concat` joins with this one (`local_only_prompt`)."""
        return local_only_prompt(keys, values, real, self)

    @classmethod
    def concat(cls, prompts: list[CompressedPrompt], pin: bool) -> CompressedPrompt:
        """One prompt whose rows are those of `prompts` in order (micro batches of one batch, same `slots`).

        Each field is padded to the largest size among the parts (chunks `Tc`/`C`, rank `R`, outliers `O*c`,
        local window `W`) with zeros and invalid slots, as `compress_prompt` pads rows of one batch: the result
        equals compressing the whole batch at once. The local window is right-aligned, so it is padded on the
        left; zero rank columns of `a` and rows of `b` add nothing to the keys. Host values are joined into
        one store, pinned if `pin`. Policy state tensors hold chunks on dim 2 (`[B, Hkv, C, ...]`).
        """
        first = prompts[0]

        def kind(p: CompressedPrompt) -> tuple:
            return p.slots, p.chunk_size, sorted(p.policy_state)

        odd = next((p for p in prompts if kind(p) != kind(first)), None)
        if odd is not None:
            raise ValueError(
                "CompressedPrompt.concat needs prompts of one batch (same slots, chunk size and policy state "
                f"names); got {kind(first)} and {kind(odd)}."
            )
        changes = join_rows(prompts, cls.ROW_FIELDS)
        changes["values"] = HostValueStore.concat([p.values for p in prompts], pin)
        changes["max_budget_chunks"] = max(p.max_budget_chunks for p in prompts)
        kept = {f.name: getattr(first, f.name) for f in fields(first)}
        return cls(**{**kept, **changes})

    @property
    def device_nbytes(self) -> int:
        """Bytes held on the device; rows shared through a stride-0 view count once."""
        return stored_once_nbytes([*(getattr(self, name) for name in self.ROW_FIELDS), *self.policy_state.values()])


def _empty_store_like(store: HostValueStore, batch: int) -> HostValueStore:
    """A store of `batch` rows and no chunks in the value format of `store` (so that the two can be joined)."""
    data = store.data.new_zeros((batch, store.data.shape[1], 0, *store.data.shape[3:]))
    scales = (
        None
        if store.scales is None
        else store.scales.new_zeros((batch, store.scales.shape[1], 0, *store.scales.shape[3:]))
    )
    return HostValueStore(data, torch.arange(batch), scales, store.codec)


def local_only_prompt(
    keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor, like: CompressedPrompt
) -> CompressedPrompt:
    """The prompt of rows kept exact (shorter than `min_compress_len`), as `compress_prompt` holds such rows in a
    batch where others are compressed: every real token in the right-aligned local window, no chunks.

    Args:
        keys, values (`torch.Tensor`): `[B, Hkv, S, D]` the exact layer's post-RoPE keys and values.
        real (`torch.Tensor`): `[B, S]` bool, True on real tokens (left padding).
        like (`CompressedPrompt`): a compressed part of the same batch, for the chunk size and the policy state's
            names and trailing shapes.
    """
    batch, heads, slots, dim = keys.shape
    window = int(real.sum(dim=-1).max())
    local_valid = real[:, slots - window :].to(keys.device)
    keep = local_valid[:, None, :, None]
    c, device = like.chunk_size, keys.device
    return CompressedPrompt(
        a=keys.new_zeros((batch, 0, 0)),
        b=keys.new_zeros((batch, 0, heads, dim)),
        positions=torch.zeros((batch, 0), dtype=torch.int64, device=device),
        policy_state={k: v.new_zeros((batch, v.shape[1], 0, *v.shape[3:])) for k, v in like.policy_state.items()},
        selectable=torch.zeros((batch, heads, 0), dtype=torch.bool, device=device),
        budget_chunks=torch.zeros(batch, dtype=torch.int64, device=device),
        outlier_keys=keys.new_zeros((batch, heads, 0, dim)),
        outlier_values=values.new_zeros((batch, heads, 0, dim)),
        outlier_valid=torch.zeros((batch, 0), dtype=torch.bool, device=device),
        # Pad slots hold zeros, as in `compress_prompt`.
        local_keys=torch.where(keep, keys[:, :, slots - window :], 0),
        local_values=torch.where(keep, values[:, :, slots - window :], 0),
        local_valid=local_valid,
        values=_empty_store_like(like.values, batch),
        chunk_size=c,
        slots=slots,
        max_budget_chunks=0,
    )


def compress_prompt(
    keys_pre: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    real: torch.Tensor,
    config: ShadowKVConfig,
    policy: SelectionPolicy,
    recent_queries: torch.Tensor | None = None,
    scaling: float | None = None,
    rank_queries: torch.Tensor | None = None,
    rope: RopeFn | None = None,
) -> CompressedPrompt | None:
    """Compress a prefilled prompt, or return `None` when no row is long enough.

    Args:
        keys_pre (`torch.Tensor`): `[B, Hkv, S, D]` pre-RoPE keys.
        keys (`torch.Tensor`): `[B, Hkv, S, D]` post-RoPE keys.
        values (`torch.Tensor`): `[B, Hkv, S, D]`.
        positions (`torch.Tensor`): `[B, S]` int64 RoPE positions.
        real (`torch.Tensor`): `[B, S]` bool, True on real tokens (a left-padded suffix of each row).
        recent_queries (`torch.Tensor`, *optional*): `[B, Hq, W, D]` the last prefill queries, for policies
            with an observation window (SnapKV), with the attention `scaling`.
        rank_queries (`torch.Tensor`, *optional*): `[B, Hq, W', D]` the last prefill queries that `rank="auto"`
            measures the logit error against, with the model's `rope`; without them an automatic rank is the
            ceiling of its rule.
    """
    batch, heads, slots, dim = keys.shape
    c = config.chunk_size
    n_real = real.sum(dim=-1).tolist()
    sizes = [config.resolve(n, heads * dim) for n in n_real]
    num_chunks = max(s.num_chunks for s in sizes)
    if num_chunks == 0:
        return None
    num_outliers = max(s.outliers for s in sizes)
    dtype, device = keys.dtype, keys.device

    # One factorisation per row across heads, [Tc, Hkv*D] (the paper's joint SVD); with rank="auto" each row's rank
    # comes from its keys' spectrum, so the factors are made before the batch's tensors are sized.
    factors = [None] * batch
    for row, (n, size) in enumerate(zip(n_real, sizes)):
        if size.num_chunks:
            span = slice(slots - n, slots - n + size.num_chunks * c)
            row_keys = keys_pre[row, :, span].transpose(0, 1).reshape(size.num_chunks * c, heads * dim)
            probe = None
            if rank_queries is not None and rope is not None:
                probe = RankProbe(rank_queries[row], keys[row, :, span], positions[row, span], rope, scaling)
            factors[row] = factorize_keys(
                row_keys, size.rank, size.max_logit_error, size.min_rank, probe, size.max_logit_shift
            )
    rank = max(f[0].shape[1] for f in factors if f is not None)
    a = keys.new_zeros((batch, num_chunks * c, rank))
    b = keys.new_zeros((batch, rank, heads, dim))
    chunk_pos = torch.zeros((batch, num_chunks * c), dtype=torch.int64, device=device)
    chunk_keys = keys.new_zeros((batch, heads, num_chunks, c, dim))
    chunk_values = values.new_zeros((batch, heads, num_chunks, c, dim))
    selectable = torch.zeros((batch, heads, num_chunks), dtype=torch.bool, device=device)
    out_keys = keys.new_zeros((batch, heads, num_outliers * c, dim))
    out_values = values.new_zeros((batch, heads, num_outliers * c, dim))
    out_valid = torch.zeros((batch, num_outliers * c), dtype=torch.bool, device=device)
    local_keys, local_values, local_valid = local_window(keys, values, [s.local for s in sizes])

    for row, (n, size) in enumerate(zip(n_real, sizes)):
        start, n_tok = slots - n, size.num_chunks * c
        if not size.num_chunks:
            continue
        span = slice(start, start + n_tok)
        left, right = factors[row]
        a[row, :n_tok, : left.shape[1]] = left.to(dtype)
        b[row, : left.shape[1]] = right.view(-1, heads, dim).to(dtype)
        chunk_pos[row, :n_tok] = positions[row, span]
        chunk_keys[row, :, : size.num_chunks] = keys[row, :, span].view(heads, size.num_chunks, c, dim)
        chunk_values[row, :, : size.num_chunks] = values[row, :, span].view(heads, size.num_chunks, c, dim)
        selectable[row, :, : size.num_chunks] = True
        if size.outliers:
            row_keys = chunk_keys[row, :, : size.num_chunks]
            ids = outlier_chunks(row_keys, chunk_landmarks(row_keys), size.outliers)  # [Hkv, o]
            head_ix = torch.arange(heads, device=device)[:, None]
            n_out = size.outliers * c
            out_keys[row, :, :n_out] = row_keys[head_ix, ids].reshape(heads, n_out, dim)
            out_values[row, :, :n_out] = chunk_values[row, :, : size.num_chunks][head_ix, ids].reshape(
                heads, n_out, dim
            )
            out_valid[row, :n_out] = True
            selectable[row].scatter_(1, ids, False)

    budget = torch.tensor([s.budget_chunks for s in sizes], dtype=torch.int64, device=device)
    return CompressedPrompt(
        a=a,
        b=b,
        positions=chunk_pos,
        policy_state=(
            policy.prepare(chunk_keys, recent_queries=recent_queries, scaling=scaling)
            if policy.observation_window
            else policy.prepare(chunk_keys)
        ),
        selectable=selectable,
        budget_chunks=budget,
        outlier_keys=out_keys,
        outlier_values=out_values,
        outlier_valid=out_valid,
        local_keys=local_keys,
        local_values=local_values,
        local_valid=local_valid,
        values=HostValueStore.offload(
            chunk_values, pin=config.pin_memory and device.type == "cuda", value_format=config.value_format
        ),
        chunk_size=c,
        slots=slots,
        max_budget_chunks=max(s.budget_chunks for s in sizes),
    )
