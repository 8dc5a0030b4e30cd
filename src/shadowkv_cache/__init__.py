"""shadowkv_cache: ShadowKV as a drop-in `transformers.Cache` for long-context generation.

The public names below are imported on first use (PEP 562), so that importing a part of the package (a kernel op,
a store, the quantiser) does not import Transformers or the rest of the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .version import __version__

if TYPE_CHECKING:
    from .config import ShadowKVConfig
    from .hf.adapters import patch_model, unpatch_model
    from .hf.architectures import SUPPORTED_ARCHITECTURES
    from .hf.cache import ShadowKVCache
    from .hf.state import CacheInUseError, CacheStateError
    from .memory_report import MemoryReport
    from .placement import PlacementError
    from .policies import LandmarkTopK, SelectionPolicy
    from .prefix import PrefixCacheError

# public name -> the module that defines it
_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": ".hf.architectures",
    "CacheInUseError": ".hf.state",
    "CacheStateError": ".hf.state",
    "LandmarkTopK": ".policies",
    "MemoryReport": ".memory_report",
    "PlacementError": ".placement",
    "PrefixCacheError": ".prefix",
    "SelectionPolicy": ".policies",
    "ShadowKVCache": ".hf.cache",
    "ShadowKVConfig": ".config",
    "patch_model": ".hf.adapters",
    "unpatch_model": ".hf.adapters",
}

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CacheInUseError",
    "CacheStateError",
    "LandmarkTopK",
    "MemoryReport",
    "PlacementError",
    "PrefixCacheError",
    "SelectionPolicy",
    "ShadowKVCache",
    "ShadowKVConfig",
    "__version__",
    "patch_model",
    "unpatch_model",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shadowkv_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
