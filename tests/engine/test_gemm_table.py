"""The projections' GEMM dispatch (models/llama.py Projection, layers/skinny_gemm.py) on CPU:
the switch that turns the skinny path on, and a table routed through every projection of a
real engine. The Triton kernel itself is tested on the GPU (tests/gpu/test_skinny_gemm.py)."""
import pytest
import torch.nn.functional as F

from backend_lib import envs
from backend_lib.layers import skinny_gemm
from engine_helpers import greedy, make_engine, set_env


@pytest.mark.parametrize("raw,want", [(None, "on"), ("", "on"), ("0", "off"), ("off", "off"), ("1", "on"), ("on", "on"),
                                      ("force", "force"), (" FORCE ", "force")])
def test_switch_values(monkeypatch, raw, want):
    set_env(monkeypatch, envs.SKINNY_GEMM_ENV, raw)
    assert envs.skinny_gemm() == want


def test_switch_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv(envs.SKINNY_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="BACKEND_LIB_SKINNY_GEMM='fast': must be off, on or force"):
        envs.skinny_gemm()


class _RecordingTable:
    """Stands in for SkinnyGemmTable: the same function as F.linear, records (M, N, K)."""

    def __init__(self):
        self.calls = []

    def linear(self, x, w, b):
        self.calls.append((x.shape[0], w.shape[0], w.shape[1], b is not None))
        return F.linear(x, w, b)


def test_table_routes_every_projection(tiny_llama_path):
    prompts = [[5, 6, 7, 8, 9], [300, 301]]
    plain = make_engine(tiny_llama_path).generate(prompts, greedy(6, ignore_eos=True))
    eng = make_engine(tiny_llama_path)
    assert eng.runner.gemm_table is None  # off by default, and never on CPU
    model = eng.runner.model
    table = _RecordingTable()
    model.set_gemm_table(table)
    outs = eng.generate(prompts, greedy(6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    s = model.shape
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes = {(n, k) for _, n, k, _ in table.calls}
    assert shapes == {(q + 2 * kv, s.hidden_size), (s.hidden_size, q), (2 * s.intermediate_size, s.hidden_size),
                      (s.hidden_size, s.intermediate_size), (s.vocab_size, s.hidden_size)}
    # Decode steps of both requests: M = 2 rows through every projection.
    assert (2, s.vocab_size, s.hidden_size, False) in table.calls
    per_step = len(model.layers) * 4 + 1
    assert len(table.calls) >= 6 * per_step
    model.set_gemm_table(None)
    assert all(p.gemm is None for p in model.projections())


def test_install_off_is_nothing(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    assert skinny_gemm.install(eng.runner.model, [1, 2], "off") is None
    assert all(p.gemm is None for p in eng.runner.model.projections())


def test_time_candidates_times_each_and_leaves_out_the_rejected(monkeypatch):
    """The start-up tuners' loop: the reference under None, each candidate's own call, and a
    configuration whose call raises (the compiler rejects it) left out, not fatal."""
    timed = []

    def fake_time(fn, x, copies):
        us = fn(x, None, None)  # the call itself: a number here
        timed.append(us)
        return us

    monkeypatch.setattr(skinny_gemm, "time_linear_us", fake_time)

    def make_call(cfg):
        def call(_x, _w, _b):
            if cfg == "bad":
                raise RuntimeError("out of shared memory")
            return {"a": 3.0, "b": 1.5}[cfg]
        return call

    times = skinny_gemm.time_candidates(lambda _x, _w, _b: 2.0, make_call, ["a", "bad", "b"], None, [], "test")
    assert times == {None: 2.0, "a": 3.0, "b": 1.5}
    assert timed == [2.0, 3.0, 1.5]
    assert min(times, key=times.get) == "b"
