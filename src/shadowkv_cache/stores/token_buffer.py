"""Exact keys and values of the tokens after a compressed prompt, in fixed-capacity device buffers.

Legend: B batch, Hkv KV heads, G tokens held, P capacity (>= G), T tokens of one step, D head dim.

Generated tokens (and new chat turns) are appended in place rather than concatenated, so the tensors a
decode step reads keep their addresses from step to step: the step can then be captured once as a CUDA
graph and replayed, and no step copies the tokens already held. Slots past the length, and pads of
left-padded multi-token steps, are marked invalid, so attention may read the whole buffer.

Where the next tokens go is also kept on the device (`cursor`), and appends write there: a whole decode step
captured as one graph (hf/step_graph.py) holds the append, and its replays must each write one slot further. The
host's `length` is the same number; a replayed step moves it on with `advance`.
"""

from __future__ import annotations

import torch

__all__ = ["TokenBuffer"]

_MIN_CAPACITY = 256


class TokenBuffer:
    """Keys and values `[B, Hkv, P, D]` and validity `[B, P]` of the tokens after the prompt; `length` = G, and
    `cursor` (`[1]` int64 on the device) holds G too.

    Args:
        keys, values (`torch.Tensor`): `[B, Hkv, G, D]` the tokens held so far (any strides, e.g. the
            `expand` views of a shared document); copied into buffers of capacity `max(G, capacity)`.
        capacity (`int`, *optional*): slots to allocate (defaults to the tokens held; the first append grows it).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int = 0):
        held = keys.shape[2]
        self.length = held
        valid = torch.ones((keys.shape[0], held), dtype=torch.bool, device=keys.device)
        self._place(keys, values, valid, max(held, capacity))
        self.cursor = torch.full((1,), held, dtype=torch.int64, device=keys.device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.valid))

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[B, Hkv, G, D]` of the keys and values held (what the cache API reports)."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def fits(self, steps: int) -> bool:
        """Whether `steps` more tokens fit without growing (moving) the buffers."""
        return self.length + steps <= self.capacity

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Write `[B, Hkv, T, D]` after the held tokens, as valid; returns True when the buffers moved (grown).

        The slots written are read from `cursor` on the device, not from the host's `length`, so that a captured
        append writes where each replay has got to."""
        start, steps = self.length, keys.shape[2]
        moved = not self.fits(steps)
        if moved:
            self._grow(max(_MIN_CAPACITY, 2 * self.capacity, start + steps))
        slots = self.cursor if steps == 1 else self.cursor + torch.arange(steps, device=self.cursor.device)
        self.keys.index_copy_(2, slots, keys.to(self.keys.dtype))
        self.values.index_copy_(2, slots, values.to(self.values.dtype))
        self.valid.index_fill_(1, slots, True)
        self.cursor.add_(steps)
        self.length = start + steps
        return moved

    def advance(self, steps: int) -> None:
        """Count `steps` tokens that a replayed graph appended on the device (it moved `cursor`, not `length`)."""
        self.length += steps

    def mark(self, real: torch.Tensor) -> None:
        """Record which of the last step's `T` tokens are real (`[B or 1, T]` bool); pads are never attended."""
        steps = real.shape[-1]
        self.valid[:, self.length - steps : self.length] = real

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens; the rest become invalid free slots."""
        self.valid[:, length:] = False
        self.length = min(self.length, length)
        self.cursor.fill_(self.length)

    def select_rows(self, index: torch.Tensor) -> TokenBuffer:
        """A buffer holding rows `index` (`[B']`) of this one (copied)."""
        out = TokenBuffer.__new__(TokenBuffer)
        out.length = self.length
        out.keys, out.values, out.valid = self.keys[index], self.values[index], self.valid[index]
        out.cursor = self.cursor.clone()
        return out

    def _grow(self, capacity: int) -> None:
        n = self.length
        self._place(self.keys[:, :, :n], self.values[:, :, :n], self.valid[:, :n], capacity)

    def _place(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, capacity: int) -> None:
        """New zeroed buffers of `capacity` slots that start with `keys`/`values` `[B, Hkv, G, D]`, `valid` `[B, G]`."""
        batch, heads, held, dim = keys.shape
        new_keys = keys.new_zeros((batch, heads, capacity, dim))
        new_values = values.new_zeros((batch, heads, capacity, values.shape[-1]))
        new_valid = torch.zeros((batch, capacity), dtype=torch.bool, device=keys.device)
        new_keys[:, :, :held] = keys
        new_values[:, :, :held] = values
        new_valid[:, :held] = valid
        self.keys, self.values, self.valid = new_keys, new_values, new_valid
