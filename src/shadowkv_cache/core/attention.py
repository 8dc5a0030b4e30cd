"""Exact attention over a selected set, and the masks that say which slots of it hold real tokens.

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, S prompt slots (pads included), G tokens held after the
prompt, P their buffer's capacity, N attended slots, D head dim.

A compressed layer attends over parts: what each mode keeps of the prompt on the device (outliers, selected
chunks or tokens, the local window) and the exact tokens after the prompt. Each part comes with a validity mask,
so padded slots, empty selection slots and left pads are never attended. Some models change the softmax itself
(`LogitTerms`: Gemma 2's logit soft-capping, GPT-OSS's attention sinks); the attended set then gets the same
change, so that a full budget still gives the model's own attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "NO_TERMS",
    "LogitTerms",
    "Part",
    "attend_parts",
    "grouped_attention",
    "new_token_mask",
    "new_token_validity",
    "real_queries",
    "real_tokens",
]

_SPARSE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

# keys, values `[B, Hkv, N_i, D]` and their validity, broadcastable to `[B, Hkv, T, N_i]`
Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LogitTerms:
    """What a model adds to plain softmax attention, as its attention module passes it to the attention function.

    Args:
        softcap (`float`, *optional*): logits become `softcap·tanh(logits / softcap)` before the mask (Gemma 2's
            `attn_logit_softcapping`).
        sinks (`torch.Tensor`, *optional*): `[Hq]` one learned logit per query head that joins every softmax
            denominator and attends to nothing (GPT-OSS's `sinks`, passed as `s_aux`).
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return self.softcap is None and self.sinks is None

    def key(self) -> tuple:
        """What a captured decode step depends on (the sinks by address: a captured graph reads them there)."""
        return self.softcap, None if self.sinks is None else self.sinks.data_ptr()


NO_TERMS = LogitTerms()


def grouped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    terms: LogitTerms = NO_TERMS,
) -> torch.Tensor:
    """Exact attention of `query` `[B, Hq, T, D]` over `keys`/`values` `[B, Hkv, N, D]` where `mask`
    (`[B or 1, Hkv or 1, T, N]` bool) allows, with the model's `terms`; returns `[B, T, Hq, D]` like the
    Transformers attention functions."""
    batch, num_q_heads, q_len, dim = query.shape
    num_kv_heads = keys.shape[1]
    # GQA without copying K/V per query head: the G query heads of a KV head become G*T query rows.
    groups = num_q_heads // num_kv_heads
    folded = query.reshape(batch, num_kv_heads, groups * q_len, dim)
    mask = mask.expand(-1, -1, groups, -1) if q_len == 1 else mask.repeat(1, 1, groups, 1)
    if terms.plain:
        # Not cuDNN: its attention rebuilds a graph for every new key count (2 ms of CPU per call measured).
        with sdpa_kernel(_SPARSE_BACKENDS):
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    else:
        out = _attention_with_terms(folded, keys, values, mask, scaling, terms, groups, q_len)
    return out.reshape(batch, num_q_heads, q_len, dim).transpose(1, 2).contiguous()


def _attention_with_terms(
    folded: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    terms: LogitTerms,
    groups: int,
    q_len: int,
) -> torch.Tensor:
    """SDPA has neither soft-capping nor sinks: the softmax written out, in the order of the models' eager
    attention (scale, cap, mask, sinks, fp32 softmax). `folded` `[B, Hkv, G*T, D]`; returns the same shape."""
    logits = torch.matmul(folded, keys.transpose(-1, -2)) * scaling  # [B, Hkv, G*T, N]
    if terms.softcap is not None:
        logits = torch.tanh(logits / terms.softcap) * terms.softcap
    logits = logits.float().masked_fill(~mask, torch.finfo(torch.float32).min)
    if terms.sinks is not None:
        # Query head h = kv·G + g (Transformers' `repeat_kv`), so the folded rows of KV head kv are (g, t) pairs.
        sinks = terms.sinks.float().view(1, -1, groups, 1).expand(logits.shape[0], -1, -1, q_len)
        logits = torch.cat([logits, sinks.reshape(*logits.shape[:3], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if terms.sinks is not None:
        probs = probs[..., :-1]  # the sink's share of the mass attends to nothing
    return torch.matmul(probs.to(values.dtype), values)


def attend_parts(query: torch.Tensor, parts: list[Part], scaling: float, terms: LogitTerms = NO_TERMS) -> torch.Tensor:
    """`grouped_attention` of `query` `[B, Hq, T, D]` over the concatenated `parts` with the model's `terms`;
    returns `[B, T, Hq, D]`."""
    batch, _, q_len, _ = query.shape
    heads = parts[0][0].shape[1]
    shape = (batch, heads, q_len)
    keys = torch.cat([k for k, _, _ in parts], dim=2)
    values = torch.cat([v for _, v, _ in parts], dim=2)
    mask = torch.cat([valid.expand(*shape, -1) for _, _, valid in parts], dim=-1)  # [B, Hkv, T, N]
    return grouped_attention(query, keys, values, mask, scaling, terms)


def real_tokens(attention_mask: torch.Tensor | None, batch: int, slots: int, device: torch.device) -> torch.Tensor:
    """`[B, S]` bool, True on real prompt tokens, from the prefill mask (its last query row sees them all)."""
    if attention_mask is None:
        return torch.ones((batch, slots), dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, -slots:]
    real = last if last.dtype == torch.bool else last == 0
    real = real.expand(batch, slots)
    empty = (~real.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"Row(s) {empty} of this batch have no real token (their attention_mask is all zeros); give every row at "
            "least one token, or leave such rows out of the batch."
        )
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
