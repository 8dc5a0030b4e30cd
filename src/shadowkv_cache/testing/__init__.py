"""Supported helpers for benchmarks and tests: synthetic compressed caches, a hit rate set by construction, one
prefill continued with other policies and budgets, and a generated document with planted facts.

Nothing here is needed to use the cache; it exists so that benchmarks and tests build their caches through one
supported interface instead of the package's internals. Imported on first use, like the package root.

- `synthetic_cache(model, batch, context, ...)`: a `ShadowKVCache` filled with random compressed prompts
  (ShadowKV mode in any value format, or YAKV mode) at a context length, without a prefill; `layer_sizes` gives
  what one layer holds per row; `pinned_blocks`, `pinned_bytes`, `release_pinned`, `pinned_huge_pages` manage the
  pinned host memory such caches (and prefills) draw from.
- `ControlledHitRate(h, inner)`: a policy whose steps keep a share `h` of the previous step's chunks or tokens;
  `reset_hit_counts(cache)` zeroes the counters behind `memory_report().hit_rate`.
- `continue_with_policy(base, model, policy, sparse_budget)`: a cache that continues a prefilled one with another
  policy and budget, sharing its compressed prompt.
- `selection_figures(cache)`: what a cache's compressed layers select and move, for byte counts.
- `FACTS`, `build_document`, `prompt_ids`: the demo's staff handbook (`handbook.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .figures import SelectionFigures, selection_figures
    from .handbook import FACTS, build_document, prompt_ids
    from .hit_rate import ControlledHitRate, reset_hit_counts
    from .retarget import continue_with_policy
    from .synthetic import (
        LayerSizes,
        layer_sizes,
        pinned_blocks,
        pinned_bytes,
        pinned_huge_pages,
        release_pinned,
        synthetic_cache,
    )

_EXPORTS = {
    "SelectionFigures": ".figures",
    "selection_figures": ".figures",
    "FACTS": ".handbook",
    "build_document": ".handbook",
    "prompt_ids": ".handbook",
    "ControlledHitRate": ".hit_rate",
    "reset_hit_counts": ".hit_rate",
    "continue_with_policy": ".retarget",
    "LayerSizes": ".synthetic",
    "layer_sizes": ".synthetic",
    "pinned_blocks": ".synthetic",
    "pinned_bytes": ".synthetic",
    "pinned_huge_pages": ".synthetic",
    "release_pinned": ".synthetic",
    "synthetic_cache": ".synthetic",
}

__all__ = [
    "FACTS",
    "ControlledHitRate",
    "LayerSizes",
    "SelectionFigures",
    "build_document",
    "continue_with_policy",
    "layer_sizes",
    "pinned_blocks",
    "pinned_bytes",
    "pinned_huge_pages",
    "prompt_ids",
    "release_pinned",
    "reset_hit_counts",
    "selection_figures",
    "synthetic_cache",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shadowkv_cache.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
