"""`benchmarks/profile_decode.py`: what it derives from the profiler's kernel table."""

from __future__ import annotations

from benchmarks.profile_decode import fetch_overlap, host_time


def test_profile_reports_the_share_of_the_fetch_hidden_beside_other_kernels():
    """Device time summed over kernels less the step's wall time is time kernels overlapped; over the fetch's own time
    it is the share of the fetch hidden (at most all of it), and nothing without a fetch kernel."""
    kernels = [
        dict(name="all device time", ms_per_step=59.0),
        dict(name="gather_values_higgs4_warp_bf16", ms_per_step=14.0),
        dict(name="attend_split", ms_per_step=5.5),
    ]
    assert fetch_overlap(kernels, 47.0) == dict(fetch_ms=14.0, overlap_ms=12.0, hidden_share=round(12 / 14, 3))
    assert fetch_overlap(kernels, 60.0)["hidden_share"] == 0.0  # idle gaps: no overlap seen
    assert fetch_overlap(kernels, 40.0)["hidden_share"] == 1.0
    assert fetch_overlap(kernels[:1] + kernels[2:], 47.0) is None


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
