"""Temporal-cache scan: which selected chunks are already held (hits), and which slot each miss takes.

Legend: B batch, Hkv KV heads, K slots (selected chunks per head).

Held keys and values never move: a slot keeps its chunk while that chunk is still wanted; every newly
wanted chunk takes a freed slot (the m-th new chunk in wanted order goes to the m-th free slot in slot
order); free slots left over become empty (-1). Fixed-size outputs, so nothing here waits for the host.

Four implementations of one meaning: `temporal_scan_reference` (the definition: every slot against every wanted
entry, O(K^2) memory), `kernels/temporal_scan.cu`'s bitmap kernel (membership as bits of the units' bitmaps in shared
memory, O(K + units/32), one block per head: both modes' steps, whose units are the prompt's chunks or tokens), its
pairwise kernel (the same comparisons as the twin in shared memory, for callers that do not say how many units the
ids index) and `temporal_scan_sorted` (membership by sorting and binary search, O(K log K): wherever no kernel runs;
no host synchronisation).
"""

from __future__ import annotations

import ctypes

import torch

from .library import define_op
from .loader import kernels_available, load_kernels, max_shared_bytes

__all__ = [
    "QUADRATIC_SLOTS",
    "count_misses",
    "temporal_scan",
    "temporal_scan_op",
    "temporal_scan_reference",
    "temporal_scan_sorted",
]

# Above this many slots the kernel's K^2 comparisons per head (and the reference's K^2 memory) cost more than sorting.
# The kernel itself takes up to `_MAX_SLOTS` (22 bytes of shared memory per slot).
QUADRATIC_SLOTS = 1024
_MAX_SLOTS = 2048


