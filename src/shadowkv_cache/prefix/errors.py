"""The one error every prefix-file or prefix-use failure raises."""

from __future__ import annotations

__all__ = ["PrefixCacheError", "PrefixOptionError"]


class PrefixCacheError(ValueError):
    """A prefix file or a prefix use that does not fit: another model, config, version, or a damaged file."""


class PrefixOptionError(PrefixCacheError, TypeError):
    """An unknown option or an argument of the wrong type given to a prefix load; also a `TypeError`, as Python
    raises for a bad keyword argument."""
