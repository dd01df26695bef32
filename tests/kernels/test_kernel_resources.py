"""benchmarks/kernel_resources.py: the longest loop of a kernel's SASS, counted from cuobjdump's listing."""

from __future__ import annotations

from benchmark_scripts import load_script

SASS = """
        code for sm_90
                Function : _kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_CTAID.X ;
        /*0020*/                   FFMA R2, R0, R0, R1 ;
        /*0030*/              @P0 BRA 0x70 ;
        /*0040*/                   FADD R2, R2, R2 ;
        /*0050*/                   FMUL R2, R2, R2 ;
        /*0060*/              @P1 BRA 0x40 ;
        /*0070*/                   LDG.E R3, desc[UR4][R4.64] ;
        /*0080*/                   FFMA R2, R3, R3, R2 ;
        /*0090*/                   SHFL.BFLY PT, R5, R2, 0x1, 0x1f ;
        /*00a0*/                   FADD R2, R2, R5 ;
        /*00b0*/              @P2 BRA 0x20 ;
        /*00c0*/                   EXIT ;
"""


def test_the_longest_backward_branch_counts_its_instructions():
    kr = load_script("kernel_resources")
    # the loop 0x20..0xb0 (10 instructions) holds a shorter one, 0x40..0x60 (3); 0x30 branches forward
    assert kr.longest_loop(SASS) == 10
    assert kr.longest_loop(SASS.replace("@P2 BRA 0x20", "@P2 BRA 0xc0")) == 3
    assert kr.longest_loop("") == 0


def test_barriers_are_counted_inside_the_longest_loop_only():
    kr = load_script("kernel_resources")
    sass = SASS.replace("FADD R2, R2, R5 ;", "BAR.SYNC.DEFER_BLOCKING 0x0 ;").replace(
        "MOV R1, c[0x0][0x28] ;", "BAR.SYNC.DEFER_BLOCKING 0x0 ;")  # one in the loop, one before it
    loop = kr.loop_instructions(sass)
    assert len(loop) == 10 and kr.barriers(loop) == 1  # (its BRA is no barrier)
    assert kr.barriers(kr.loop_instructions(SASS)) == 0
