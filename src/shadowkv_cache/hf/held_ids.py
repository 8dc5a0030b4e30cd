"""The token ids a cache's rows hold, while every call that filled them passed ids (docs/reliability.md).

`generate` feeds the model only the ids past the cache's length: ids that do not start with the tokens the cache
holds (another document, a question asked again of a cache that already answered one) would be answered as if they
did, silently. With the ids the cache holds on record, `generate` refuses them, `save_prefix` refuses another
document's ids, and a call with another number of rows gets an error naming the fix instead of a shape error deep in
the model.

The record follows every call of the patched model's `forward` that passes `input_ids` (one small copy per call, on
the ids' device). A call that fills the cache otherwise (`inputs_embeds`, a submodule called directly, a synthetic
fill) and a search that reorders rows (beams) leave the ids unknown, and the checks off, until `reset()`.

Legend: B rows, L tokens held per row, T new tokens.
"""

from __future__ import annotations

import torch

__all__ = ["HeldIds", "TracksIds", "kept_length"]


def kept_length(length: int, max_length: int) -> int:
    """The tokens `crop(max_length)` keeps of `length`: a negative value removes that many, a positive one is the
    length to keep (Transformers < 5.18), 0 removes nothing."""
    return length + max_length if max_length <= 0 else max_length


class HeldIds:
    """The ids `[B, L]` a cache's rows hold, or unknown. Appends write in place past the current length (capacity
    doubles), so a checkpoint is the buffer, its length and whether it is known.

    Args:
        ids (`torch.Tensor`, *optional*): `[B, L]` ids the cache holds already (a prefix, a prefilled batch).
    """

    def __init__(self, ids: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        self._buffer = None if ids is None else ids.clone()
        self._valid = None if ids is None else _valid(mask, ids).clone()  # [B, cap] bool: not a pad when fed
        self._length = 0 if ids is None else ids.shape[-1]
        self.known = True

    @property
    def ids(self) -> torch.Tensor | None:
        """`[B, L]`, or None when unknown or empty."""
        if not self.known or self._buffer is None:
            return None
        return self._buffer[:, : self._length]

    def checkpoint(self) -> tuple:
        return self._buffer, self._valid, self._length, self.known

    def restore(self, saved: tuple) -> None:
        self._buffer, self._valid, self._length, self.known = saved

    def forget(self) -> None:
        self._buffer, self._valid, self._length, self.known = None, None, 0, False

    def crop(self, length: int) -> None:
        if self.known:
            self._length = min(self._length, length)

    def repeated(self, rows: int) -> HeldIds:
        """A record for `rows` rows that each hold this one-row record's ids (`fork`)."""
        ids = self.ids
        if not self.known or ids is None or ids.shape[0] != 1:
            made = HeldIds()
            made.known = self.known and ids is None
            return made
        return HeldIds(ids.expand(rows, -1), self._valid[:, : self._length].expand(rows, -1))

    def record(self, ids: torch.Tensor | None, before: int, after: int, mask: torch.Tensor | None = None) -> None:
        """After a call that took the cache from `before` to `after` tokens per row, fed `ids` `[B, T]` (None: the
        call passed embeddings) under `mask` (the call's 2-D attention mask, whose last T columns are these ids';
        None: no pads)."""
        if not self.known or after == before:
            return
        fits = ids is not None and ids.dim() == 2 and ids.shape[1] == after - before
        if not fits or self._length != before or (self._buffer is not None and self._buffer.shape[0] != ids.shape[0]):
            self.forget()
            return
        if mask is not None and (mask.dim() != 2 or mask.shape[0] != ids.shape[0] or mask.shape[1] < ids.shape[1]):
            self.forget()  # a 4-D or custom mask: which tokens are pads is not known here
            return
        if self._buffer is None or self._buffer.shape[1] < after or self._buffer.device != ids.device:
            shape = (ids.shape[0], max(after, 2 * self._length, 64))
            grown = torch.empty(shape, dtype=ids.dtype, device=ids.device)
            valid = torch.empty(shape, dtype=torch.bool, device=ids.device)
            if self._buffer is not None:
                grown[:, : self._length].copy_(self._buffer[:, : self._length])
                valid[:, : self._length].copy_(self._valid[:, : self._length])
            self._buffer, self._valid = grown, valid
        self._buffer[:, before:after].copy_(ids)
        if mask is None:  # in place: no temporary tensor at each decode step
            self._valid[:, before:after].fill_(True)
        else:
            self._valid[:, before:after].copy_(mask[:, -ids.shape[1] :])  # nonzero: a real token
        self._length = after

    def first_difference(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int | None:
        """The first position where `input_ids` `[B, T]` (pads where `attention_mask` is 0) differ from what the cache
        holds in any row: another id at a real token, or a token that is a pad in one and real in the other (pad ids
        do not count). `min(L, T)` when one starts the other; None when the held ids are unknown or have other rows."""
        held = self.ids
        if held is None or input_ids.dim() != 2 or input_ids.shape[0] != held.shape[0]:
            return None
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            return None  # not a mask of these ids: the call checks it itself
        n = min(held.shape[1], input_ids.shape[1])
        given = input_ids[:, :n].to(held.device)
        real = _valid(None if attention_mask is None else attention_mask[:, :n], given)
        was_real = self._valid[:, :n]
        differ = ((given != held[:, :n]) & real & was_real) | (real != was_real)
        differ = differ.any(0)
        return int(differ.int().argmax()) if bool(differ.any()) else n


def _valid(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """`[B, T]` bool: which of `ids` are real tokens under `mask` (None: all of them)."""
    if mask is None:
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    return mask.to(ids.device).bool()


class TracksIds:
    """What `ShadowKVCache` takes from this module, as a base placed before `transformers.Cache` (as
    `state.CheckedUpdates`): the row and length operations keep the record of held ids in step with the layers, and
    a call's rows are checked against the cache's. The cache sets `self._held` (a `HeldIds`)."""

    _held: HeldIds

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._held.forget()  # the ids are not followed through a search's reorders

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._held.forget()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._held.forget()

    def crop(self, max_length: int) -> None:
        length = self.get_seq_length()
        keep = kept_length(length, max_length)
        reason = self.cannot_crop(keep) if keep < length else None
        if reason is not None:  # before any layer is cropped
            raise NotImplementedError(reason)
        super().crop(max_length)
        self._held.crop(self.get_seq_length())

    def cannot_crop(self, keep: int) -> str | None:
        """Why some layer cannot be cropped to `keep` tokens, or None when every one can."""
        return next((reason for layer in self.layers if (reason := layer.cannot_crop(keep)) is not None), None)

    def rows(self) -> int | None:
        """The rows the cache holds, or None while it is empty."""
        return next((layer.keys.shape[0] for layer in self.layers if layer.is_initialized), None)

    def check_rows(self, rows: int) -> None:
        """Raise `ValueError` unless a call of `rows` rows may continue this cache (any, when it is empty)."""
        held = self.rows()
        if held is not None and rows != held:
            raise ValueError(
                f"This cache holds {held} row(s); the call has {rows}. A cache continues the rows it holds: pass "
                f"{held} row(s), use fork(n) of a one-row prefilled document for n rows, or make a new cache "
                "(or call cache.reset())."
            )

    def align_to(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Make the cache hold a prefix of `generate`'s `input_ids` `[B, T]` (when its ids are known): the tokens from
        the first difference on are dropped (an earlier answer that tokenises otherwise when the conversation is
        rendered again, a question asked again), and at least one id is left to feed. Where a layer cannot drop them
        (inside the compressed prompt, a sliding window already full) it raises `ValueError` before any layer changes.
        Runs before the call's record of the layers is taken, so a call that fails later leaves the cache holding this
        prefix, with its ids: a later call feeds what it needs again."""
        length = self.get_seq_length()
        if length == 0 or self._held.ids is None or self._held.ids.shape[1] != length:
            return
        same = self._held.first_difference(input_ids, attention_mask)
        if same is None:
            return
        given = input_ids.shape[1]
        keep = min(same, given - 1)
        if keep >= length:
            return
        reason = self.cannot_crop(keep)
        if reason is not None:
            where = (
                f"they are the first {given} of the {length} tokens it holds (at least one new token must be fed)"
                if same == given
                else f"they differ from the {length} tokens it holds at position {same}"
            )
            raise ValueError(
                f"input_ids do not continue this cache: {where}, and it cannot drop its tokens from there "
                f"({reason.rstrip('.')}). generate feeds the model only the ids after the cache's tokens, so the "
                "answer would follow the cache's tokens, not these ids. Pass ids that start with the tokens the cache "
                "holds (the previous call's output sequences, then the new turn), or use a new cache for another "
                "document (fork() of a prefilled or loaded one)."
            )
        self.crop(keep - length)

    def record_call(self, ids: torch.Tensor | None, before: int, mask: torch.Tensor | None = None) -> None:
        """After a call of the patched `forward` that found the cache at `before` tokens and passed `ids` (and its
        2-D `attention_mask`)."""
        self._held.record(ids, before, self.get_seq_length(), mask)
