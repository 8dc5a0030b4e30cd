"""Reading one safetensors file even while a writer replaces it.

A load must not mix one file's header with another file's tensors when a writer replaces the file meanwhile (an
atomic rename). `safe_open` reads the header from the file it opens, but for PyTorch its tensors map the file again
*by path* (`UntypedStorage.from_file`), so one `safe_open` is not enough. The reader holds the file it started with
open; where the system names open files (`/proc/self/fd/N` on Linux) both opens go through that name, so they see the
held file whatever happens to the path. Elsewhere it checks, after reading, that the path still names the held file
(an inode held open cannot be reused, and a replaced file never comes back under the path) and otherwise reads again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from safetensors import safe_open

from .errors import PrefixCacheError

__all__ = ["read_one_file"]

READ_ATTEMPTS = 8
T = TypeVar("T")


def read_one_file(path: Path, read: Callable[..., T]) -> T:
    """`read(f)` on the safetensors file at `path` opened with `safe_open` (CPU, PyTorch), such that everything `read`
    gets comes from one file; `read` must copy what it keeps. Raises `PrefixCacheError` for a missing or unreadable
    file, or one replaced on every attempt."""
    for _ in range(READ_ATTEMPTS):
        if not path.is_file():
            raise PrefixCacheError(f"No prefix file at {path}.")
        with open(path, "rb") as held:
            source = open_file_name(held) or path
            try:
                opened = safe_open(source, framework="pt", device="cpu")
            except Exception as err:  # the library's errors for truncated or malformed files vary by version
                if _replaced(held, path, source):
                    continue
                raise PrefixCacheError(
                    f"{path} is not a readable safetensors file (truncated or damaged?): {err}"
                ) from err
            try:
                with opened as f:
                    result = read(f)
            except PrefixCacheError:
                if _replaced(held, path, source):
                    continue
                raise
            if not _replaced(held, path, source):
                return result
    raise PrefixCacheError(
        f"{path} was replaced {READ_ATTEMPTS} times while being read; another process keeps rewriting it. Load it "
        "when the writer has finished, or give each writer its own file."
    )


def open_file_name(held) -> Path | None:
    """A name that opens the very file `held` is (Linux's `/proc/self/fd/N`), or None where the system has none."""
    name = Path(f"/proc/self/fd/{held.fileno()}")
    return name if name.exists() else None


def _replaced(held, path: Path, source: Path) -> bool:
    """Whether a read through `source` may have seen another file than `held`: `source` is the path and it no longer
    names the held file (a writer renamed another file over it). A read through the held file's own name cannot."""
    if source != path:
        return False
    try:
        now = path.stat()
    except FileNotFoundError:
        return True
    then = os.fstat(held.fileno())
    return (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)
