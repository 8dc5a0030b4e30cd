"""shadowkv_cache: ShadowKV as a drop-in `transformers.Cache` for long-context generation."""

from .adapters import SUPPORTED_ARCHITECTURES, patch_model, unpatch_model
from .cache import ShadowKVCache
from .config import ShadowKVConfig
from .memory_report import MemoryReport
from .policies import LandmarkTopK, SelectionPolicy
from .prefix import PrefixCacheError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "LandmarkTopK",
    "MemoryReport",
    "PrefixCacheError",
    "SelectionPolicy",
    "ShadowKVCache",
    "ShadowKVConfig",
    "patch_model",
    "unpatch_model",
]

__version__ = "0.1.0"
