"""The whole one-token decode step of a model, captured as one CUDA graph and replayed (design.md §3).

Legend: B batch, T query tokens (1 here), V vocab.

Each compressed layer already replays its own attention step as a graph (`decode_graph.py`), but the model's own
work around it (embedding, norms, projections, MLPs, RoPE, the LM head: ~10 launches per layer) still launches
eagerly: ~30 ms of host time per step for a 32-layer model, which is the whole step at small batches, and which
`generate` cannot hide because it waits for each step's tokens. When every layer of the cache is compressed and its
step is graph-safe, the patched model's `forward` (hf/wrappers.py) hands a one-token call to `StepGraphs`, which
captures the model's forward once and replays it: one launch per step.

What makes a replay the same as the eager step:
- Inputs are copied into the graph's own tensors: the token ids, and the positions (computed on the host from the
  cache's length when the caller gives none, as the model would).
- The attention mask is not an input. A compressed layer's one-token step ignores it (padding is recorded in the
  prompt's and the token buffer's validity), so the eager step computes the same thing with or without it; the
  model's mask code then builds nothing.
- The token buffer appends at a position held on the device (`TokenBuffer.cursor`); after a replay each layer counts
  the appended token on the host (`CompressedLayer.replayed_step`).
- Anything that moves a tensor the step reads (rows reordered, a prompt replaced, the token buffer grown) changes the
  graph's key. A step with a new key runs eagerly, and the next step with the same key captures: a key that changes
  at every step (beam search) never pays for a capture.
- The logits are cloned out of the graph's output, so outputs of earlier calls stay valid.

A capture that fails puts every layer back as it was before the capture, logs one warning, and leaves that cache to
its per-layer graphs. Models whose forward synchronises with the host at every step are not tried (`capturable_model`).
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable, Hashable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ..notices import logger
from .decode_graph import GraphSwitch, capture_stream, collector_paused
from .fused_pieces import FusedPieces
from .state import CacheState

__all__ = ["StepGraph", "StepGraphs", "capturable_model"]

# Inputs the graph copies in. Others must be absent, None, False or plain values (part of the key).
_TENSOR_INPUTS = ("input_ids", "position_ids", "cache_position")
_CACHE_NAMES = ("cache", "past_key_values")
_IGNORED = ("attention_mask",)  # see the module docstring


class StepGraph:
    """One capture of `forward(**inputs)`, replayed with new values of the same shapes.

    Args:
        forward (`Callable`): the model's forward (unwrapped), called once inside the capture.
        inputs (`dict`): its keyword arguments; tensors among `_TENSOR_INPUTS` become the graph's inputs.
        key (`Hashable`): what the capture depends on (compared before each replay).
    """

    def __init__(self, forward: Callable, inputs: dict[str, Any], key: Hashable):
        self.key = key
        device = inputs["input_ids"].device
        self.device = device
        self.inputs = {name: value.clone() if name in _TENSOR_INPUTS else value for name, value in inputs.items()}
        # The objects the key names by id and address stay alive with the graph, so no new object can take their
        # ids or memory while it may be replayed.
        cache = next(inputs[name] for name in _CACHE_NAMES if name in inputs)
        self._holds = [(dict(vars(layer.mode)), dict(vars(layer.new))) for layer in cache.layers]
        self.graph = torch.cuda.CUDAGraph()
        index = device.index if device.index is not None else torch.cuda.current_device()
        # Graphs of dropped caches are destroyed now rather than by a collection inside the capture.
        gc.collect()
        # Its own pool: the per-layer graphs of this cache are dropped once this one exists.
        with (
            collector_paused(),
            torch.cuda.device(index),
            torch.cuda.graph(
                self.graph,
                pool=torch.cuda.graph_pool_handle(),
                stream=capture_stream(index),
                capture_error_mode="thread_local",
            ),
        ):
            output = forward(**self.inputs)
        # Neither the inputs nor the output keep the cache: the cache holds this graph, and a reference back would
        # leave a dropped cache (its GPU and pinned memory) to Python's cyclic collector.
        self.inputs = {name: value for name, value in self.inputs.items() if name in _TENSOR_INPUTS}
        self.output, self._cache_at = _without(output, cache)

    def __call__(self, inputs: Mapping[str, Any]) -> Any:
        """Replay with `inputs` (same shapes as captured); returns the model's output with its tensors cloned."""
        for name, tensor in self.inputs.items():
            tensor.copy_(inputs[name])
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.output_with(next(inputs[name] for name in _CACHE_NAMES if name in inputs))

    def output_with(self, cache: Any) -> Any:
        """The output of the last replay (tensors cloned), holding `cache` where the model's output did."""
        output = _cloned(self.output)
        if self._cache_at is None:
            return output
        if isinstance(output, tuple):
            return (*output[: self._cache_at], cache, *output[self._cache_at + 1 :])
        output[self._cache_at] = cache
        return output


