"""Oracle top-k: chunks ranked by the exact attention mass the current query gives them (an upper bound).

The reference point of sparse-attention studies, e.g. Tang et al., "Quest", ICML 2024,
https://arxiv.org/abs/2406.10774 (§4, oracle top-k), and the "oracle" selection of the context-intensive
study ("KV Cache Offloading for Context-Intensive Tasks", §4.2).
"""

from __future__ import annotations

import torch

from .base import SelectionPolicy, grouped_query

__all__ = ["OracleTopK"]


class OracleTopK(SelectionPolicy):
    """Scores each chunk by its exact softmax attention mass, summed over its tokens, the query tokens and the
    query heads of each GQA group.

    It keeps every exact post-RoPE key in its state: an upper bound for chunk selection at a given budget, not a
    method that saves memory. Summing (not maxing) over the group makes its top-k the chunks that hold the most
    attention mass on average over the group's heads, i.e. the best chunk choice for that measure.
    """

    granularity = "chunk"

    def prepare(self, chunk_keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": chunk_keys}  # [B, Hkv, C, c, D]

    def score(
        self, query: torch.Tensor, state: dict[str, torch.Tensor], selectable: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        return exact_chunk_mass(query, state["keys"], selectable, scaling).sum(dim=(2, 3))  # [B, Hkv, C]


def exact_chunk_mass(
    query: torch.Tensor, chunk_keys: torch.Tensor, selectable: torch.Tensor, scaling: float
) -> torch.Tensor:
    """`[B, Hkv, G, T, C]`: each query head's exact softmax attention mass on each chunk, normalised over the
    tokens of the selectable chunks (zero on the others).

    Args:
        query (`torch.Tensor`): `[B, Hq, T, D]`.
        chunk_keys (`torch.Tensor`): `[B, Hkv, C, c, D]` exact post-RoPE keys.
        selectable (`torch.Tensor`): `[B, Hkv, C]` bool.
    """
    batch, heads, num_chunks, c, _ = chunk_keys.shape
    q = grouped_query(query, heads).float()  # [B, Hkv, G, T, D]
    logits = torch.einsum("bhgtd,bhnd->bhgtn", q, chunk_keys.flatten(2, 3).float()) * scaling
    allowed = selectable.repeat_interleave(c, dim=-1)[:, :, None, None, :]  # [B, Hkv, 1, 1, C*c]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs.unflatten(-1, (num_chunks, c)).sum(dim=-1)
