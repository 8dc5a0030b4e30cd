"""The one module that knows NVRTC: compile `kernels/<stem>.cu` at run time, cache the cubin on disk, launch.

JIT contract (as FlashInfer's `jit/core.py`): try the disk cache -> take a file lock -> try again -> compile ->
write atomically -> load. The cache file is keyed by package version, GPU architecture, compile options and
a hash of the sources (the `.cu` and every `.cuh` it may include):
`~/.cache/shadowkv_cache/kernels/<stem>-<version>-<arch>-<hash>.cubin` (`SHADOWKV_CACHE_DIR` or
`XDG_CACHE_HOME` move it). `SHADOWKV_NO_COMPILE=1` forbids compiling: a missing cubin is then an error.

Kernels are launched with `cuLaunchKernel` on PyTorch's current stream of the tensors' device, with that device's
context current, and tensors passed by `data_ptr()`; each device loads its own module (a module is valid in one
context only).
Sources are found in `shadowkv_cache/kernels/` (a link to the repository's `kernels/` folder in a checkout,
a copy in an installed wheel). Needs `cuda-python` (`pip install "shadowkv-cache[cuda]"`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..paths import cache_dir
from ..version import __version__

__all__ = [
    "KernelError",
    "Kernels",
    "kernel_cache_dir",
    "cubin_for",
    "host_device_pointer",
    "kernels_available",
    "load_kernels",
    "max_shared_bytes",
    "multiprocessors",
    "source_dir",
    "strided_grid",
]

OPTIONS = ("-std=c++17", "-default-device", "--extra-device-vectorization")
INSTALL_HINT = 'pip install "shadowkv-cache[cuda]"  (or: pip install cuda-python)'


class KernelError(RuntimeError):
    """A kernel could not be compiled, found or launched; the message says why and what to do."""


def source_dir() -> Path:
    """Folder of the `.cu`/`.cuh` sources."""
    return Path(__file__).resolve().parents[1] / "kernels"


def kernel_cache_dir() -> Path:
    """Where compiled cubins are kept: the package's cache directory's `kernels/`."""
    return cache_dir() / "kernels"


def _sources(stem: str) -> tuple[str, dict[str, str]]:
    folder = source_dir()
    path = folder / f"{stem}.cu"
    if not path.is_file():
        raise KernelError(f"Kernel source {path} not found; the package install is incomplete (reinstall it).")
    headers = {p.name: p.read_text() for p in sorted(folder.glob("*.cuh"))}
    return path.read_text(), headers


def cubin_for(
    stem: str,
    arch: str,
    compile_fn: Callable[[str, str, dict[str, str], Sequence[str]], bytes] | None = None,
    directory: Path | None = None,
    defines: Sequence[tuple[str, str | int]] = (),
) -> bytes:
    """The cubin of `kernels/<stem>.cu` for `arch` (e.g. `"sm_90"`), from the disk cache or compiled.

    `compile_fn(name, source, headers, options) -> cubin` defaults to NVRTC (tests pass a fake). `defines` are
    preprocessor macros (`-DNAME=value`) of a source compiled once per specialisation (a dtype, a head size); they are
    part of the cache key like every option.
    """
    source, headers = _sources(stem)
    options = (f"--gpu-architecture={arch}", *OPTIONS, *[f"-D{name}={value}" for name, value in defines])
    digest = hashlib.sha256()
    for part in (source, *[f"{k}\0{v}" for k, v in headers.items()], *options):
        digest.update(part.encode())
        digest.update(b"\0")
    directory = directory or kernel_cache_dir()
    path = directory / f"{stem}-{__version__}-{arch}-{digest.hexdigest()[:16]}.cubin"
    if path.is_file():
        return path.read_bytes()
    if os.environ.get("SHADOWKV_NO_COMPILE", "0") not in ("", "0"):
        raise KernelError(
            f"Kernel '{stem}' for {arch} is not in the cache ({path}) and SHADOWKV_NO_COMPILE is set. Unset it "
            "to compile once (a few seconds), or copy the cache folder from a machine that compiled it."
        )
    directory.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.with_suffix(".lock")):
        if path.is_file():  # another process compiled it while we waited
            return path.read_bytes()
        cubin = (compile_fn or _nvrtc_compile)(f"{stem}.cu", source, headers, options)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    return cubin


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "a+") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: atomic writes alone keep the cache consistent
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cuda_bindings():
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as err:
        raise KernelError(f"The CUDA kernels need cuda-python, which is not installed: {INSTALL_HINT}.") from err
    return driver, nvrtc


def _check(result, what: str):
    """Unpack a cuda-python `(status, *values)` tuple, raising `KernelError` on failure."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise KernelError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else values


