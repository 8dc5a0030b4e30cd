"""Where the package keeps files between runs: one user cache directory for compiled kernels, quantiser grids and
converted model folders."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$SHADOWKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/shadowkv_cache``, else ``~/.cache/shadowkv_cache``
    (``~`` expanded in each). Nothing is created here."""
    if os.environ.get("SHADOWKV_CACHE_DIR"):
        return Path(os.environ["SHADOWKV_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "shadowkv_cache"
