"""Zero-copy reads of small random records from pinned host memory: how the rate depends on a record's size and
alignment, in one run.

Legend: E record bytes, S stride between records (bytes), o offset of the first record from a 128-byte boundary.

A YAKV decode step fetches each missed token's key and value as one E-byte record (E = D/2 + 4: 132 bytes at
D = 128) at a random place in the pinned host store, read by the GPU in place over PCIe (`ops/gather_dequant.py`).
At 128K, batch 22, it moved 0.274 GB per step at about 22 GB/s, where ShadowKV's chunk fetch, whose records are
several hundred contiguous bytes, reaches about 36 GB/s. This times `torch.index_select` of random records through a
device view of the pinned buffer (one 4-, 8- or 16-byte load per thread, consecutive threads on consecutive words),
for records of several sizes, strides and offsets:

- `128 @ 128` against `128 @ 128 +4`: the same bytes, aligned to 128-byte lines or not;
- `132 @ 132` (today's packed records) against `132 @ 256` (each record starting on a line) and `128 @ 128`;
- 64 to 512 bytes aligned: how the rate grows with the record;

and, as the reference, a sequential pinned-to-device copy and the `gather_dequant` kernel itself on 132-byte records.
`GBps` counts the record bytes once (what the step's byte count means); `lines` and `sectors` are the numbers of
128-byte lines and 32-byte sectors a record touches on average.

    python -m benchmarks.host_records --device cuda          # an H200 machine, under a minute
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.results_io import add_results_dir_option, environment, write_results
from benchmarks.scoring import time_ms
from benchmarks.speed import free, log, sync

# (label, record bytes, stride bytes, offset bytes, load dtype)
CASES = [
    ("64 @ 64", 64, 64, 0, torch.int32),
    ("128 @ 128", 128, 128, 0, torch.int32),
    ("128 @ 128, 8-byte loads", 128, 128, 0, torch.int64),
    ("128 @ 128, 16-byte loads", 128, 128, 0, torch.complex128),
    ("128 @ 128 +4", 128, 128, 4, torch.int32),
    ("132 @ 132", 132, 132, 0, torch.int32),
    ("132 @ 136, 8-byte loads", 136, 136, 0, torch.int64),
    ("132 @ 256", 132, 256, 0, torch.int32),
    ("256 @ 256", 256, 256, 0, torch.int32),
    ("256 @ 256, 16-byte loads", 256, 256, 0, torch.complex128),
    ("512 @ 512, 16-byte loads", 512, 512, 0, torch.complex128),
]


class _DeviceView:
    """A CUDA array interface over `address` (a device-visible address of pinned host memory)."""

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype):
        typestr = {torch.int32: "<i4", torch.int64: "<i8", torch.complex128: "<c16"}[dtype]
        self.__cuda_array_interface__ = {
            "shape": shape,
            "strides": strides,
            "typestr": typestr,
            "data": (address, False),
            "version": 3,
        }


def lines_touched(record: int, stride: int, offset: int, line: int = 128, count: int = 4096) -> float:
    """Mean number of `line`-byte lines (128: cache lines, 32: sectors) a record touches, over `count` consecutive
    records."""
    total = 0
    for i in range(count):
        start = offset + i * stride
        total += (start + record - 1) // line - start // line + 1
    return total / count


def case_row(host: torch.Tensor, address: int, case, count: int, device: torch.device, span: int = 0) -> dict:
    """One case's row; records drawn from the first `span` bytes of `host` (0: all of it)."""
    label, record, stride, offset, dtype = case
    item = torch.empty((), dtype=dtype).element_size()
    n = ((span or host.numel()) - offset - record) // stride
    view = torch.as_tensor(_DeviceView(address + offset, (n, record // item), (stride, item), dtype), device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    index = torch.randint(0, n, (count,), device=device, generator=gen)
    out = torch.empty((count, record // item), dtype=dtype, device=device)
    ms = time_ms(lambda: torch.index_select(view, 0, index, out=out), device)
    # The data really came through: compare a few records with the host's bytes.
    picked = index[:64].cpu()
    want = torch.stack([host[offset + int(i) * stride : offset + int(i) * stride + record] for i in picked])
    assert torch.equal(out[:64].cpu().view(torch.uint8).reshape(64, record), want), label
    return {
        "case": label,
        "record_bytes": record,
        "stride": stride,
        "offset": offset,
        "load_bytes": item,
        "records": count,
        "span_mib": (span or host.numel()) >> 20,
        "lines": round(lines_touched(record, stride, offset), 3),
        "sectors": round(lines_touched(record, stride, offset, 32), 3),
        "ms": round(ms, 4),
        "GBps": round(count * record / ms / 1e6, 2),
    }


def kernel_row(host: torch.Tensor, address: int, count: int, device: torch.device, span: int = 0) -> dict:
    """`gather_dequant` over `count` random 132-byte records of a [1, 8, N, 132] store (D = 128, p = 2) made of the
    first `span` bytes of `host` (0: all of it)."""
    from shadowkv_cache.ops.gather_dequant import gather_dequant_op
    from shadowkv_cache.quant import higgs_quantizer

    heads, record = 8, 132
    n = (span or host.numel()) // (heads * record)
    data = host[: heads * n * record].view(1, heads, n, record)
    per_head = count // heads
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, n, (1, heads, per_head), device=device, generator=gen)
    quantizer = higgs_quantizer(128, 2, 0)
    grid, signs = quantizer.device_tables(device)
    keys = torch.empty((1, heads, per_head, 128), dtype=torch.bfloat16, device=device)
    values = torch.empty_like(keys)
    row_map = torch.zeros(1, dtype=torch.int64, device=device)

    def run():
        gather_dequant_op(keys, values, ids, None, data, address, None, row_map, grid, signs, 2, 0)

    ms = time_ms(run, device)
    return {
        "case": "gather_dequant kernel, 132 @ 132",
        "record_bytes": record,
        "stride": record,
        "offset": 0,
        "load_bytes": 4,
        "records": heads * per_head,
        "span_mib": (span or host.numel()) >> 20,
        "lines": round(lines_touched(record, record, 0), 3),
        "sectors": round(lines_touched(record, record, 0, 32), 3),
        "ms": round(ms, 4),
        "GBps": round(heads * per_head * record / ms / 1e6, 2),
    }


def copy_row(host: torch.Tensor, device: torch.device) -> dict:
    """A sequential copy of 1 GiB of the pinned buffer to the device: the PCIe ceiling of this machine."""
    src = host[: 1 << 30]
    dst = torch.empty(src.shape, dtype=torch.uint8, device=device)
    ms = time_ms(lambda: dst.copy_(src, non_blocking=True), device, warm=2, reps=5)
    gbps = round(src.numel() / ms / 1e6, 2)
    return {"case": "sequential copy, 1 GiB", "records": 1, "ms": round(ms, 3), "GBps": gbps}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--host-gib", type=float, default=4.0, help="pinned buffer the records are drawn from")
    p.add_argument("--counts", default="65536,524288", help="records per launch (65536: one layer at batch 22)")
    p.add_argument("--spans-mib", default="16,256", help="smaller spans to draw 132-byte records from, MiB")
    p.add_argument("--name", default="host_records")
    add_results_dir_option(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        raise SystemExit("host_records needs a CUDA device: it times reads of pinned host memory over PCIe")
    from shadowkv_cache.ops.loader import host_device_pointer

    host = torch.randint(0, 256, (int(args.host_gib * (1 << 30)),), dtype=torch.uint8).pin_memory()
    address = host_device_pointer(host, device)
    rows = [copy_row(host, device)]
    log(rows[-1])
    for count in [int(c) for c in args.counts.split(",")]:
        for case in CASES:
            rows.append(case_row(host, address, case, count, device))
            log(rows[-1])
        rows.append(kernel_row(host, address, count, device))
        log(rows[-1])
        # Records drawn from a smaller span of the buffer: if the rate depends on it, translating addresses (not
        # bytes or requests) is what each record costs.
        for mib in [int(m) for m in args.spans_mib.split(",") if m]:
            for row in (
                case_row(host, address, CASES[5], count, device, mib << 20),
                kernel_row(host, address, count, device, mib << 20),
            ):
                rows.append({**row, "case": f"{row['case']}, {mib} MiB span"})
                log(rows[-1])
        free(device)
    sync(device)
    columns = ["case", "records", "span_mib", "record_bytes", "stride", "offset", "load_bytes", "lines", "sectors"]
    columns += ["ms", "GBps"]
    write_results(
        args.name,
        "Random records read from pinned host memory over PCIe",
        environment(str(device), "uint8"),
        rows,
        columns,
        {"x": "records", "y": "GBps", "series": "case"},
        notes=__doc__.split("\n\n")[1],
    )


if __name__ == "__main__":
    main()
