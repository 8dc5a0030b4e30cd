"""Kernel timelines of profiled decode steps: busy and idle device time, and how much of the value fetch ran beside
other kernels.

Summing kernel times over a step counts overlapped time twice and idle gaps not at all, so "device time less the
step" only bounds the fetch's hidden share from below, and at batch 1 (hundreds of short kernels with launch gaps
between them) it reads zero whatever the overlap. Here the profiler's kernel intervals are merged instead:
- `busy`: the union of every kernel's interval, `idle` the rest of the span from the first kernel's start to the last
  one's end;
- `fetch`: the union of the fetch kernels' intervals; `hidden` the part of it during which some other kernel ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["FETCH_KERNELS", "idle_gaps", "kernel_intervals", "merged", "overlap_length", "timeline_summary"]

# Kernels that read values from pinned host memory over PCIe: ShadowKV's chunk fetch and YAKV's record fetch.
FETCH_KERNELS = ("gather_values", "gather_dequant")

Interval = tuple[float, float]


def kernel_intervals(prof) -> list[tuple[str, float, float, int]]:
    """`(name, start, end, stream)` (times in µs) of every kernel, memset and copy a finished `torch.profiler.profile`
    recorded on the device, by start (graph replays included: their nodes are traced one by one)."""
    out = []
    for event in prof.events():
        if event.device_type.name != "CUDA" or event.time_range.end <= event.time_range.start:
            continue
        start, end = float(event.time_range.start), float(event.time_range.end)
        out.append((event.name, start, end, int(event.device_resource_id)))
    return sorted(out, key=lambda k: k[1])


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def _length(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def overlap_length(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two unions, each given as sorted disjoint intervals (`merged`)."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def idle_gaps(kernels: Sequence[tuple], steps: int, top: int = 8) -> list[dict]:
    """The device's idle gaps grouped by the kernels on either side (the one that ended last before the gap, the one
    that starts it), largest total first: `after`, `before`, gaps and ms per step. `kernels` by start."""
    groups: dict[tuple[str, str], list] = {}
    end, last = None, None
    for name, start, stop, *_ in kernels:
        if end is not None and start > end:
            group = groups.setdefault((last[:60], name[:60]), [0, 0.0])
            group[0] += 1
            group[1] += start - end
        if end is None or stop > end:
            end, last = stop, name
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])[:top]
    return [dict(after=a, before=b, per_step=count / steps, ms_per_step=round(total / 1e3 / steps, 3))
            for (a, b), (count, total) in ranked]  # fmt: skip


def timeline_summary(kernels: Sequence[tuple], steps: int, sample: int = 0) -> dict | None:
    """Per step, from `(name, start µs, end µs, ...)` of `steps` profiled steps, by start: the span, busy and idle ms,
    kernels per step, and the fetch's union, the part of it hidden beside other kernels, and its share. None without
    kernels; the fetch entries are None without fetch kernels. `sample` > 0 adds that many consecutive kernels from
    the middle of the trace (`name`, `start_us` from the first of them, `us`, `stream` where given): one layer's
    order and gaps, to read."""
    if not kernels:
        return None
    start, end = min(k[1] for k in kernels), max(k[2] for k in kernels)
    busy = merged((k[1], k[2]) for k in kernels)
    fetch = merged((k[1], k[2]) for k in kernels if k[0].startswith(FETCH_KERNELS))
    others = merged((k[1], k[2]) for k in kernels if not k[0].startswith(FETCH_KERNELS))
    per = 1e3 * steps  # µs over the steps to ms per step
    out = dict(span_ms=round((end - start) / per, 3), busy_ms=round(_length(busy) / per, 3),
               idle_ms=round((end - start - _length(busy)) / per, 3), kernels_per_step=len(kernels) / steps,
               fetch_ms=None, hidden_ms=None, hidden_share=None, gaps=idle_gaps(kernels, steps))  # fmt: skip
    if fetch:
        fetch_us, hidden_us = _length(fetch), overlap_length(fetch, others)
        out.update(fetch_ms=round(fetch_us / per, 3), hidden_ms=round(hidden_us / per, 3),
                   hidden_share=round(hidden_us / fetch_us, 3))  # fmt: skip
    if sample > 0:
        first = max(0, len(kernels) // 2 - sample // 2)
        chosen = kernels[first : first + sample]
        out["sample"] = [
            dict(
                name=k[0][:60],
                start_us=round(k[1] - chosen[0][1], 2),
                us=round(k[2] - k[1], 2),
                **({"stream": k[3]} if len(k) > 3 else {}),
            )  # fmt: skip
            for k in chosen
        ]
    return out