def _nvrtc_compile(name: str, source: str, headers: dict[str, str], options: Sequence[str]) -> bytes:
    _, nvrtc = _cuda_bindings()
    prog = _check(
        nvrtc.nvrtcCreateProgram(
            source.encode(), name.encode(), len(headers), [v.encode() for v in headers.values()],
            [k.encode() for k in headers],
        ),
        "nvrtcCreateProgram",
    )  # fmt: skip
    try:
        status = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])[0]
        if int(status) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise KernelError(
                f"NVRTC could not compile {name} ({' '.join(options)}):\n{log.decode(errors='replace').strip()}"
            )
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class Kernels:
    """The functions of one compiled source on one device; `launch` runs one on that device's current stream."""

    def __init__(self, stem: str, device: torch.device, defines: Sequence[tuple[str, str | int]] = ()):
        driver, _ = _cuda_bindings()
        self._driver = driver
        self.stem, self.device = stem, device
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # makes PyTorch's primary context current on this thread
            _ensure_context(driver, device)
            cubin = cubin_for(stem, _device_arch(device), defines=defines)
            self._module = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({stem})")
        self._functions: dict[str, object] = {}
        self._max_shared: dict[str, int] = {}  # dynamic shared memory each function was allowed
        self._resident: dict[str, int] = {}  # resident_blocks' answers

    def function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            fn = _check(self._driver.cuModuleGetFunction(self._module, name.encode()), f"cuModuleGetFunction({name})")
            self._functions[name] = fn
        return fn

    def set_max_dynamic_shared(self, name: str, nbytes: int) -> None:
        """Let `name` take `nbytes` of dynamic shared memory: a driver call only when that raises the limit set before
        (the first call always sets it, since the default limit also counts the kernel's static shared memory)."""
        if nbytes <= self._max_shared.get(name, -1):
            return
        attr = self._driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        with torch.cuda.device(self.device):
            _check(self._driver.cuFuncSetAttribute(self.function(name), attr, nbytes), "cuFuncSetAttribute")
        self._max_shared[name] = nbytes

    def resident_blocks(self, name: str, threads: int) -> int:
        """How many blocks of `threads` threads of `name` (no dynamic shared memory) one SM holds at once, by its
        registers and shared memory (`cuOccupancyMaxActiveBlocksPerMultiprocessor`); cached per function."""
        key = f"{name}/{threads}"
        if key not in self._resident:
            with torch.cuda.device(self.device):
                count = self._driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function(name), threads, 0)
                self._resident[key] = max(1, int(_check(count, "cuOccupancyMaxActiveBlocksPerMultiprocessor")))
        return self._resident[key]

    def launch(
        self,
        name: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[torch.Tensor | tuple[int | float | None, type] | ctypes.Structure],
        shared_bytes: int = 0,
    ) -> None:
        """Launch `name` on the current stream; `args` are tensors (passed by pointer), `(value, ctype)`, or ctypes
        structures (passed by value: their fields must lay out as the kernel's struct)."""
        values = []
        for arg in args:
            if isinstance(arg, ctypes.Structure):
                values.append(arg)
            elif isinstance(arg, torch.Tensor):
                if arg.device != self.device and arg.device.type == "cuda":
                    raise KernelError(f"{self.stem}.{name}: a tensor is on {arg.device}, not {self.device}.")
                values.append(ctypes.c_void_p(arg.data_ptr()))
            else:
                value, ctype = arg
                values.append(ctype(value))
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        # The module belongs to this device's context, which must be current: PyTorch restores the previous device
        # after each op, so with a model split over GPUs (design.md §11) another GPU's context is often current here,
        # and the launch would fail with CUDA_ERROR_INVALID_HANDLE.
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device).cuda_stream
            _check(
                self._driver.cuLaunchKernel(
                    self.function(name), *grid, *block, shared_bytes, stream, ctypes.addressof(pointers), 0
                ),
                f"cuLaunchKernel({self.stem}.{name})",
            )


