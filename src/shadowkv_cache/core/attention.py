"""Exact attention over a selected set, and the masks that say which slots of it hold real tokens.

Legend: B batch, Hq/Hkv query/KV heads, T query tokens, S prompt slots (pads included), G tokens held after the
prompt, P their buffer's capacity, N attended slots, D head dim.

A compressed layer attends over parts: what each mode keeps of the prompt on the device (outliers, selected
chunks or tokens, the local window) and the exact tokens after the prompt. Each part comes with a validity mask,
so padded slots, empty selection slots and left pads are never attended.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
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


def attend_parts(query: torch.Tensor, parts: list[Part], scaling: float) -> torch.Tensor:
    """`grouped_attention` of `query` `[B, Hq, T, D]` over the concatenated `parts`; returns `[B, T, Hq, D]`."""
    batch, _, q_len, _ = query.shape
    heads = parts[0][0].shape[1]
    shape = (batch, heads, q_len)
    keys = torch.cat([k for k, _, _ in parts], dim=2)
    values = torch.cat([v for _, v, _ in parts], dim=2)
    mask = torch.cat([valid.expand(*shape, -1) for _, _, valid in parts], dim=-1)  # [B, Hkv, T, N]
    return grouped_attention(query, keys, values, mask, scaling)


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
