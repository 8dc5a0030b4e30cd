"""`SlidingLayer`: a sliding-window layer of a `ShadowKVCache`, kept exact (design.md §8).

Legend: B batch, Hkv KV heads, W sliding window, D head dim.

Models that alternate local and global attention (Gemma 3: five sliding-window layers per full-attention layer)
hold at most `W - 1` tokens per sliding layer, so there is nothing worth compressing there: those layers keep
Transformers' own `DynamicSlidingWindowLayer`, which makes them behave exactly as under the model's
`DynamicCache`, and ShadowKV compresses the full-attention layers only. This subclass adds the few read-only
attributes that `ShadowKVCache` asks of each of its layers, and what prefix reuse needs: starting from a saved window
(`set_window`) and sharing one among rows (`fork`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from ..core.rows import stored_once_nbytes

__all__ = ["SlidingLayer"]


class SlidingLayer(DynamicSlidingWindowLayer):
    """Transformers' `DynamicSlidingWindowLayer` (keys/values `[B, Hkv, min(S, W - 1), D]`), never compressed.

    Args:
        sliding_window (`int`): the layer's window `W` (`config.sliding_window`).
    """

    prompt = None  # no compressed prompt
    is_compressed = False

    def checkpoint(self) -> dict:
        """What `restore` needs to undo later updates: `update` replaces `keys`/`values` (concatenation, then the
        window's slice) and never writes into them, so references are enough."""
        return dict(vars(self))

    def restore(self, saved: dict, ran_on_device: bool = True) -> None:
        """Go back to a `checkpoint` (after a failed call); a sliding layer keeps no decode state, so `ran_on_device`
        changes nothing."""
        vars(self).clear()
        vars(self).update(saved)

    def set_window(self, keys: torch.Tensor, values: torch.Tensor, seen: int) -> None:
        """Start from a document's window (a loaded prefix): `keys`/`values` `[B, Hkv, min(seen, W - 1), D]`, the
        last tokens of the `seen` the layer has had, as `update` leaves them."""
        if keys.shape[2] != min(seen, self.sliding_window - 1):
            raise ValueError(
                f"A sliding layer of window {self.sliding_window} holds the last {min(seen, self.sliding_window - 1)} "
                f"of {seen} tokens, got {keys.shape[2]}."
            )
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.cumulative_length = keys, values, seen

    def cannot_crop(self, keep: int) -> str | None:
        """Why this layer cannot be cropped to `keep` tokens, or None when it can: once it has seen its window, it
        holds only the last `W - 1` tokens and has no earlier ones to go back to (unless it records the past,
        `activate_past_recording`)."""
        seen = self.get_seq_length() if self.is_initialized else 0
        if keep < seen and seen >= self.sliding_window and not getattr(self, "record_past", False):
            return (
                f"a sliding-window layer keeps only its last {self.sliding_window - 1} tokens, so once it has seen "
                f"{self.sliding_window} it cannot drop any"
            )
        return None

    def fork(self, batch_size: int, graphs=None) -> SlidingLayer:
        """A layer of `batch_size` rows that starts from this one-row window and shares it (`expand` views, no
        copy): `update` concatenates into new tensors, so rows never write into the shared one. `graphs` is unused
        (the signature of `CompressedLayer.fork`)."""
        layer = SlidingLayer(self.sliding_window)
        if self.is_initialized:
            shape = (batch_size, *self.keys.shape[1:])
            layer.set_window(self.keys.expand(shape), self.values.expand(shape), self.cumulative_length)
        return layer

    def kind(self) -> tuple[str, None, None]:
        """How the layer holds its tokens, for `memory_report` (as `CompressedLayer.kind`)."""
        return "sliding", None, None

    def hit_counts(self) -> None:
        """No selection, so no hits (as `CompressedLayer.hit_counts`)."""
        return None

    def nbytes(self) -> tuple[int, int, int]:
        """(device bytes, host bytes, bytes a `DynamicCache` would hold): the same window in both caches, but rows
        that share a document's window (`fork`) hold it once on the device."""
        if not self.is_initialized:
            return 0, 0, 0
        exact = self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()
        return stored_once_nbytes([self.keys, self.values]), 0, exact
