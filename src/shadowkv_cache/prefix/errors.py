"""The one error every prefix-file or prefix-use failure raises."""

from __future__ import annotations

__all__ = ["PrefixCacheError"]


class PrefixCacheError(ValueError):
    """A prefix file or a prefix use that does not fit: another model, config, version, or a damaged file."""
