"""The model's RoPE as the key rebuild needs it: at given positions, in the model's own layout.

Legend: M chunks, c chunk size, D head dim, B batch, Hkv KV heads, S prompt tokens.

How a model's RoPE lays out a head (`RopeLayout`: how many dims rotate, paired as halves or interleaved) is read
from the model itself: the rotary module's `inv_freq` gives the rotated dims, and the pairing is whichever of the
two known forms reproduces the model's own `apply_rotary_pos_emb` on a probe (`ModelRope`). The CUDA key rebuild
computes RoPE from that layout; a RoPE of neither form is rebuilt through the model's own function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops.rebuild_keys import RopeLayout, rope_reference

__all__ = ["ModelRope"]


class ModelRope:
    """Post-RoPE keys `[M, c, D]` from pre-RoPE keys `[M, c, D]` at positions `[M, c]`, the model's way.

    `inv_freq`, `attention_scaling` and `layout` let the CUDA key rebuild compute the same RoPE in-kernel (Llama-3 /
    YaRN scaling is already folded into the first two; `layout` is None when the model's RoPE is of no form the
    kernel knows). `layer_type` names the table of a rotary module that keeps one per layer type (Gemma 3's
    `Gemma3RotaryEmbedding`); `None` for the usual single table. `ModelRope.none()` is the identity of a layer
    without RoPE.

    >>> rope = patch_model(model).rope  # doctest: +SKIP
    >>> rope.layout  # doctest: +SKIP
    RopeLayout(rotary_dim=8, interleaved=False)
    """

    def __init__(
        self, rotary_emb: nn.Module | None, apply_rotary: Callable | None, layer_type: str | None = None
    ) -> None:
        self.rotary_emb, self.apply_rotary, self.layer_type = rotary_emb, apply_rotary, layer_type
        self._prefix = f"{layer_type}_" if layer_type else ""
        # Probed once here, never inside a decode step (a CUDA graph capture must not synchronise).
        self.layout: RopeLayout | None = RopeLayout(0) if rotary_emb is None else self._probe_layout()

    @classmethod
    def none(cls) -> ModelRope:
        """The RoPE of a layer that applies none: keys pass through unchanged."""
        return cls(None, None)

    @property
    def inv_freq(self) -> torch.Tensor | None:
        return getattr(self.rotary_emb, f"{self._prefix}inv_freq", None)

    @property
    def attention_scaling(self) -> float:
        return float(getattr(self.rotary_emb, f"{self._prefix}attention_scaling", 1.0))

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rotary_emb is None:
            return keys
        extra = (self.layer_type,) if self.layer_type else ()
        cos, sin = self.rotary_emb(keys, positions, *extra)
        # cos/sin span the rotated dims only under partial rotary; Phi and StableLM slice the key before their
        # `apply_rotary_pos_emb`, the others inside it, so slicing here serves both.
        width = cos.shape[-1]
        rotary, rest = keys[..., :width], keys[..., width:]
        _, rotated = self.apply_rotary(rotary[:, None], rotary[:, None], cos, sin)
        return torch.cat((rotated[:, 0], rest), dim=-1) if rest.shape[-1] else rotated[:, 0]

    def pre_rope_keys(self, recorded: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor | None:
        """The full pre-RoPE keys `[B, Hkv, S, D]` of a prefill, from what the rotary wrapper recorded and the
        post-RoPE `keys`; None when the model should have rotated keys and the wrapper saw none.

        A layer without RoPE has its keys as they are. A recorded key narrower than `keys` is the rotary part that
        Phi and StableLM hand RoPE; the other dims pass through RoPE unchanged, so they are taken from `keys`.
        """
        if self.rotary_emb is None:
            if recorded is not None:
                raise RuntimeError(
                    "ShadowKVCache expected a layer without RoPE, but the model rotated its keys: the adapter's rule "
                    "for this architecture does not match its modeling code (report it with the Transformers version)."
                )
            return keys
        if recorded is None or recorded.shape[-1] >= keys.shape[-1]:
            return recorded
        return torch.cat((recorded, keys[..., recorded.shape[-1] :]), dim=-1)

    def _probe_layout(self) -> RopeLayout | None:
        """The layout (rotated dims, pairing) under which `rope_reference` reproduces the model's RoPE, or None."""
        inv_freq = self.inv_freq
        if inv_freq is None or inv_freq.dim() != 1:
            return None
        device = inv_freq.device
        rotary_dim = 2 * inv_freq.numel()
        # A few positions well inside any model's range (a dynamic RoPE must not rescale), angles past 2π for the
        # fastest pair, and two pass-through dims past the rotated ones to see that they are left alone.
        gen = torch.Generator().manual_seed(0)
        keys = torch.randn(1, 16, rotary_dim + 2, generator=gen).to(device)
        positions = torch.arange(1, 17, device=device)[None] * 3
        with torch.no_grad():
            expected = self(keys, positions).float()
            for interleaved in (False, True):
                layout = RopeLayout(rotary_dim, interleaved)
                got = rope_reference(keys, positions, inv_freq, self.attention_scaling, layout).float()
                if torch.allclose(got, expected, rtol=1e-3, atol=1e-3):  # a wrong pairing is off by O(1)
                    return layout
        return None
