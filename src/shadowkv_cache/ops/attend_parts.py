"""One-token decode attention over a compressed layer's parts, read where they lie (design.md §3).

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, N_i slots of part i, N all slots, D head dim,
S splits.

The twin (`core.attention.attend_parts`, the definition) concatenates the parts' keys, values and validity, then runs
PyTorch's attention with that mask: at 128K and batch 32 the copy alone took 5.7 ms of a 69 ms step, and the mask
rules out the flash kernels, so memory-efficient attention served a one-row query with 64-row tiles. On CUDA
`kernels/attend_parts.cu` reads each part in place (any strides, rows shared by a document included), serves the
`G` query heads of a KV head with one read of its keys and values, and splits the slots over blocks; a second kernel
merges the splits by log-sum-exp. Everything else (several query tokens, other head sizes, more than 8 query heads
per KV head) runs the twin.
"""

from __future__ import annotations

import ctypes

import torch

from ..core.attention import NO_TERMS, LogitTerms, Part
from ..core.attention import attend_parts as attend_parts_reference
from .library import define_op
from .loader import kernels_available, load_kernels, multiprocessors

__all__ = [
    "attend_parts",
    "attend_parts_op",
    "attend_parts_reference",
    "check_args",
    "empty_shares",
    "kernel_fits",
    "launch_merge",
    "launch_split",
    "part_splits",
    "shape_defines",
    "split_kernels",
    "splits_for",
]

_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "float"}  # C types of common.cuh
_MAX_PARTS, _THREADS, _MAX_GROUP = 4, 128, 8  # as kernels/attend_parts.cu
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z sizes (KV heads, rows)
_BLOCKS_PER_SM = 8  # splits are chosen so that the grid has about this many blocks per multiprocessor
# Blocks per SM the split kernel's registers must allow (its launch bounds) for the shapes in `_BOUNDED`: those whose
# kernel the compiler builds with more than 128 registers and that spill at most a few bytes at 128. At 16-bit, G = 4,
# D = 128 (the Llama-3.1-8B shape) it took 133 registers, so 3 blocks of 128 threads fit an SM; bounded to 4 it takes
# 128 and spills 14 bytes, and attention took 6.42 ms of a 128K batch-44 step against 8.62
# (`decode_profile_128k_batch44_attend{1,4}`), 712.6 tok/s with it (`ab_landmark_attend4_noballot`). Other shapes
# keep the compiler's choice: below 128 registers a bound only lets it take more (fp32 G = 4, D = 128: 101 -> 128,
# 5 blocks -> 4), and G = 8 spills hundreds of bytes at 128. `benchmarks/profile_decode.py` and
# `throughput.py --attend-min-blocks N` compare (0: the compiler's choice).
MIN_BLOCKS = 4
_BOUNDED = frozenset({(2, 4, 128)})  # (element size, G, D)


class _Part(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("valid", ctypes.c_void_p),
        *[(name, ctypes.c_longlong) for name in ("kb", "kh", "kn", "vb", "vh", "vn", "mb", "mh", "mn", "n")],
    ]


class _Parts(ctypes.Structure):
    _fields_ = [("p", _Part * _MAX_PARTS), ("count", ctypes.c_int)]


def attend_parts(query: torch.Tensor, parts: list[Part], scaling: float, terms: LogitTerms = NO_TERMS) -> torch.Tensor:
    """Exact attention of `query` `[B, Hq, T, D]` over the concatenation of `parts` (keys and values
    `[B or 1, Hkv, N_i, D]`, validity broadcastable to `[B, Hkv, T, N_i]`), with the model's `terms`; returns
    `[B, T, Hq, D]` in the query's dtype, as `core.attention.attend_parts`. The kernels never read invalid slots (what
    they hold does not matter), and a head with no valid slot gets zeros; a decode step always holds its own token."""
    if not kernel_fits(query, parts, terms):
        return attend_parts_reference(query, parts, scaling, terms)
    sinks = None if terms.sinks is None else terms.sinks.to(device=query.device, dtype=torch.float32).contiguous()
    keys, values, valid = (list(t) for t in zip(*parts))
    return attend_parts_op(query, keys, values, valid, scaling, terms.softcap, sinks)


def check_args(query: torch.Tensor, softcap: float | None, op: str = "attend_parts") -> None:
    """Refuse what the one-token attention kernels would read otherwise than their twins (operator `op`)."""
    torch._check(softcap is None or softcap > 0, lambda: f"softcap must be None (no capping) or > 0, got {softcap}")
    torch._check(query.shape[2] == 1, lambda: f"the {op} operator takes one query token: call {op}")


