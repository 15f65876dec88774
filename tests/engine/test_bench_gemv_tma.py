"""bench/gemv_tma.py without a GPU: the shapes it times, the TMA boxes it may ask for, and the
table's best-of-family cells. The kernel itself: tests/gpu/test_gemv_tma.py."""
from bench import gemv_tma


def test_projections_are_the_layer_shapes_and_the_lm_head():
    assert gemv_tma.projections("llama-3-8b") == [("qkv", 6144, 4096), ("o_proj", 4096, 4096),
                                                  ("gate_up", 28672, 4096), ("down", 4096, 14336),
                                                  ("lm_head", 128256, 4096)]
    assert dict((n, (a, b)) for n, a, b in gemv_tma.projections("qwen2.5-0.5b"))["lm_head"] == (151936, 896)


def test_configs_fit_a_tma_box_and_shared_memory():
    assert gemv_tma.TMA_CONFIGS
    for c in gemv_tma.TMA_CONFIGS:
        assert c.block_n <= 256 and c.block_k <= 256               # a TMA box: at most 256 a dimension
        assert c.block_n * c.block_k * 2 * c.stages <= 227 * 1024  # bf16 stages within sm_90's shared memory a block


def test_table_takes_each_familys_fastest_with_and_without_pdl():
    def row(variant, us):
        return dict(proj="down", n=4096, k=14336, variant=variant, us=us, of_copy=4096 * 14336 * 2 / (us * 1e-6) / 3e12)
    rows = [row("cuBLAS", 40.0), row("gemv 8x1024 w4", 35.0), row("gemv 16x512 w4", 33.0),
            row("gemv 8x1024 w4 pdl", 31.0), row("tma 16x256 s4 w4", 34.0), row("tma 32x256 s6 w4", 36.0),
            row("tma 16x256 s4 w4 pdl", 30.5)]
    text = gemv_tma.table(rows)
    assert ("| down | 4096 x 14336 | 40.00 (0.98) | 33.00 (1.19) | 31.00 (1.26) | 34.00 (1.15) | 30.50 (1.28) "
            "| tma 16x256 s4 w4 pdl |") in text
