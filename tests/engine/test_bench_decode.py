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