def temporal_scan_reference(
    ids: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch twin: `(new ids [B, Hkv, K] int64, miss [B, Hkv, K] bool)` (see the module docstring)."""
    want = wanted.masked_fill(~valid, -1)
    held = ids >= 0
    keep = held & (ids[..., :, None] == want[..., None, :]).any(dim=-1)  # [B, Hkv, K] per slot
    new = (want >= 0) & ~(want[..., :, None] == ids[..., None, :]).any(dim=-1)  # [B, Hkv, K] per wanted entry
    free = ~keep
    free_rank = free.long().cumsum(dim=-1) - 1
    # New chunks in wanted order first (a stable sort of "is not new"), then the rest.
    order = torch.sort((~new).to(torch.uint8), dim=-1, stable=True).indices
    new_in_order = want.gather(-1, order)
    num_new = new.sum(dim=-1, keepdim=True)
    takes = free & (free_rank < num_new)
    incoming = new_in_order.gather(-1, free_rank.clamp(min=0))
    new_ids = torch.where(takes, incoming, torch.where(keep, ids, torch.full_like(ids, -1)))
    return new_ids, takes


def temporal_scan_sorted(
    ids: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`temporal_scan_reference`'s result, with membership found by binary search in sorted copies (O(K log K)).
    Like the kernel, it writes the new ids into `ids` (so a captured step keeps reading and writing one tensor)."""
    num_slots = ids.shape[-1]
    want = wanted.masked_fill(~valid, -1)
    held = ids >= 0
    last = num_slots - 1
    sorted_want = want.sort(dim=-1).values
    at = torch.searchsorted(sorted_want, ids).clamp(max=last)
    keep = held & (sorted_want.gather(-1, at) == ids)  # per slot: its unit is wanted again
    sorted_ids = ids.sort(dim=-1).values
    at = torch.searchsorted(sorted_ids, want).clamp(max=last)
    new = (want >= 0) & (sorted_ids.gather(-1, at) != want)  # per wanted entry: not held
    free = ~keep
    free_rank = free.long().cumsum(dim=-1) - 1
    new_rank = new.long().cumsum(dim=-1) - 1
    # The m-th new unit in wanted order at index m; entries that are not new go to a spare last column.
    incoming = torch.full((*ids.shape[:-1], num_slots + 1), -1, dtype=ids.dtype, device=ids.device)
    incoming.scatter_(-1, torch.where(new, new_rank, num_slots), want)
    takes = free & (free_rank < new.sum(dim=-1, keepdim=True))
    arriving = incoming.gather(-1, free_rank.clamp(min=0))
    ids.copy_(torch.where(takes, arriving, torch.where(keep, ids, torch.full_like(ids, -1))))
    return ids, takes


def temporal_scan(
    ids: torch.Tensor,
    wanted: torch.Tensor,
    valid: torch.Tensor,
    units: int | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Update the held chunk ids for this step's selection; returns `(ids, miss)`.

    Args:
        ids (`torch.Tensor`): `[B, Hkv, K]` int64, chunk held by each slot (-1 = empty). The kernels and the sorted
            scan update it in place and return it; the twin returns a new tensor.
        wanted (`torch.Tensor`): `[B, Hkv, K]` int64, chunks selected this step (distinct where valid).
        valid (`torch.Tensor`): `[B, Hkv, K]` bool, which entries of `wanted` count.
        units (`int`, *optional*): how many units the ids index (all held and valid wanted ids are below it); with it,
            rows take the bitmap kernel where its bitmaps fit shared memory. At ShadowKV's sizes (256 slots of 16,380
            chunks) it took 4.5 against 16.8 µs a layer at batch 1 and 10.1 against 19.1 at batch 44 on an H200
            machine (`selection_kernels_cuda_128k`).
        counts (`torch.Tensor`, *optional*): `[2]` int64 on the ids' device; the misses are added to `counts[0]`
            and the scan to `counts[1]` (the bitmap kernel adds them itself: no extra launches).
    """
    num_slots = ids.shape[-1]
    kernel = num_slots > 0 and kernels_available(ids.device) and ids.is_contiguous()
    if kernel and units is not None and _bitmap_fits(units, ids.device):
        return ids, temporal_scan_op(ids, wanted.contiguous(), valid.contiguous(), units, counts)
    if kernel and num_slots <= QUADRATIC_SLOTS:
        return ids, temporal_scan_op(ids, wanted.contiguous(), valid.contiguous(), 0, counts)
    if num_slots == 0:
        new_ids, miss = temporal_scan_reference(ids, wanted, valid)
    else:
        new_ids, miss = temporal_scan_sorted(ids, wanted, valid)  # the twin's result without its K^2 comparisons
    count_misses(counts, miss)  # the kernels count their own
    return new_ids, miss


def _bitmap_bytes(units: int) -> int:
    return 8 * -(-units // 32)  # two bitmaps of ceil(units / 32) words


def _bitmap_fits(units: int, device: torch.device) -> bool:
    """Whether the bitmap kernel's two bitmaps of `units` bits fit the device's shared memory (beside its own 128
    static bytes)."""
    return 0 < units < 2**31 and _bitmap_bytes(units) + 128 <= max_shared_bytes(device)


def _miss_like(
    ids: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor, units: int = 0, counts=None
) -> torch.Tensor:
    return torch.empty(ids.shape, dtype=torch.bool, device=ids.device)


def count_misses(counts: torch.Tensor | None, miss: torch.Tensor) -> None:
    """Add a scan's misses to `counts[0]` and the scan to `counts[1]` (`[2]` int64), as the bitmap kernel does."""
    if counts is not None:
        counts[0] += miss.sum()
        counts[1] += 1


def _scan_on_cpu(ids, wanted, valid, units=0, counts=None):
    miss = temporal_scan_sorted(ids, wanted, valid)[1]
    count_misses(counts, miss)
    return miss


@define_op(
    "temporal_scan(Tensor(a!) ids, Tensor wanted, Tensor valid, int units=0, Tensor(b!)? counts=None) -> Tensor",
    cpu=_scan_on_cpu,
    fake=_miss_like,
)
def temporal_scan_op(
    ids: torch.Tensor, wanted: torch.Tensor, valid: torch.Tensor, units: int = 0, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """`torch.ops.shadowkv.temporal_scan`: a kernel on contiguous inputs; updates `ids` in place and returns `miss`.
    `units` 0: the pairwise kernel (at most 2048 slots); else the bitmap kernel, every id below `units` (bitmaps of
    `units` bits in shared memory). `counts` (`[2]` int64, *optional*): the misses are added to `counts[0]` and the
    scan to `counts[1]`."""
    num_slots = ids.shape[-1]
    rows = ids.numel() // max(num_slots, 1)
    kernels = load_kernels("temporal_scan", ids.device)
    miss = _miss_like(ids, wanted, valid)
    if counts is not None:
        torch._check(
            counts.dtype == torch.int64 and counts.shape == (2,) and counts.device == ids.device,
            lambda: (
                f"temporal_scan's counts must be [2] int64 on {ids.device}, got {counts.dtype} {list(counts.shape)}"
            ),
        )
    if units:
        torch._check(0 < units < 2**31, lambda: f"the bitmap scan takes 0 < units < 2^31, got {units}")
        shared = _bitmap_bytes(units)
        if rows and num_slots:
            fresh = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
            kernels.set_max_dynamic_shared("temporal_scan_bitmap", shared)
            kernels.launch(
                "temporal_scan_bitmap",
                grid=(rows, 1, 1),
                block=(1024, 1, 1),
                args=[
                    ids,
                    wanted,
                    valid,
                    miss,
                    fresh,
                    counts if counts is not None else (0, ctypes.c_void_p),
                    (num_slots, ctypes.c_int),
                    (units, ctypes.c_int),
                ],
                shared_bytes=shared,
            )
        else:
            count_misses(counts, miss)
        return miss
    torch._check(
        0 < num_slots <= _MAX_SLOTS, lambda: f"the temporal_scan kernel takes 1 to {_MAX_SLOTS} slots, got {num_slots}"
    )
    if rows:
        kernels.launch(
            "temporal_scan",
            grid=(rows, 1, 1),
            block=(256, 1, 1),
            args=[ids, wanted, valid, miss, (num_slots, ctypes.c_int)],
            shared_bytes=22 * num_slots,
        )
    count_misses(counts, miss)
    return miss
