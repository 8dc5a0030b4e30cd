"""The model's RoPE as the key rebuild needs it: at given positions, in the model's own layout.

Legend: M chunks, c chunk size, D head dim, B batch, Hkv KV heads, S prompt tokens.

How a model's RoPE lays out a head (`RopeLayout`: how many dims rotate, paired as halves or interleaved) is read
from the model itself: the rotary module's `inv_freq` gives the rotated dims, and the pairing is whichever of the
two known forms reproduces the model's own `apply_rotary_pos_emb` on a probe (`ModelRope`). The CUDA key rebuild
computes RoPE from that layout; a RoPE of neither form is rebuilt through the model's own function.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..ops.rebuild_keys import RopeLayout, rope_reference

__all__ = ["ModelRope", "rotary_on"]


class ModelRope:
    """Post-RoPE keys `[M, c, D]` from pre-RoPE keys `[M, c, D]` at positions `[M, c]`, the model's way.

    `inv_freq`, `attention_scaling` and `layout` let the CUDA key rebuild compute the same RoPE in-kernel (Llama-3 /
    YaRN scaling is already folded into the first two; `layout` is None when the model's RoPE is of no form the
    kernel knows). `layer_type` names the table of a rotary module that keeps one per layer type (Gemma 3's
    `Gemma3RotaryEmbedding`); `None` for the usual single table. `ModelRope.none()` is the identity of a layer
    without RoPE.

    A model split over devices (design.md §11) keeps its one rotary module on one of them, behind an accelerate hook
    that moves every input there; a layer elsewhere would then copy its keys over and back at every step. So a layer
    on another device gets a copy of the rotary module whose tables live on its device (made once; the module's own
    forward, called without the hook), and no step crosses devices (`inv_freq_on`).

    >>> rope = patch_model(model).rope  # doctest: +SKIP
    >>> rope.layout  # doctest: +SKIP
    RopeLayout(rotary_dim=8, interleaved=False)
    """

    def __init__(
        self, rotary_emb: nn.Module | None, apply_rotary: Callable | None, layer_type: str | None = None
    ) -> None:
        self.rotary_emb, self.apply_rotary, self.layer_type = rotary_emb, apply_rotary, layer_type
        self._prefix = f"{layer_type}_" if layer_type else ""
        self._copies: dict[torch.device, nn.Module] = {}
        # Probed once here, never inside a decode step (a CUDA graph capture must not synchronise).
        self.layout: RopeLayout | None = RopeLayout(0) if rotary_emb is None else self._probe_layout()

    @classmethod
    def none(cls) -> ModelRope:
        """The RoPE of a layer that applies none: keys pass through unchanged."""
        return cls(None, None)

    @property
    def inv_freq(self) -> torch.Tensor | None:
        """The rotary module's own `[rotary_dim/2]` inverse frequencies (on its device)."""
        return getattr(self.rotary_emb, f"{self._prefix}inv_freq", None)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor | None:
        """`[rotary_dim/2]` float32 inverse frequencies on `device`, for the key-rebuild kernel (no copy per step);
        None without RoPE or when the tables are not in memory (buffers offloaded by accelerate: the rebuild then
        calls the module)."""
        if self.rotary_emb is None:
            return None
        inv_freq = getattr(self._module_on(device), f"{self._prefix}inv_freq", None)
        if inv_freq is None or inv_freq.is_meta:
            return None
        return inv_freq.to(device=device, dtype=torch.float32).contiguous()

    @property
    def attention_scaling(self) -> float:
        return float(getattr(self.rotary_emb, f"{self._prefix}attention_scaling", 1.0))

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.rotary_emb is None:
            return keys
        extra = (self.layer_type,) if self.layer_type else ()
        module = self._module_on(keys.device)
        if module is self.rotary_emb:  # its hook may compute elsewhere when it brings offloaded tables (no-op else)
            cos, sin = (t.to(keys.device) for t in module(keys, positions, *extra))
        else:  # the class's forward: a copy must not run the original's accelerate hook
            cos, sin = type(module).forward(module, keys, positions, *extra)
        # Under partial rotary only the first `2·len(inv_freq)` dims rotate; Phi and StableLM slice the key before
        # their `apply_rotary_pos_emb`, the others inside it, so slicing here serves both. The width comes from the
        # frequencies, not from cos: GPT-OSS's cos holds one entry per pair (`D/2`) for a head that rotates whole.
        inv_freq = self.inv_freq
        width = 2 * inv_freq.numel() if inv_freq is not None and inv_freq.dim() == 1 else cos.shape[-1]
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
                    "ShadowKVCache expected a layer without RoPE, but the model rotated its keys: WITHOUT_ROPE in "
                    "shadowkv_cache/hf/architectures.py disagrees with this modeling code (report it with the "
                    "Transformers version). Use DynamicCache for this model."
                )
            return keys
        if recorded is None or recorded.shape[-1] >= keys.shape[-1]:
            return recorded
        return torch.cat((recorded, keys[..., recorded.shape[-1] :]), dim=-1)

    def _probe_layout(self) -> RopeLayout | None:
        """The layout (rotated dims, pairing) under which `rope_reference` reproduces the model's RoPE, or None."""
        inv_freq = self.inv_freq
        if inv_freq is None or inv_freq.dim() != 1 or inv_freq.is_meta:  # meta: tables offloaded by accelerate
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

    def _module_on(self, device: torch.device) -> nn.Module:
        """The rotary module if its tables are on `device` (or not in memory: an offloading hook brings them), else
        its copy on `device`."""
        tables = list(self.rotary_emb.buffers())
        if all(t.device == device or t.is_meta for t in tables):
            return self.rotary_emb
        if device not in self._copies:
            self._copies[device] = rotary_on(self.rotary_emb, device)
        return self._copies[device]


def rotary_on(rotary_emb: nn.Module, device: torch.device) -> nn.Module:
    """A copy of `rotary_emb` with its tables (buffers) on `device`; it shares the config and the scalars. Call it
    through its class's `forward`: the copy carries the original's accelerate hook, which would move inputs back."""
    clone = copy.copy(rotary_emb)
    clone._buffers = {name: None if t is None else t.to(device) for name, t in rotary_emb._buffers.items()}
    return clone
