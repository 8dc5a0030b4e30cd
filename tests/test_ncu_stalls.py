"""benchmarks/ncu_stalls.py's readers of Nsight Compute's printed report and source page, and its record from kept
reports (no GPU, no ncu needed)."""

from __future__ import annotations

import json

import pytest

from benchmarks import ncu_stalls

REPORT = """[1658] python3.12@127.0.0.1
  code_states_mma_k8_g4 (528, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Throughput                   %        60.44
    Duration                    msecond         1.25
    ----------------------- ----------- ------------
    Section: Scheduler Statistics
    Issued Warp Per Scheduler                                  0.66
    No Eligible                                      %        33.91
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction             cycle         5.20
    Stall Long Scoreboard           inst         0.75
    Stall Not Selected              inst         1.09
    Stall Membar                    inst            0
    Section: Instruction Statistics
    Executed Instructions                           inst  309,516,724
    Issued Warp Per Scheduler                                  0.99
"""

SOURCE = """"Kernel Name","code_states_mma_k8_g4",
"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","Instructions Executed"
"0x0","      LDC R1, c[0x0][0x28]","20","0","2112"
"0x10","      STS.U16 [R42], R48","1718","1700","100"
"0x20","      @P0   STS.U16 [R42+0x300], R43","933","922","100"
"0x30","      LDS.64 R50, [R56]","1635","1615","4000"
"0x40","","0","0","0"
"""


def test_summary_metrics_keeps_first_values_in_microseconds_and_the_stall_reasons():
    got = ncu_stalls.summary_metrics(REPORT)
    assert got["duration_us"] == pytest.approx(1250.0)  # msecond -> µs
    assert got["dram_pct"] == 60.44 and got["no_eligible_pct"] == 33.91 and got["cycles_per_issue"] == 5.2
    assert got["issued_per_scheduler"] == 0.66  # the first of the two
    assert got["instructions"] == 309516724
    assert got["stall_long_scoreboard"] == 0.75 and got["stall_not_selected"] == 1.09 and got["stall_membar"] == 0


def test_summary_metrics_refuses_a_report_without_the_sections():
    with pytest.raises(SystemExit, match="--print-details all"):
        ncu_stalls.summary_metrics("    DRAM Throughput                   %        60.44\n")


def test_opcode_samples_sum_by_opcode_predicated_or_not():
    got = ncu_stalls.opcode_samples(SOURCE)
    assert got[0] == {"opcode": "STS", "samples": 1718 + 933, "long_scoreboard": 1700 + 922, "executed": 200}
    assert [r["opcode"] for r in got] == ["STS", "LDS", "LDC"]
    with pytest.raises(SystemExit, match="no header row"):
        ncu_stalls.opcode_samples('"Kernel Name","k",\n')
    with pytest.raises(SystemExit, match="SourceCounters"):
        ncu_stalls.opcode_samples('"Address","Source"\n"0x0","NOP"\n')


def test_kept_reports_make_a_record_without_ncu(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    for label, stall in (("base", "0.75"), ("new", "5.06")):
        (reports / f"{label}.txt").write_text(REPORT.replace("0.75", stall))
        (reports / f"{label}.csv").write_text(SOURCE)
    out = tmp_path / "results"
    argv = ["--reports", str(reports), "--sides", "base=a,new=b", "--made-on", "an H100 machine", "--name", "t"]
    ncu_stalls.main([*argv, "--results-dir", str(out)])
    record = json.loads((out / "t.json").read_text())
    assert [r["side"] for r in record["rows"]] == ["base", "new"]
    assert [r["stall_long_scoreboard"] for r in record["rows"]] == [0.75, 5.06]
    assert record["env"]["reports_made_on"] == "an H100 machine"
    assert record["opcodes"]["new"][0]["opcode"] == "STS"
    assert "stall_membar" not in record["stall_columns"]  # no side waited on it
    assert (out / "t.md").exists() and (out / "t.png").exists()


def test_reports_need_their_origin_and_runs_need_a_benchmark(tmp_path):
    with pytest.raises(SystemExit):
        ncu_stalls.main(["--reports", str(tmp_path)])  # no --made-on
    with pytest.raises(SystemExit):
        ncu_stalls.main(["--sides", "a=."])  # nothing to profile after --
