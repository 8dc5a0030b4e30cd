"""The wrappers `patch_model` sets on a model and its attention modules (design.md §8).

Each is an object set as an instance attribute over one method (`forward`, `generate`,
`prepare_inputs_for_generation`), not a closure: it holds its owner weakly (a closure over the owner's bound method
would keep a dropped model alive) and `copy.deepcopy` binds the copy of a wrapper to the copy of its owner, so a deep
copy of a patched model calls its own methods and `unpatch_model` finds and removes what it carries.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .step_context import attention_step

__all__ = [
    "WRAPPED_NAMES",
    "AttentionForward",
    "CacheUse",
    "Generate",
    "InstanceWrapper",
    "ModelForward",
    "PrepareInputs",
]

WRAPPED_NAMES = ("forward", "generate", "prepare_inputs_for_generation")


class InstanceWrapper:
    """A callable set as an instance attribute over a method of one object (`name`), calling the class's method, or
    the instance attribute that was already there (which `remove` puts back).

    An object rather than a closure, and holding its owner weakly: a closure over the owner's bound method would keep
    a dropped model alive, and a `copy.deepcopy` of the model would keep calling the original through it.
    `__deepcopy__` binds the copy of the wrapper to the copy of its owner (found in the memo).
    """

    name = ""

    def __init__(self, owner: Any, previous: Callable | None):
        self._owner = weakref.ref(owner)
        self._previous = previous

    @classmethod
    def install(cls, owner: Any) -> InstanceWrapper:
        wrapper = cls(owner, vars(owner).get(cls.name))
        setattr(owner, cls.name, wrapper)
        return wrapper

    @property
    def owner(self) -> Any:
        return self._owner()

    @property
    def __wrapped__(self) -> Callable:
        """What the wrapper calls: the owner's own method. `inspect.signature` follows it, so Transformers (which
        inspects `model.forward`'s parameters) sees the real signature."""
        if self._previous is not None:
            return self._previous
        owner = self._owner()
        if owner is None:
            raise ReferenceError(f"the object whose {self.name} this wrapper wraps no longer exists")
        return getattr(type(owner), self.name).__get__(owner, type(owner))

    def remove(self, owner: Any) -> None:
        if vars(owner).get(self.name) is not self:
            return
        if self._previous is not None:
            setattr(owner, self.name, self._previous)
        else:
            delattr(owner, self.name)

    def __deepcopy__(self, memo: dict) -> InstanceWrapper:
        owner = self._owner()
        twin = memo.get(id(owner), owner) if owner is not None else None
        new = object.__new__(type(self))
        new._owner = weakref.ref(twin) if twin is not None else self._owner
        new._previous = copy.deepcopy(self._previous, memo)
        return new


class AttentionForward(InstanceWrapper):
    """An attention module's forward, run inside its step (`attention_step`)."""

    name = "forward"

    def __call__(self, *args, **kwargs):
        with attention_step(self._owner(), kwargs):
            return self.__wrapped__(*args, **kwargs)


class CacheUse(InstanceWrapper):
    """A model call that gets a `ShadowKVCache` runs inside that cache's use scope (`ShadowKVCache.use_scope`):
    one thread at a time, and an exception leaves the cache as it was before the call."""

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        scope = getattr(cache, "use_scope", None)
        if scope is None:
            return self.__wrapped__(*args, **kwargs)
        with scope(self._owner(), prepare=lambda: self.prepare(cache, args, kwargs)):
            return self.__wrapped__(*args, **kwargs)

    def prepare(self, cache: Any, args: tuple, kwargs: dict) -> None:
        """What the outermost call does to the cache before its record is taken (the cache is this thread's)."""


def _ids(args: tuple, kwargs: dict, name: str) -> torch.Tensor | None:
    ids = args[0] if args else kwargs.get(name)
    return ids if isinstance(ids, torch.Tensor) else None


class ModelForward(CacheUse):
    """The model's forward: a call that gets a `ShadowKVCache` runs inside its use scope, through the cache's
    `step_graphs` (which replay a one-token decode step as one CUDA graph where they can, hf/step_graph.py). Its rows
    must be the cache's, and the ids it feeds go on the cache's record (hf/held_ids.py)."""

    name = "forward"

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        scope, graphs = getattr(cache, "use_scope", None), getattr(cache, "step_graphs", None)
        if scope is None or graphs is None:
            return super().__call__(*args, **kwargs)
        owner = self._owner()
        with scope(owner):
            ids = _ids(args, kwargs, "input_ids")
            given = ids if ids is not None else kwargs.get("inputs_embeds")
            if isinstance(given, torch.Tensor) and given.dim() >= 2:
                cache.check_rows(given.shape[0])
            before = cache.get_seq_length()
            out = graphs.run(cache, owner, self.__wrapped__, args, kwargs)
            mask = kwargs.get("attention_mask")
            cache.record_call(ids, before, mask if isinstance(mask, torch.Tensor) else None)
            return out


class Generate(CacheUse):
    """`generate`: the cache is made to hold a prefix of its ids, when they are known (`align_to`, hf/held_ids.py)."""

    name = "generate"

    def prepare(self, cache: Any, args: tuple, kwargs: dict) -> None:
        ids = _ids(args, kwargs, "inputs")
        ids = ids if ids is not None else kwargs.get("input_ids")
        align = getattr(cache, "align_to", None)
        mask = kwargs.get("attention_mask")
        if align is not None and isinstance(ids, torch.Tensor):
            align(ids, mask if isinstance(mask, torch.Tensor) else None)


class PrepareInputs(InstanceWrapper):
    """`generate` passes each step's full ids to `prepare_inputs_for_generation` (the forward only sees the
    uncached ones): a cache that holds a saved prefix checks there, before the first forward, that the ids start
    with it (`check_prefix_ids`)."""

    name = "prepare_inputs_for_generation"

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        input_ids = args[0] if args else kwargs.get("input_ids")
        check = getattr(cache, "check_prefix_ids", None)
        if check is not None and isinstance(input_ids, torch.Tensor):
            check(input_ids, kwargs.get("attention_mask"))
        return self.__wrapped__(*args, **kwargs)
