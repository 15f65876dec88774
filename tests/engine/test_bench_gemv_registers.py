"""bench/gemv_registers.py without Triton: resident programs from registers, and ptxas's report."""
from bench import gemv_registers as gr


def test_programs_an_sm_follow_registers_in_warp_units():
    assert gr.programs_per_sm(255, 4) == 2     # 255 -> 256 a thread: 32 K registers a program
    assert gr.programs_per_sm(159, 4) == 3     # 160 a thread: 20 K a program
    assert gr.programs_per_sm(128, 4) == 4
    assert gr.programs_per_sm(227, 8) == 1
    assert gr.programs_per_sm(24, 4) == 16     # 2048 threads an SM (registers would allow 21)
    assert gr.programs_per_sm(16, 1) == 32     # 32 blocks an SM


def test_ptxas_report_gives_registers_and_spills():
    text = ("ptxas info    : Compiling entry function '_gemv_kernel' for 'sm_90a'\n"
            "ptxas info    : Function properties for _gemv_kernel\n"
            "    0 bytes stack frame, 76 bytes spill stores, 76 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 392 bytes cmem[0]\n")
    assert gr.parse_ptxas(text) == (255, 76)
    assert gr.parse_ptxas("ptxas info    : Used 159 registers, 392 bytes cmem[0]\n") == (159, 0)
