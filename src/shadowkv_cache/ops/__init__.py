"""Hot-path operations. Each has a PyTorch twin that defines its meaning (the CPU path)."""

from .rebuild_keys import rebuild_keys

__all__ = ["rebuild_keys"]
