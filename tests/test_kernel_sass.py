"""benchmarks/kernel_sass.py's readers of ptxas reports and nvdisasm listings (no GPU, no nvdisasm needed)."""

from __future__ import annotations

import pytest

from benchmarks.kernel_sass import hot_loop, opcode, ptxas_figures

REPORT = """ptxas info    : Compiling entry function 'other' for 'sm_90'
ptxas info    : Used 40 registers, used 0 barriers, 0 bytes smem
ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
ptxas         .     8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 92 registers, used 1 barriers, 43264 bytes smem
"""

SASS = """//--------------------- .text.k --------------------------
        .section        .text.k,"ax",@progbits
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/                   IMMA.16832.S8.S8 R4, R8.ROW, R12.COL, R4 ;
.L_x_2:
        /*0030*/                   LDS R5, [R6] ;
        /*0040*/                   IMMA.16832.S8.S8 R4, R8.ROW, R12.COL, R4 ;
        /*0050*/              @!P0 BRA `(.L_x_2) ;
        /*0060*/                   SHFL.BFLY PT, R7, R7, 0x2, 0x1f ;
        /*0070*/              @!P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
        .section        .text.other,"ax",@progbits
"""


def test_ptxas_figures_reads_the_named_kernel():
    assert ptxas_figures(REPORT, "k") == {"registers": 92, "spill_bytes": 8, "smem_bytes": 43264}
    assert ptxas_figures(REPORT, "other")["registers"] == 40
    with pytest.raises(SystemExit, match="no kernel named 'missing'"):
        ptxas_figures(REPORT, "missing")


def test_hot_loop_is_the_innermost_loop_with_a_hot_instruction():
    loop = hot_loop(SASS, "k", "IMMA")
    assert [opcode(x) for x in loop] == ["LDS", "IMMA", "BRA"]  # .L_x_2's body, not the outer loop's
    assert [opcode(x) for x in hot_loop(SASS, "k", "SHFL")] == ["LDS", "IMMA", "LDS", "IMMA", "BRA", "SHFL", "BRA"]
    assert hot_loop(SASS, "k", "HMMA") == []
    with pytest.raises(SystemExit, match="no kernel named"):
        hot_loop(SASS, "nope", "IMMA")
