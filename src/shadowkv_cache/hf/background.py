"""A layer's prompt compressed beside the next layers' forwards: on a worker thread and a side CUDA stream.

Compression waits on the host: `torch.linalg.eigh` checks its result there, `rank="auto"` reads its logit errors,
the sizes of each row are read and the copy to host memory is waited for. Inline, every such wait drains the
device's queue before the forward can go on, and the eigensolver's small kernels run alone: at 128K on an H100
machine that was ~255 ms of idle device and ~350 ms of `eigh` out of the ~1 s compression added to an 11.75 s
prefill (docs/results.md). Here a layer hands its compression to one worker thread (`compress_beside`), which waits
on a side stream for the layer's keys and values, compresses there and records an event, while the main thread
goes on with the next layer. The kernels and their order are the same as inline, so the prompt is too.

The prompt is joined (`PendingPrompt.result`: the current stream waits for the event) when anything reads the
layer's prompt and, at the latest, when the model call that started it ends (`finish_compression`, from
`UseScope`): no compression outlives its call, since a CUDA graph captured later must see no other thread's work.
A new job first waits for the one before it to end, so at most one layer's exact keys and values wait beside the
forward. Off CUDA, or with `BACKGROUND` off, a layer compresses inline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields, is_dataclass
from typing import Any

import torch

__all__ = ["BACKGROUND", "PendingPrompt", "compress_beside", "drain", "finish_compression"]

BACKGROUND = True  # compress on the worker where the layer is on CUDA
ON_CPU = False  # also on the CPU (no stream; tests use it to run the worker's path without a GPU)

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_last_done: threading.Event | None = None  # set when the job submitted last has ended: the next one waits for it
_side_streams: dict[int, torch.cuda.Stream] = {}


class PendingPrompt:
    """A layer's prompt being compressed on the worker; `result()` joins it on the calling thread's stream."""

    def __init__(self, future: Future, device: torch.device):
        self._future, self._device = future, device

    def result(self) -> Any:
        """The prompt, once the current stream has waited for its kernels; raises what the compression raised."""
        prompt, done = self._future.result()
        if done is not None:
            main = torch.cuda.current_stream(self._device)
            main.wait_event(done)
            # Made on the side stream and read on this one: their blocks must not be reused before this stream's
            # work on them has run, whenever they are freed.
            for tensor in _cuda_tensors(prompt):
                tensor.record_stream(main)
        return prompt


def compress_beside(job: Callable[[], Any], inputs: Iterable[Any], device: torch.device):
    """Run `job` (a layer's compression, reading the tensors among `inputs`, which the current stream has queued work
    on) on the worker; a `PendingPrompt`, or None where the layer compresses inline (`job` is not called)."""
    global _last_done
    if not BACKGROUND or (device.type != "cuda" and not ON_CPU):
        return None
    inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    ready, side = None, None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        side = _side_stream(index)
        for tensor in inputs:  # read on the side stream: not reused before it has read them, whenever freed
            if tensor.is_cuda:
                tensor.record_stream(side)
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    with _lock:
        previous, _last_done = _last_done, threading.Event()
        done = _last_done
    if previous is not None:
        previous.wait()  # its error, if any, is raised where its own layer joins it
    return PendingPrompt(_worker().submit(_run, job, ready, side, device, modes, done), device)


def drain() -> None:
    """Wait for every job submitted so far, whatever it raised (before a failed call's state is put back)."""
    with _lock:
        last = _last_done
    if last is not None:
        last.wait()  # one worker runs jobs in order: the last one ends after all the others


def finish_compression(layers: Iterable[Any]) -> None:
    """Join the pending prompt of every layer that has one (`finish_compression()` of each); raises the first error,
    after every job has ended."""
    try:
        for layer in layers:
            finish = getattr(layer, "finish_compression", None)
            if finish is not None:
                finish()
    except BaseException:
        drain()
        raise


def _worker() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadowkv-compress")
        return _executor


def _side_stream(index: int) -> torch.cuda.Stream:
    with _lock:
        if index not in _side_streams:
            # High priority: at 128K the forward's kernels fill every SM, so at equal priority the compression's
            # blocks (the eigensolver's are few and latency-bound) queue behind them and nothing overlaps.
            _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
        return _side_streams[index]


def _run(job, ready, side, device: torch.device, modes: tuple[bool, bool], ended: threading.Event):
    """`(prompt, event after its kernels on the side stream or None)`; `ended` is set however the job ends."""
    grad, inference = modes
    try:
        with torch.set_grad_enabled(grad), torch.inference_mode(inference):
            if side is None:
                return job(), None
            with torch.cuda.device(device), torch.cuda.stream(side):
                side.wait_event(ready)
                try:
                    prompt = job()
                finally:
                    done = torch.cuda.Event()
                    done.record(side)
            return prompt, done
    finally:
        ended.set()


def _cuda_tensors(obj: Any, depth: int = 0, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """The CUDA tensors a prompt holds: in its fields, their dicts, lists and the package's own objects (stores, row
    maps), a few levels down."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _cuda_tensors(value, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _cuda_tensors(value, depth + 1, seen)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for field in fields(obj):
            yield from _cuda_tensors(getattr(obj, field.name), depth + 1, seen)
    elif type(obj).__module__.startswith("shadowkv_cache.") and hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            yield from _cuda_tensors(value, depth + 1, seen)
