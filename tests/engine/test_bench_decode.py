"""bench.decode's --max-model-len: the engine it builds takes that max_model_len (a served
model's: the decode graphs' block tables, and with them the split attention's grid, widen with
it), while the KV cache stays sized for what the run needs; without it, the least the run needs."""

import json

import pytest

import backend_lib
from bench import decode


@pytest.fixture
def built(monkeypatch):
    """The engines bench.decode builds, recorded."""
    engines = []
    real = backend_lib.LLMEngine

    def recording(cfg):
        eng = real(cfg)
        engines.append(eng)
        return eng

    monkeypatch.setattr(backend_lib, "LLMEngine", recording)
    return engines


def _run(tmp_path, *extra):
    out = tmp_path / "d.json"
    assert decode.main(["--impls", "async", "--batches", "2", "--prompt-len", "16", "--output-len", "4",
                        "--out-dir", str(tmp_path), "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_max_model_len_widens_the_block_tables_not_the_cache(tmp_path, built):
    meta = _run(tmp_path, "--max-model-len", "1024")["meta"]
    (eng,) = built
    assert eng.max_model_len == 1024
    assert eng.runner.max_blocks_per_seq == 1024 // 16
    # a 1024-token sequence fits, and no more than that plus the run's own blocks is allocated
    assert 1024 // 16 + 1 <= eng.runner.num_kv_blocks <= 1024 // 16 + 1 + 8
    assert meta["max_model_len"] == 1024


def test_without_it_the_engine_holds_only_what_the_run_needs(tmp_path, built):
    meta = _run(tmp_path)["meta"]
    (eng,) = built
    assert eng.max_model_len == 48   # prompt 16 + output 4 + a block of 16, rounded up to whole blocks
    assert eng.runner.num_kv_blocks == 2 * (48 // 16) + 8
    assert meta["max_model_len"] == "prompt + output + a block"


def test_prefill_steps_capture_no_mixed_graphs(tmp_path, built):
    """Its prefill steps are not timed: the engine captures decode graphs only (mixed-step
    graphs up to the one-step prefill budget would be the bulk of an 8B engine's start)."""
    _run(tmp_path)
    (eng,) = built
    assert eng.config.enable_cuda_graph and not eng.config.cuda_graph_mixed


def _engine_with_picks(configs, timings):
    """An engine as gemv_picks reads it: its runner's tuned decode_gemv table and a bf16 model."""
    import types

    import torch
    table = types.SimpleNamespace(configs=configs, timings=timings)
    model = torch.nn.Linear(2, 2, dtype=torch.bfloat16)
    return types.SimpleNamespace(runner=types.SimpleNamespace(one_token_gemv=table, model=model))


def test_the_projections_picks_name_each_shape_and_its_share_of_the_copy_bandwidth():
    """bench.decode reports the tuner's pick for each one-token projection (the H200 question:
    does a tile with more weight in flight win its q/k/v?), with the fastest candidate of each
    kind beside it; a pick kept from an earlier tuning has no times to report."""
    from backend_lib.layers.decode_gemv import ADD_RMSNORM, PLAIN, SILU_MUL, GemvConfig
    plain, split = GemvConfig(8, 1024, 4), GemvConfig(8, 512, 4, 4)
    chunked = GemvConfig(8, 512, 4, ahead=2, norm_block=1024)
    qkv, o_proj = (ADD_RMSNORM, 6144, 4096, False, True), (PLAIN, 4096, 4096, False, False)
    gate_up, down = (ADD_RMSNORM, 28672, 4096, False, False), (SILU_MUL, 4096, 14336, False, False)
    eng = _engine_with_picks({qkv: chunked, o_proj: split, gate_up: plain, down: None},
                             {qkv: {None: 30.0, plain: 17.5, chunked: 15.0},
                              o_proj: {None: 15.0, plain: 12.0, split: 10.0},
                              down: {None: 40.0, plain: 41.0}})
    picks = decode.gemv_picks(eng, 4.0e12)
    assert [(p["proj"], p["pick"]) for p in picks] == [
        ("qkv", "8x512 w4 ahead 2 norm 1024"), ("o_proj", "8x512 w4 split 4"), ("gate_up", "8x1024 w4"),
        ("down", "unfused (op + cuBLAS)")]
    q, o, g, d = picks
    assert q["us"] == 15.0 and q["unfused_us"] == 30.0
    assert abs(q["of_copy"] - 6144 * 4096 * 2 / 15e-6 / 4.0e12) < 1e-9
    assert q["best_plain"] == {"tile": "8x1024 w4", "us": 17.5} and q["best_ahead"]["us"] == 15.0
    assert "best_split_k" not in q and o["best_split_k"] == {"tile": "8x512 w4 split 4", "us": 10.0}
    assert g == {"proj": "gate_up", "prologue": "add+rmsnorm", "n": 28672, "k": 4096, "pick": "8x1024 w4",
                 "kept": True}
    assert d["us"] == 40.0 and d["unfused_us"] == 40.0
    assert decode.pick_line(q) == ("decode gemv qkv (add+rmsnorm) 6144 x 4096: 8x512 w4 ahead 2 norm 1024, "
                                   "15.00 µs, 0.84 of copy; unfused 30.00; best plain 8x1024 w4 17.50; "
                                   "best ahead 8x512 w4 ahead 2 norm 1024 15.00")
    assert decode.pick_line(g) == "decode gemv gate_up (add+rmsnorm) 28672 x 4096: 8x1024 w4 (kept from an earlier tuning)"


def test_an_engine_without_the_kernel_reports_no_picks(tmp_path, built):
    """On CPU the one-token projections are torch's: no picks, and the rows carry none."""
    data = _run(tmp_path)
    assert decode.gemv_picks(built[0], None) == []
    assert all("gemv_picks" not in r["extra"] for r in data["rows"])
