"""What the package tells its user: notices go to the logger ``"shadowkv_cache"``, each at most once per cache.

Nothing here configures logging. Python shows WARNING and above on stderr when the application has set up no
handler; ``logging.getLogger("shadowkv_cache").setLevel(logging.ERROR)`` silences the notices.
"""

from __future__ import annotations

import logging

__all__ = ["Notices", "logger"]

logger = logging.getLogger("shadowkv_cache")


class Notices:
    """The notices one cache has given; each key is logged the first time only."""

    def __init__(self) -> None:
        self._given: set[str] = set()

    def once(self, key: str, level: int, message: str, *args) -> None:
        """Log `message % args` at `level` unless this cache already gave the notice `key`."""
        if key in self._given:
            return
        self._given.add(key)
        logger.log(level, message, *args)
