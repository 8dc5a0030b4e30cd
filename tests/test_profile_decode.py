"""`benchmarks/profile_decode.py`: what it derives from the profiler's kernel table."""

from __future__ import annotations

from benchmarks.profile_decode import host_time
from benchmarks.timeline import FETCH_KERNELS, merged, overlap_length, timeline_summary


def test_timeline_merges_kernel_intervals_into_busy_idle_and_the_hidden_share_of_the_fetch():
    """Busy time is the union of kernel intervals (overlaps counted once), idle the rest of the span; the fetch's hidden
    part is where another kernel ran beside it, per step."""
    kernels = [
        ("attend_split", 0.0, 10.0),
        ("gather_values_higgs4_warp_bf16", 5.0, 25.0),  # 5 us beside attend_split, 5 beside rebuild
        ("rebuild_missed_bfloat16_d128", 20.0, 30.0),
        ("select_topk_regs", 40.0, 50.0),  # 30..40 idle
        ("gather_dequant_higgs4", 60.0, 70.0),  # YAKV's fetch: nothing beside it
    ]
    got = timeline_summary(kernels, steps=2)
    assert got["span_ms"] == round(70 / 2e3, 3)
    assert got["busy_ms"] == round(50 / 2e3, 3)
    assert got["idle_ms"] == round(20 / 2e3, 3)
    assert got["kernels_per_step"] == 2.5
    assert got["fetch_ms"] == round(30 / 2e3, 3)
    assert got["hidden_ms"] == round(10 / 2e3, 3)
    assert got["hidden_share"] == round(10 / 30, 3)
    # Idle gaps by the kernels either side: 30..40 after the rebuild (which ended last), 50..60 after the top-k.
    assert got["gaps"] == [
        dict(after="rebuild_missed_bfloat16_d128", before="select_topk_regs", per_step=0.5, ms_per_step=0.005),
        dict(after="select_topk_regs", before="gather_dequant_higgs4", per_step=0.5, ms_per_step=0.005),
    ]
    no_fetch = timeline_summary([k for k in kernels if not k[0].startswith(FETCH_KERNELS)], steps=1)
    assert no_fetch["fetch_ms"] is None and no_fetch["hidden_share"] is None
    assert timeline_summary([], steps=3) is None
    sample = timeline_summary([(*k, 7) for k in kernels], steps=2, sample=2)["sample"]
    assert sample == [
        dict(name="gather_values_higgs4_warp_bf16", start_us=0.0, us=20.0, stream=7),
        dict(name="rebuild_missed_bfloat16_d128", start_us=15.0, us=10.0, stream=7),
    ]


def test_overlap_of_two_unions_counts_each_instant_once():
    a = merged([(0.0, 4.0), (2.0, 6.0), (10.0, 12.0)])
    assert a == [(0.0, 6.0), (10.0, 12.0)]
    b = merged([(5.0, 11.0)])
    assert overlap_length(a, b) == 2.0
    assert overlap_length(a, []) == 0.0


def test_generate_host_time_parts_work_from_waits_and_counts_launches():
    """Per step: the host's op and runtime-call time without the waits for the device, the waits, the launches (kernels
    and graphs), and the top rows by self time, waits left out."""
    rows = [
        ("aten::cat", 300.0, 6),
        ("cudaLaunchKernel", 600.0, 60),
        ("cudaGraphLaunch", 30.0, 3),
        ("cudaStreamSynchronize", 9000.0, 6),
        ("aten::argmax", 90.0, 3),
    ]
    got = host_time(rows, steps=3, wall_ms=20.0)
    assert got["wall_ms"] == 20.0
    assert got["host_ms"] == round((300 + 600 + 30 + 90) / 1e3 / 3, 3)
    assert got["wait_ms"] == 3.0
    assert got["launches"] == 21.0
    assert [r["name"] for r in got["top"]] == ["cudaLaunchKernel", "aten::cat", "aten::argmax", "cudaGraphLaunch"]
    assert got["top"][0] == dict(name="cudaLaunchKernel", ms_per_step=0.2, calls_per_step=20.0)
