"""bench/gemv_shapes.py without a GPU: the projections it times per preset, and its table."""
from bench import gemv_shapes


def test_projections_are_the_presets_layer_shapes():
    qwen = {p[0]: p[1:] for p in gemv_shapes.projections("qwen2.5-0.5b")}
    assert qwen == {"qkv": (2, 1152, 896, True, True), "o_proj": (0, 896, 896, False, False),
                    "gate_up": (2, 9728, 896, False, False), "down": (3, 896, 4864, False, False)}
    llama = {p[0]: p[1:] for p in gemv_shapes.projections("llama-3-8b")}
    assert llama == {"qkv": (2, 6144, 4096, False, True), "o_proj": (0, 4096, 4096, False, False),
                     "gate_up": (2, 28672, 4096, False, False), "down": (3, 4096, 14336, False, False)}


def test_rows_give_the_weight_bandwidth_and_mark_the_chosen_tile():
    from backend_lib.layers.decode_gemv import GemvConfig
    split = GemvConfig(8, 512, 4, 4)
    times = {None: 5.0, GemvConfig(8, 1024, 4): 4.0, split: 2.5}
    rows = gemv_shapes.rows_for("down", 896, 4864, 3, times, split, 2, 4e12)
    assert [r["variant"] for r in rows] == ["8x512 w4 split 4", "8x1024 w4", "unfused (op + cuBLAS)"]
    assert [r["chosen"] for r in rows] == [True, False, False]
    assert abs(rows[0]["tb_s"] - 896 * 4864 * 2 / 2.5e-6 / 1e12) < 1e-9
    assert abs(rows[0]["of_copy"] - rows[0]["tb_s"] / 4) < 1e-9
    text = gemv_shapes.table(rows)
    assert "| down (silu*mul) | 896 x 4864 | 8x512 w4 split 4 | 2.50 | 3.49 | 0.87 | **yes** |" in text


def test_a_norm_chunked_tile_is_labelled_with_its_chunk():
    from backend_lib.layers.decode_gemv import NORM_AHEAD_CANDIDATES, GemvConfig
    chunked = GemvConfig(8, 512, 4, ahead=2, norm_block=1024)
    assert chunked in NORM_AHEAD_CANDIDATES
    rows = gemv_shapes.rows_for("qkv", 6144, 4096, 2, {None: 30.0, chunked: 15.0}, chunked, 2, 4e12)
    assert [r["variant"] for r in rows] == ["8x512 w4 ahead 2 norm 1024", "unfused (op + cuBLAS)"]