def _ensure_context(driver, device: torch.device) -> None:
    ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:  # a thread PyTorch has not used yet: bind the primary context PyTorch uses
        dev = _check(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
        ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_LOADED: dict[tuple[str, int, tuple], Kernels] = {}
_LOCK = threading.Lock()
_FAILED: dict[str, str] = {}
_BINDINGS_FOUND: list[bool] = []  # non-empty once cuda-python was imported


def load_kernels(stem: str, device: torch.device, defines: Sequence[tuple[str, str | int]] = ()) -> Kernels:
    """The compiled `kernels/<stem>.cu` on `device` (compiled or read from the disk cache once per process), with the
    preprocessor `defines` of a specialised source."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (stem, device.index, tuple(defines))
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = Kernels(stem, device, defines)
        return _LOADED[key]


def kernels_available(device: torch.device) -> bool:
    """Whether the ops may use the CUDA kernels on `device` (CUDA, cuda-python present, not switched off).

    `SHADOWKV_KERNELS=0` forces the PyTorch twins (for comparison and debugging).
    """
    if device.type != "cuda" or os.environ.get("SHADOWKV_KERNELS", "1") == "0":
        return False
    if _BINDINGS_FOUND:  # asked for every layer at every step: the import is checked once
        return True
    if "cuda-python" in _FAILED:
        return False
    try:
        _cuda_bindings()
    except KernelError as err:
        import logging

        _FAILED["cuda-python"] = str(err)  # so this is logged once per process
        logging.getLogger("shadowkv_cache").warning(
            "%s Falling back to the slower PyTorch path, which synchronises with the host.", err
        )
        return False
    _BINDINGS_FOUND.append(True)
    return True


def host_device_pointer(tensor: torch.Tensor, device: torch.device) -> int:
    """The address at which `device` reads pinned host `tensor`'s first element (`cuMemHostGetDevicePointer`).

    With unified addressing on x86-64 it equals the host address on every GPU (the pool pins memory as portable);
    asking the driver, in `device`'s context, also covers systems where registered memory is mapped elsewhere.
    Callers cache it per tensor and device.
    """
    driver, _ = _cuda_bindings()
    with torch.cuda.device(device):
        pointer = driver.cuMemHostGetDevicePointer(tensor.data_ptr(), 0)
    return int(_check(pointer, "cuMemHostGetDevicePointer (pinned?)"))


def multiprocessors(device: torch.device) -> int:
    """The SM count of CUDA `device` (no index: the current one), for grids sized to the machine (split attention,
    the value fetch, the landmark scores)."""
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def strided_grid(device: torch.device, blocks: int, per_sm: float) -> tuple[int, int, int]:
    """A 1-D grid of `blocks` blocks, at most `per_sm` per SM of `device` and at least one, for kernels that stride
    over their work (the blocks take what is left in later iterations)."""
    return (max(1, min(blocks, int(per_sm * multiprocessors(device)))), 1, 1)


def max_shared_bytes(device: torch.device) -> int:
    """The dynamic shared memory a block may opt into on CUDA `device` (no index: the current one)."""
    return _max_shared_bytes(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _max_shared_bytes(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)
