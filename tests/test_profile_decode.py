"""`benchmarks/profile_decode.py`: what it derives from the profiler's kernel table."""

from __future__ import annotations

from benchmarks.profile_decode import fetch_overlap


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
