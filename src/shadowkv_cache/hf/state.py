"""What keeps a cache's state sound between calls (docs/reliability.md): one user at a time, a failed call undone,
and a clear error instead of a silently wrong step.

- `UseGuard`: a cache holds one conversation, so two threads that use one cache at once would interleave their
  tokens in it. The first thread to enter a call owns the cache until its outermost call returns (a `generate` and
  the forwards inside it); another thread is refused with `CacheInUseError`.
- `UseScope`: the patched model's `forward` and `generate` run each call that gets a `ShadowKVCache` inside this
  scope. The outermost scope of a thread records what each layer holds (references: updates replace tensors, or
  append to a token buffer in place, which a crop undoes); if the call raises after the cache changed, every layer
  goes back to that record, so a failed first fill leaves an empty cache and a failed `generate` the cache it
  started with. If putting a layer back fails too, the cache is marked broken and every later use raises, naming
  `reset()`.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["CacheInUseError", "CacheStateError", "UseGuard", "UseScope"]


class CacheStateError(RuntimeError):
    """A cache used in a way that would give wrong tokens: its model no longer routes attention through it, another
    model calls it, or a failed call left it in a state that could not be undone."""


class CacheInUseError(CacheStateError):
    """A cache used from a second thread while a call of another thread is running on it."""


class UseGuard:
    """Which thread uses a cache now, and how deep its calls nest (a `generate` holds forwards)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None
        self.depth = 0

    def enter(self) -> bool:
        """Take the cache for this thread (again, if it holds it); True for the outermost entry."""
        me = threading.get_ident()
        with self._lock:
            if self.owner is not None and self.owner != me:
                raise CacheInUseError(
                    "This ShadowKVCache is in use by a call on another thread; a cache holds one conversation, so two "
                    "concurrent calls would mix their tokens. Give each concurrent request its own cache (for one "
                    "shared document: one cache.fork() per request), or wait for the other call to return."
                )
            self.owner = me
            self.depth += 1
            return self.depth == 1

    def exit(self) -> None:
        with self._lock:
            self.depth -= 1
            if self.depth == 0:
                self.owner = None

    def held_elsewhere(self) -> bool:
        owner = self.owner
        return owner is not None and owner != threading.get_ident()


class UseScope:
    """One call of `model` (its `forward` or `generate`) on `cache`; see the module docstring."""

    def __init__(self, cache: Any, model: Any):
        self.cache, self.model = cache, model
        self.outer = False
        self.saved: Any = None

    def __enter__(self) -> UseScope:
        self.cache.check_usable(self.model)  # before anything is taken or changed
        self.outer = self.cache._guard.enter()
        if self.outer:
            try:
                self.saved = self.cache._checkpoint()
            except BaseException:
                self.cache._guard.exit()
                raise
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        try:
            if kind is not None and self.outer:
                self.cache._roll_back(self.saved, error)
        finally:
            self.saved = None
            self.cache._guard.exit()
        return False  # the error goes on
