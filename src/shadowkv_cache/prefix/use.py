"""Checks and helpers for using a prefix: the ids `generate` gets must start with the saved document.

Legend: S prefix tokens, N questions, Q question tokens.
"""

from __future__ import annotations

import operator

import torch

from .errors import PrefixCacheError
from .identity import token_ids_sha256

__all__ = ["as_prefix_ids", "batch_questions", "check_prefix_ids", "ids_to_save", "refuse_pads_after_prefix"]


def as_prefix_ids(input_ids) -> torch.Tensor:
    """`[S]` int64 CPU ids from a `[S]` or `[1, S]` tensor or list; one document only."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise PrefixCacheError(
            "A prefix is one document: pass its token ids as [S] or [1, S] integers, got shape "
            f"{tuple(ids.shape)} of {ids.dtype}."
        )
    return ids.to("cpu", torch.int64)


def ids_to_save(input_ids, prefix_ids: torch.Tensor | None, held: torch.Tensor | None) -> torch.Tensor:
    """The `[S]` ids `save_prefix` writes: `input_ids` if given, else what the cache holds (`held`, its record of
    `[B, L]` ids, or the `prefix_ids` it started from while the record starts with them); given ids must be those."""
    if held is not None and len(held) != 1:
        raise PrefixCacheError(
            f"save_prefix needs a one-row cache; this one holds {len(held)} rows. Save the document before fork(n), "
            "or prefill it alone (ShadowKVCache.prefill(model, ids))."
        )
    held = None if held is None else as_prefix_ids(held)
    starts = held is not None and prefix_ids is not None and torch.equal(held[: len(prefix_ids)], prefix_ids)
    known = prefix_ids if held is None or starts else held  # a record that does not start with it: cropped, refilled
    if input_ids is None and known is None:
        raise PrefixCacheError(
            "save_prefix needs the document's ids (this cache was not filled from ids): pass input_ids=..., or make "
            "the cache with ShadowKVCache.prefill(model, ids)."
        )
    ids = as_prefix_ids(input_ids if input_ids is not None else known)
    if known is not None and len(ids) == len(known) and not torch.equal(ids, known):
        raise PrefixCacheError("input_ids are not the document this cache holds (was prefilled with).")
    return ids


def check_prefix_ids(prefix_ids: torch.Tensor, input_ids: torch.Tensor, rows: int) -> None:
    """Raise unless every row of `input_ids` (`[B, T]`, what `generate` got) starts with the prefix (`[S]`)
    and goes on past it, and `B` is the cache's row count."""
    length = len(prefix_ids)
    batch, width = input_ids.shape[:2]
    if batch != rows:
        raise PrefixCacheError(
            f"generate got a batch of {batch} but the prefix cache has {rows} row(s); make one with "
            f"cache.fork(batch_size={batch}) (rows share the document)."
        )
    if width <= length:
        raise PrefixCacheError(
            f"generate got {width} tokens but the cache already holds the {length}-token prefix: pass the prefix "
            "ids followed by the question, torch.cat([cache.prefix_ids, question_ids]) (chunked prefill, "
            "prefill_chunk_size, is not supported on a prefix cache)."
        )
    head = input_ids[:, :length].to("cpu")
    differs = head != prefix_ids[None]
    if bool(differs.any()):
        row, col = (int(x) for x in differs.nonzero()[0])
        raise PrefixCacheError(
            f"The ids passed to generate do not start with the {length}-token prefix this cache holds (sha256 "
            f"{token_ids_sha256(prefix_ids)[:12]}...): row {row} differs first at token {col} "
            f"({int(head[row, col])} instead of {int(prefix_ids[col])}). Pass the document ids, then the question; "
            "in a batch, [document][left-padded question] (see shadowkv_cache.prefix.batch_questions)."
        )


def refuse_pads_after_prefix(length: int, attention_mask) -> None:
    """For models with sliding-window layers: raise if `attention_mask` (`[B, T]`) holds pads after the `length`-token
    prefix. Their windows count slots, pads included (Transformers' sliding mask), so pads between the document and a
    question would push document tokens out of the window and the row would not get what its question gets alone."""
    if attention_mask is not None and bool((attention_mask[:, length:] == 0).any()):
        raise PrefixCacheError(
            "This model has sliding-window layers, whose window counts pads: a batch of questions of different "
            "lengths, padded between the document and the question, would shift what each row sees. Fork one "
            "cache per question length (questions of one length need no pads), or ask them one at a time."
        )


def batch_questions(prefix_ids, questions, pad_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` (`[N, S + max Q]`) that ask N questions over one prefix in one batch.

    Rows are `[document][left-padded question]`, the layout a `cache.fork(batch_size=N)` expects: the pads sit
    between the document and the question and are masked. `generate` derives positions from the mask's
    cumulative sum, so a question's tokens get the positions they get alone (`S, S+1, ...`).

    Since pads are masked, any token id will do as `pad_token_id`; `None` (the `pad_token_id` of tokenizers without
    a pad token, such as Llama 3's and Mistral's) pads with the id 0.

    >>> ids, mask = batch_questions(doc.prefix_ids, [q1, q2], tokenizer.pad_token_id)  # doctest: +SKIP
    >>> model.generate(ids, attention_mask=mask, past_key_values=doc.fork(2), max_new_tokens=32)  # doctest: +SKIP
    """
    pad_token_id = _pad_id(pad_token_id)
    prefix = as_prefix_ids(prefix_ids)
    rows = [as_prefix_ids(q) for q in questions]
    if not rows:
        raise PrefixCacheError("batch_questions needs at least one question.")
    width = max(len(q) for q in rows)
    ids = torch.full((len(rows), len(prefix) + width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    ids[:, : len(prefix)] = prefix
    mask[:, : len(prefix)] = 1
    for i, q in enumerate(rows):
        ids[i, ids.shape[1] - len(q) :] = q
        mask[i, ids.shape[1] - len(q) :] = 1
    return ids, mask


def _pad_id(pad_token_id) -> int:
    if pad_token_id is None:
        return 0
    try:
        pad = operator.index(pad_token_id) if not isinstance(pad_token_id, bool) else -1
    except TypeError:
        pad = -1
    if pad < 0:
        raise TypeError(
            f"pad_token_id must be a token id (an int >= 0) or None, got {pad_token_id!r}; pads are masked, so any id "
            "will do (e.g. tokenizer.eos_token_id)."
        )
    return pad
