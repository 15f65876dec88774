"""The one-token projection path's CPU-testable parts (layers/decode_gemv.py): the switch, the
unfused fallback that start-up tuning keeps where the fused kernel is slower (against the torch
reference), and bench.decode's --env-variant parsing that measures the modes side by side. The
Triton kernels themselves: tests/gpu/test_decode_gemv.py (also under Triton's interpreter)."""
import pytest
import torch
import torch.nn.functional as F

from backend_lib import envs
from backend_lib.layers import decode_gemv as dg
from engine_helpers import set_env


@pytest.mark.parametrize("raw,want", [(None, "on"), ("", "on"), ("off", "off"), ("0", "off"), ("ON", "on"),
                                      ("implicit", "implicit"), ("pdl", "pdl"), (" nopdl ", "nopdl")])
def test_switch_values(monkeypatch, raw, want):
    set_env(monkeypatch, envs.DECODE_GEMV_ENV, raw)
    assert envs.decode_gemv() == want


def test_switch_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv(envs.DECODE_GEMV_ENV, "fast")
    with pytest.raises(ValueError, match="BACKEND_LIB_DECODE_GEMV='fast': must be off, on, implicit, pdl or nopdl"):
        envs.decode_gemv()


@pytest.mark.parametrize("raw,want", [(None, "off"), ("", "off"), ("on", "on"), ("0", "off"), (" Force", "force")])
def test_one_kernel_mlp_switch_defaults_to_off(monkeypatch, raw, want):
    """BACKEND_LIB_DECODE_MLP: off unless asked for (it lost on the H100 on both shapes)."""
    set_env(monkeypatch, envs.DECODE_MLP_ENV, raw)
    assert envs.decode_mlp() == want


def test_off_installs_nothing():
    model = torch.nn.Linear(4, 4)
    assert dg.install(model, "off") is None
    assert not hasattr(model, "one_token_gemv")


def _linear(n, k, bias):
    lin = torch.nn.Linear(k, n, bias=bias)
    torch.nn.init.normal_(lin.weight, std=0.1)
    return lin


@pytest.mark.parametrize("prologue", [dg.PLAIN, dg.RMSNORM, dg.ADD_RMSNORM, dg.SILU_MUL])
def test_unfused_fallback_matches_the_reference(prologue):
    torch.manual_seed(0)
    k, n = 48, 20
    lin = _linear(n, k, bias=True)
    x = torch.randn(1, 2 * k if prologue == dg.SILU_MUL else k)
    res, ln = torch.randn(1, k), 1 + 0.1 * torch.randn(k)
    with torch.no_grad():
        got, got_res = dg.DecodeGemv().unfused(x, lin, prologue, res, ln, 1e-6)
        ref, ref_res = dg.gemv_ref(x, lin.weight, lin.bias, prologue=prologue, residual=res, ln_weight=ln)
    assert torch.equal(got, ref)
    assert (got_res is None) == (ref_res is None)
    if ref_res is not None:
        assert torch.equal(got_res, ref_res)


def test_unfused_fallback_rotates_and_writes_the_cache():
    torch.manual_seed(1)
    hq, hkv, d, k = 3, 1, 8, 32
    lin = _linear((hq + 2 * hkv) * d, k, bias=True)
    x, res, ln = torch.randn(1, k), torch.randn(1, k), torch.ones(k)
    ang = torch.arange(16).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    emb = torch.cat([ang, ang], -1)

    def rope():
        return dg.RopeKV(emb.cos(), emb.sin(), torch.tensor([9]), torch.zeros(2, 4, hkv, d),
                         torch.zeros(2, 4, hkv, d), torch.tensor([6]), hq, hkv, d)

    r1, r2 = rope(), rope()
    with torch.no_grad():
        y, _ = dg.DecodeGemv().unfused(x, lin, dg.ADD_RMSNORM, res, ln, 1e-6, r1)
        q_ref, v_ref, kc_ref, vc_ref, _ = dg.gemv_rope_ref(x, lin.weight, lin.bias, r2, prologue=dg.ADD_RMSNORM,
                                                           residual=res, ln_weight=ln)
    assert torch.allclose(y[:, :hq * d], q_ref)
    assert torch.allclose(y[:, (hq + hkv) * d:], v_ref)
    assert torch.equal(r1.k_cache, kc_ref) and torch.equal(r1.v_cache, vc_ref)
    assert r1.k_cache.view(-1, hkv * d)[6].abs().sum() > 0  # slot 6 written, the rest zero
    assert r1.k_cache.view(-1, hkv * d)[[0, 1, 2, 3, 4, 5, 7]].abs().sum() == 0


def test_env_variant_parsing():
    from bench.decode import parse_env_variant
    assert parse_env_variant("on:BACKEND_LIB_DECODE_GEMV=on,X=1") == ("on", {"BACKEND_LIB_DECODE_GEMV": "on", "X": "1"})
    assert parse_env_variant("plain:") == ("plain", {})
    for bad in ("noname", ":X=1", "a:X"):
        with pytest.raises(ValueError, match="--env-variant"):
            parse_env_variant(bad)
    import os
    os.environ.pop("DECODE_GEMV_TEST_VAR", None)
    with envs.overridden({"DECODE_GEMV_TEST_VAR": "1"}):
        assert os.environ["DECODE_GEMV_TEST_VAR"] == "1"
    assert "DECODE_GEMV_TEST_VAR" not in os.environ