def _attend_parts_twin(query, keys, values, valid, scaling, softcap, sinks) -> torch.Tensor:
    check_args(query, softcap)
    return attend_parts_reference(query, list(zip(keys, values, valid)), scaling, LogitTerms(softcap, sinks))


def _out_like(query, keys, values, valid, scaling, softcap, sinks) -> torch.Tensor:
    check_args(query, softcap)
    batch, num_q_heads, steps, dim = query.shape
    return query.new_empty((batch, steps, num_q_heads, dim))


@define_op(
    "attend_parts(Tensor query, Tensor[] keys, Tensor[] values, Tensor[] valid, float scaling, float? softcap, "
    "Tensor? sinks) -> Tensor",
    cpu=_attend_parts_twin,
    fake=_out_like,
)
def attend_parts_op(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid: list[torch.Tensor],
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`torch.ops.shadowkv.attend_parts`: the kernels on what `attend_parts` checked (the parts as three lists;
    `sinks` fp32 contiguous on the query's device); `[B, 1, Hq, D]`."""
    check_args(query, softcap)
    heads = keys[0].shape[1]
    splits, span = part_splits(query, keys)
    part_acc, part_ml = empty_shares(query, heads, splits)
    kernels = split_kernels(query, heads)
    launch_split(kernels, query, keys, values, valid, scaling, softcap, part_acc, part_ml, 0, span)
    return launch_merge(kernels, part_acc, part_ml, sinks, query)


def part_splits(query: torch.Tensor, keys: list[torch.Tensor]) -> tuple[int, int]:
    """(S, slots per split) of the split kernel over the parts whose keys are `keys`."""
    total = sum(k.shape[2] for k in keys)
    return splits_for(total, query.shape[0] * keys[0].shape[1], _tile(query.shape[-1] * query.element_size()),
                      query.device)  # fmt: skip


def empty_shares(query: torch.Tensor, heads: int, shares: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for `shares` split shares per (row, KV head): `[B, Hkv, S, G, D]` and `[B, Hkv, S, G, 2]` fp32."""
    batch, num_q_heads, _, dim = query.shape
    group = num_q_heads // heads
    part_acc = torch.empty((batch, heads, shares, group, dim), dtype=torch.float32, device=query.device)
    return part_acc, torch.empty((batch, heads, shares, group, 2), dtype=torch.float32, device=query.device)


def shape_defines(query: torch.Tensor, heads: int) -> tuple[tuple[str, str | int], ...]:
    """The kernels' shape: ATTEND_T (the query's C type), ATTEND_G (query heads per KV head) and ATTEND_D."""
    group, dim = query.shape[1] // heads, query.shape[-1]
    return ("ATTEND_T", _KERNEL_DTYPES[query.dtype]), ("ATTEND_G", group), ("ATTEND_D", dim)


def split_kernels(query: torch.Tensor, heads: int):
    """The compiled split and merge kernels for this query's dtype, group size and head size."""
    bounded = (query.element_size(), query.shape[1] // heads, query.shape[-1]) in _BOUNDED
    defines = (*shape_defines(query, heads), ("ATTEND_MIN_BLOCKS", MIN_BLOCKS if bounded else 0))
    return load_kernels("attend_parts", query.device, defines)


def launch_split(
    kernels,
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    valid: list[torch.Tensor],
    scaling: float,
    softcap: float | None,
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    first_share: int,
    span: int,
) -> None:
    """The split kernel over the parts, writing shares `first_share` onwards (of `part_acc.shape[2]`)."""
    batch = query.shape[0]
    heads = keys[0].shape[1]
    total = sum(k.shape[2] for k in keys)
    described = _Parts(count=len(keys))
    for i, (k, v, m) in enumerate(zip(keys, values, valid)):
        described.p[i] = _Part(
            k.data_ptr(),
            v.data_ptr(),
            m.data_ptr(),
            *_strides(k, (0, 1, 2)),
            *_strides(v, (0, 1, 2)),
            *_strides(m, (0, 1, 3)),
            k.shape[2],
        )
    kernels.launch(
        "attend_split",
        grid=(-(-total // span), heads, batch),
        block=(_THREADS, 1, 1),
        args=[
            query,
            (query.stride(0), ctypes.c_longlong),
            (query.stride(1), ctypes.c_longlong),
            described,
            (scaling, ctypes.c_float),
            (softcap or 0.0, ctypes.c_float),
            (total, ctypes.c_longlong),
            (span, ctypes.c_longlong),
            (first_share, ctypes.c_int),
            (part_acc.shape[2], ctypes.c_int),
            part_acc,
            part_ml,
        ],
    )


def launch_merge(
    kernels, part_acc: torch.Tensor, part_ml: torch.Tensor, sinks: torch.Tensor | None, query: torch.Tensor
) -> torch.Tensor:
    """The shares merged by their log-sum-exp (with the model's sinks): `[B, 1, Hq, D]` in the query's dtype."""
    batch, num_q_heads, _, dim = query.shape
    splits = part_acc.shape[2]
    out = torch.empty((batch, 1, num_q_heads, dim), dtype=query.dtype, device=query.device)
    kernels.launch(
        "attend_merge",
        grid=(num_q_heads, batch, 1),
        block=(_THREADS, 1, 1),
        args=[part_acc, part_ml, sinks if sinks is not None else (None, ctypes.c_void_p), out, (splits, ctypes.c_int)],
        shared_bytes=4 * splits,
    )
    return out


def kernel_fits(query: torch.Tensor, parts: list[Part], terms: LogitTerms) -> bool:
    """Whether the kernels serve this call: one CUDA query token, a known dtype everywhere, a head vector of 2, 4, 8,
    16 or 32 16-byte units (bf16: head size 16 to 256), at most 8 query heads per KV head and 4 parts, 16-byte
    aligned vectors."""
    if not (query.is_cuda and query.dim() == 4 and query.shape[2] == 1 and query.dtype in _KERNEL_DTYPES):
        return False
    if not parts or len(parts) > _MAX_PARTS or query.stride(3) != 1 or not kernels_available(query.device):
        return False
    batch, num_q_heads, _, dim = query.shape
    heads = parts[0][0].shape[1]
    vector = dim * query.element_size()
    if vector % 16 or vector // 16 not in (2, 4, 8, 16, 32):
        return False
    if num_q_heads % heads or num_q_heads // heads > _MAX_GROUP or not sum(k.shape[2] for k, _, _ in parts):
        return False
    if terms.sinks is not None and terms.sinks.numel() != num_q_heads:
        return False
    if terms.softcap is not None and not terms.softcap > 0:  # the kernel reads 0 as "no capping"
        return False
    if not 0 < batch <= _MAX_GRID_YZ or heads > _MAX_GRID_YZ:
        return False
    for keys, values, valid in parts:
        n = keys.shape[2]
        for t in (keys, values):
            if t.dtype != query.dtype or t.device != query.device or t.dim() != 4 or t.stride(3) != 1:
                return False
            if t.shape[0] not in (1, batch) or t.shape[1] != heads or t.shape[2] != n or t.shape[3] != dim:
                return False
            if any(s * t.element_size() % 16 for s in t.stride()[:3]) or t.data_ptr() % 16:
                return False
        if valid.dtype != torch.bool or valid.device != query.device or valid.dim() != 4:
            return False
        if valid.shape[0] not in (1, batch) or valid.shape[1] not in (1, heads) or valid.shape[2] != 1:
            return False
        if valid.shape[3] != n:
            return False
    return True


def _strides(t: torch.Tensor, dims: tuple[int, int, int]) -> list[int]:
    """Element strides of `t` over (row, head, slot) dims; 0 where a dim has size 1 (broadcast)."""
    return [t.stride(d) if t.shape[d] != 1 else 0 for d in dims]


def _tile(vector_bytes: int) -> int:
    """Slots per tile of the split kernel for head vectors of `vector_bytes` (as `TOK` in the kernel)."""
    return 64 if vector_bytes <= 256 else 32


def splits_for(total: int, blocks: int, tile: int, device: torch.device) -> tuple[int, int]:
    """(S, slots per split, a multiple of `tile`): about `_BLOCKS_PER_SM` blocks per multiprocessor, a tile each at
    least (each block's tiles run one after another, so more splits are more loads in flight)."""
    tiles = -(-total // tile)
    wanted = -(-_BLOCKS_PER_SM * multiprocessors(device) // blocks)
    per_split = -(-tiles // max(1, min(tiles, wanted)))
    span = per_split * tile
    return -(-total // span), span