class StepGraphs:
    """One cache's whole-step graph: decides for each forward call whether it runs eagerly, captures, or replays.

    Args:
        graphs (`GraphSwitch`): the cache's switch, shared with its layers.
        state (`CacheState`): the cache's state, which puts its layers back after a failed capture.
        pieces (`FusedPieces`, *optional*): the model's pieces compiled for one-token steps (`fused`); None for none.
    """

    def __init__(self, graphs: GraphSwitch, state: CacheState, pieces: FusedPieces | None = None):
        self.graphs, self.state, self.pieces = graphs, state, pieces
        self.graph: StepGraph | None = None
        self._last_key: Hashable | None = None  # the key of the last eager eligible step
        self.replays = 0  # steps replayed since this cache was made (benchmarks and tests read it)
        self.enabled = True  # False keeps each layer's own graph only (benchmarks/profile_decode.py compares them)

    def reset(self) -> None:
        self.graph, self._last_key = None, None

    def run(self, cache: Any, model: Any, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """`forward(*args, **kwargs)` on `cache`, through the whole-step graph where the call allows it."""
        inputs = _step_inputs(cache, model, forward, args, kwargs) if self.enabled else None
        key = None if inputs is None else _step_key(cache, inputs)
        if key is not None and self.graph is not None and self.graph.key == key:
            return self._replay(cache, inputs)
        with self.fused(cache, model, args, kwargs):
            if key is None:  # layers may capture their own steps here, so the next capture follows an eager step again
                if inputs is not None:  # a one-token step the layers cannot serve now (buffer full, state dropped)
                    self.graph = None
                self._last_key = None
                self.graphs.set_per_layer(True)
                return forward(*args, **kwargs)
            self.graph = None
            self.graphs.set_per_layer(False)  # per-layer captures would be replaced at the next step
            if key != self._last_key:  # a new key: run eagerly once (it compiles the fused pieces, if any)
                self._last_key = key
                return forward(*args, **kwargs)
            return self._capture(cache, forward, inputs, key, lambda: forward(*args, **kwargs))

    def fused(self, cache: Any, model: Any, args: tuple, kwargs: dict) -> AbstractContextManager:
        """The context a forward call runs in: the model's pieces compiled (fused_pieces.py) for a one-token decode
        step after a compressed prompt on one GPU, with autograd off; nothing otherwise (prefill, multi-token steps,
        the CPU, a model placed on several devices or whose forward waits for the host)."""
        ids = kwargs.get("input_ids")
        if (
            self.pieces is None
            or args
            or not isinstance(ids, torch.Tensor)
            or not ids.is_cuda
            or ids.dim() != 2
            or ids.shape[1] != 1
            or torch.is_grad_enabled()
            or getattr(model, "training", False)
            or not any(getattr(layer, "is_compressed", False) for layer in cache.layers)
            or not _on_one_device(model)
        ):
            return nullcontext()
        return self.pieces.active(model)

    def _replay(self, cache: Any, inputs: dict[str, Any]) -> Any:
        output = self.graph(inputs)
        for layer in cache.layers:
            layer.replayed_step(inputs["input_ids"].shape[1])
        self.replays += 1
        return output

    def _capture(
        self, cache: Any, forward: Callable, inputs: dict[str, Any], key: Hashable, eager: Callable[[], Any]
    ) -> Any:
        saved = self.state.checkpoint(cache)
        try:
            graph = StepGraph(forward, inputs, key)
        except RuntimeError as err:
            self.state.roll_back(cache, saved, err, ran_on_device=False)
            # The model's own code may be what cannot be captured: each layer's step still may be.
            self.enabled = False
            self.graphs.set_per_layer(True)
            logger.warning(
                "ShadowKV could not capture the model's whole decode step as one CUDA graph (%s); this cache replays "
                "each layer's attention step as a graph instead. Pass cuda_graphs=False to skip the attempt.",
                err,
            )
            return eager()
        self.graph = graph
        # The capture ran the step's host side (each layer counted its token) but no kernel: the replay does them.
        with torch.cuda.device(graph.device):
            graph.graph.replay()
        return graph.output_with(cache)


def _step_inputs(cache: Any, model: Any, forward: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The keyword arguments a capture of this call would take (positions filled in, the mask left out), or None
    when the call is not a one-token decode step that a graph can serve."""
    if args or torch.is_grad_enabled() or getattr(model, "training", False):
        return None
    if not _on_one_device(model):
        return None
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
        return None
    inputs = {}
    for name, value in kwargs.items():
        if name in _IGNORED or value is None:
            continue
        if isinstance(value, torch.Tensor):
            if name not in _TENSOR_INPUTS or value.device != ids.device:
                return None
        elif name not in _CACHE_NAMES and not isinstance(value, (bool, int, float, str)):
            return None
        elif name.startswith("output_") and value:
            return None
        inputs[name] = value
    if inputs.get("use_cache") is False:
        return None
    # The model would compute missing positions from the cache's length on the host: a capture would freeze them.
    length = cache.get_seq_length()
    if "position_ids" not in inputs:
        inputs["position_ids"] = torch.full((1, 1), length, dtype=torch.int64, device=ids.device)
    if "cache_position" not in inputs and "cache_position" in _parameters(forward):
        inputs["cache_position"] = torch.full((1,), length, dtype=torch.int64, device=ids.device)
    return inputs


def _on_one_device(model: Any) -> bool:
    """Whether `model` runs on one device and its forward never waits for the host: accelerate's hooks move weights
    or activations between devices inside the forward (a split or offloaded model, design.md §11), and some models
    read tensors on the host at every step (`capturable_model`)."""
    placed = {str(where) for where in (getattr(model, "hf_device_map", None) or {}).values()}
    return len(placed) <= 1 and not placed & {"cpu", "disk", "meta"} and capturable_model(model)


# Config fields that count a mixture-of-experts layer's experts, and RoPE types whose tables depend on the positions.
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_POSITION_DEPENDENT_ROPE = {"dynamic", "longrope"}


def capturable_model(model: Any) -> bool:
    """Whether the model's own forward may be captured: not when its code synchronises with the host at each step.
    Mixture-of-experts layers route tokens with host-sized index lists (`nonzero`, `tolist`), and dynamic-NTK and
    LongRoPE compare the positions with their table's length on the host. A capture that a synchronisation breaks
    cannot end cleanly, and leaves PyTorch's CUDA generator unusable for sampling, so such models are not tried:
    each compressed layer still replays its own step."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if config is None or any(isinstance(n, int) and n > 1 for n in (getattr(config, f, None) for f in _EXPERT_COUNTS)):
        return config is None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    tables = [rope] if "rope_type" in rope or "type" in rope else [t for t in rope.values() if isinstance(t, dict)]
    return not {t.get("rope_type", t.get("type")) for t in tables} & _POSITION_DEPENDENT_ROPE


def _step_key(cache: Any, inputs: dict[str, Any]) -> Hashable | None:
    """The whole step's key, or None when a layer cannot be captured now (not compressed, not graph-safe, on
    another device, or its token buffer full: the eager step grows it)."""
    layers = cache.layers
    device = inputs["input_ids"].device
    if not all(
        getattr(layer, "graph_safe", False) and layer.new.fits(1) and layer.new.keys.device == device
        for layer in layers
    ):
        return None
    shapes = tuple(
        (name, tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else (name, value)
        for name, value in sorted(inputs.items())
        if name not in _CACHE_NAMES
    )
    return (id(cache), shapes, tuple(layer.step_graph_key() for layer in layers))


def _parameters(forward: Callable) -> Mapping[str, inspect.Parameter]:
    try:
        return _signature(getattr(forward, "__func__", forward)).parameters
    except (TypeError, ValueError):
        return {}


@functools.lru_cache(maxsize=64)
def _signature(function: Callable) -> inspect.Signature:
    return inspect.signature(function)


def _without(output: Any, cache: Any) -> tuple[Any, Any]:
    """`output` with `cache` taken out (None in its place), and where it was (a key, an index, or None)."""
    if isinstance(output, Mapping):
        where = next((name for name, value in output.items() if value is cache), None)
        if where is not None:
            output = type(output)(**{name: value for name, value in output.items() if name != where})
        return output, where
    if isinstance(output, tuple):
        where = next((i for i, value in enumerate(output) if value is cache), None)
        if where is not None:
            output = (*output[:where], None, *output[where + 1 :])
        return output, where
    return output, None


def _cloned(output: Any) -> Any:
    """The model's output with its tensors copied out of the graph's memory (the next replay overwrites it)."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, Mapping):  # a ModelOutput (an ordered dict)
        return type(output)(**{name: _cloned(value) for name, value in output.items()})
    if isinstance(output, tuple):
        return tuple(_cloned(value) for value in output)
    return output
