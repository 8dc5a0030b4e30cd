"""`LayerMode`: what a compressed layer (`hf/layer.py`) asks of its mode, `ShadowKVMode` or `YakvMode`.

A mode keeps what it makes of the prompt (`prompt`) and runs a step's selection and attention over it; the layer owns
the life cycle around it. `make_prompt` only computes (it may run on a worker thread beside the forward,
`hf/background.py`); `set_prompt` is where the mode takes the prompt.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import ShadowKVConfig
from ..core.attention import NO_TERMS, LogitTerms, Part

__all__ = ["LayerMode"]


class LayerMode(Protocol):
    """What a compressed layer asks of its mode (`ShadowKVMode`, `YakvMode`)."""

    name: str
    graph_safe: bool  # its one-token step never synchronises with the host, so it may be captured
    config: ShadowKVConfig
    prompt: object | None  # the compressed prompt (`CompressedPrompt`, `QuantizedPrompt`), None while exact

    def empty_like(self) -> LayerMode: ...
    def make_prompt(self, keys_pre, keys, values, positions, real, recent_queries, scaling, rank_queries): ...
    def set_prompt(self, prompt) -> None: ...
    def drop_decode_state(self) -> None: ...
    def select_rows(self, index: torch.Tensor) -> None: ...
    def graph_key(self) -> tuple: ...
    def attend(self, query, scaling, query_mask, new_tokens: Part, terms: LogitTerms = NO_TERMS) -> torch.Tensor: ...
    def hit_counts(self) -> tuple[int, int] | None: ...
    def reset_hit_counts(self) -> None: ...
    def sizes(self) -> tuple[int | None, int]: ...
    def nbytes(self) -> tuple[int, int]: ...
