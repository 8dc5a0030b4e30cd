"""What keeps a cache's state sound between calls (docs/reliability.md): one user at a time, a failed call undone,
and a clear error instead of a silently wrong step.

- `UseGuard`: a cache holds one conversation, so two threads that use one cache at once would interleave their
  tokens in it. The first thread to enter a call owns the cache until its outermost call returns (a `generate` and
  the forwards inside it); another thread is refused with `CacheInUseError`.
- `UseScope`: the patched model's `forward` and `generate` run each call that gets a `ShadowKVCache` inside this
  scope. The outermost scope of a thread records what each layer holds (references: updates replace tensors, or
  append to a token buffer in place, which a crop undoes); if the call raises, every layer goes back to that
  record, so a failed first fill leaves an empty cache and a failed `generate` the cache it started with. If putting
  a layer back fails too, the cache is marked broken and every later use raises, naming `reset()`. Every scope
  ends the compressions its call left running beside the forward (`hf/background.py`); one that failed fails the
  call.
- `CacheState`: what one cache keeps for this (its model, that model's attention modules, the guard, why it is
  broken) and the checks that every `update` passes: the step runs in the "shadowkv" attention of the cache's own
  model, on the thread that uses the cache. Otherwise attention would not read what the cache holds.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .background import drain, finish_compression
from .step_context import ATTENTION_NAME, current_step

if TYPE_CHECKING:
    import torch

__all__ = ["CacheInUseError", "CacheState", "CacheStateError", "CheckedUpdates", "UseGuard", "UseScope"]

_OUTSIDE = (
    "ShadowKVCache layer {layer} was updated outside the patched attention of the model the cache was made for: that "
    "model was unpatched (unpatch_model), or the cache was passed to another model. Attention would not read the "
    "compressed prompt, only the tokens after it. Call shadowkv_cache.patch_model(model) (or make any "
    "ShadowKVCache(model)) to route the model through the cache again (this cache is unchanged), or use DynamicCache."
)
_NOT_ROUTED = (
    "The model's attention implementation is {implementation!r}, not 'shadowkv' (set_attn_implementation was called?): "
    "attention would not read this cache's compressed prompt, only the tokens after it. Call "
    "shadowkv_cache.patch_model(model) (or make any ShadowKVCache(model)) to route it through the cache again (this "
    "cache is unchanged), or use DynamicCache with that implementation."
)
_OTHER_MODEL = (
    "This ShadowKVCache was made for another model: a cache is bound to the model given to ShadowKVCache(model), whose "
    "keys and values it holds (a copy.deepcopy of that model is another model). Make a cache for this model."
)


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

    def __enter__(self) -> UseGuard:
        self.enter()
        return self

    def __exit__(self, *exc) -> bool:
        self.exit()
        return False


class CacheState:
    """One cache's soundness between calls.

    Args:
        model (`nn.Module`): the model the cache is bound to (held weakly).
        attention (`dict[int, weakref.ref]`): that model's attention modules by layer index (the adapter's).
    """

    def __init__(self, model: Any, attention: dict[int, weakref.ref]):
        self.model = weakref.ref(model)
        self.attention = dict(attention)
        self.guard = UseGuard()
        self.broken: str | None = None  # why the cache cannot be used until reset(), after a failed roll-back

    def forked(self) -> CacheState:
        """The state of a cache forked from this one: the same model, its own user."""
        self.check_not_broken()
        forked = copy.copy(self)
        forked.guard = UseGuard()
        return forked

    def check_not_broken(self) -> None:
        if self.broken is not None:
            raise CacheStateError(f"{self.broken} Call cache.reset() to empty it (or make a new cache).")

    @contextmanager
    def using(self) -> Iterator[None]:
        """Hold the cache for this thread (not broken) while something reads all of it, e.g. `save_prefix`."""
        self.check_not_broken()
        with self.guard:
            yield

    def check_usable(self, model: Any) -> None:
        """Raise `CacheStateError` (naming the fix) unless `model` may run a call on the cache now."""
        self.check_not_broken()
        if self.model() is not model:
            raise CacheStateError(_OTHER_MODEL)
        implementation = model.config._attn_implementation
        if implementation != ATTENTION_NAME:
            raise CacheStateError(_NOT_ROUTED.format(implementation=implementation))

    def check_step(self, cache: Any, layer_idx: int) -> None:
        """Raise `CacheStateError` unless the attention step running now is layer `layer_idx` of the cache's own model,
        routed through "shadowkv", on the thread that uses `cache`."""
        self.check_not_broken()
        step = current_step()
        if step is None or step.cache is not cache or step.module is None:
            raise CacheStateError(_OUTSIDE.format(layer=layer_idx))
        expected = self.attention.get(layer_idx)
        if expected is None or step.module is not expected():
            raise CacheStateError(_OTHER_MODEL)
        implementation = step.module.config._attn_implementation
        if implementation != ATTENTION_NAME:
            raise CacheStateError(_NOT_ROUTED.format(implementation=implementation))
        if self.guard.held_elsewhere():
            self.guard.enter()  # raises CacheInUseError, naming the fix

    @staticmethod
    def checkpoint(cache: Any) -> tuple:
        """What each layer of `cache` holds now (and the cache's own record of its prefix), to go back to."""
        layers = list(cache.layers)
        states = [layer.checkpoint() for layer in layers]
        return layers, states, cache._prefix_ids, cache._prefix_checked, cache._prefilled, cache._held.checkpoint()

    def roll_back(self, cache: Any, saved: tuple, error: BaseException | None, *, ran_on_device: bool = True) -> None:
        """Put `cache` back to `saved` after a failed call; if that fails too, mark it broken until `reset()`.
        `ran_on_device=False` (a failed CUDA-graph capture: kernels were recorded, none ran) keeps each layer's decode
        state, which only the host side of the call touched."""
        layers, states, cache._prefix_ids, cache._prefix_checked, cache._prefilled, held = saved
        cache._held.restore(held)
        cache.step_graphs.reset()  # its graph was captured on layer state that is gone now
        try:
            cache.layers = layers
            for layer, state in zip(layers, states):
                layer.restore(state, ran_on_device=ran_on_device)
        except Exception as err:  # noqa: BLE001 - the call's own error goes on; this one is recorded
            self.broken = (
                f"A call on this ShadowKVCache failed ({type(error).__name__}: {error}) and its state could not be put "
                f"back ({type(err).__name__}: {err}), so its layers may hold different tokens."
            )


class UseScope:
    """One call of `model` (its `forward` or `generate`) on `cache`; see the module docstring."""

    def __init__(self, cache: Any, model: Any, prepare: Callable[[], None] | None = None):
        self.cache, self.model, self.state = cache, model, cache._state
        self.prepare = prepare  # run by the outermost scope before its record: what it changes, a failure keeps
        self.outer = False
        self.saved: Any = None

    def __enter__(self) -> UseScope:
        self.state.check_usable(self.model)  # before anything is taken or changed
        self.outer = self.state.guard.enter()
        if self.outer:
            try:
                if self.prepare is not None:
                    self.prepare()
                self.saved = self.state.checkpoint(self.cache)
            except BaseException:
                self.state.guard.exit()
                raise
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        try:
            if kind is None:
                try:  # the call's compressions beside the forward end with it (hf/background.py)
                    finish_compression(self.cache.layers)
                except BaseException as err:
                    if self.outer:
                        self.state.roll_back(self.cache, self.saved, err)
                    raise
            else:
                drain()  # none of the call's compressions runs past it (a later graph capture must see no other work)
                if self.outer:
                    self.state.roll_back(self.cache, self.saved, error)
        finally:
            self.saved = None
            self.state.guard.exit()
        return False  # the error goes on


class CheckedUpdates:
    """What `ShadowKVCache` takes from this module, as a base placed before `transformers.Cache`: every `update` passes
    `CacheState.check_step` first, and the patched model's `forward` and `generate` run each call in `use_scope`. The
    cache sets `self._state` (a `CacheState`)."""

    _state: CacheState

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`Cache.update` with `[B, Hkv, T, D]` keys and values of layer `layer_idx`, once the step is known to run in
        the "shadowkv" attention of the cache's own model, on the thread that uses the cache: otherwise the keys would
        be stored where attention never reads them. Returns the layer's keys and values, as `Cache.update` does."""
        self._state.check_step(self, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def use_scope(self, model: Any, prepare: Callable[[], None] | None = None) -> UseScope:
        """Where the patched `model`'s `forward` and `generate` run a call on this cache: one thread at a time, and a
        call that raises leaves the cache as it was after `prepare` (run first, once the cache is this thread's)."""
        return UseScope(self, model, prepare)
