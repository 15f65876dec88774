"""models/hf_config.py reads config.json without transformers: every field the engine reads equals
what transformers' AutoConfig gives, on the repository's models and on configs that leave each
such field out (the config class's default) or set it to null; the cases it does not handle go
to AutoConfig; llama3 rope frequencies equal transformers' own; an engine starts without
importing transformers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backend_lib.layers.rotary import compute_inv_freq
from backend_lib.models.hf_config import CheckpointConfig, load_hf_config
from backend_lib.models.llama import ModelShape

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
# What the engine reads of a config (ModelShape, rotary, the eos fallback), beside the shape.
READ = ("num_key_value_heads", "head_dim", "max_position_embeddings", "eos_token_id", "tie_word_embeddings",
        "rms_norm_eps", "vocab_size")
OPTIONAL = ("vocab_size", "intermediate_size", "num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias",
            "mlp_bias", "tie_word_embeddings", "max_position_embeddings", "rope_theta", "eos_token_id")
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
         "vocab_size": 128, "max_position_embeddings": 512}


def _write(tmp_path: Path, cfg: dict) -> str:
    d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _assert_same(path: str):
    try:
        ref = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers refuses the file (a null its class validates)
        pytest.skip(f"transformers refuses this config: {e}")
    mine = load_hf_config(path)
    assert isinstance(mine, CheckpointConfig)
    assert ModelShape.from_hf_config(mine) == ModelShape.from_hf_config(ref)
    for name in READ:
        assert getattr(mine, name, None) == getattr(ref, name, None), name
    assert mine.rope_parameters == {k: v for k, v in ref.rope_parameters.items()}
    head_dim = ModelShape.from_hf_config(ref).head_dim
    for a, b in zip(compute_inv_freq(mine, head_dim), compute_inv_freq(ref, head_dim)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-llama-sharded"])
def test_repository_models_read_as_transformers_reads_them(model):
    if not (MODELS / model / "config.json").exists():
        pytest.skip(f"no {model}: run `make model`")
    _assert_same(str(MODELS / model))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("field,how", [(f, "absent") for f in OPTIONAL]
                         + [("num_key_value_heads", "null"), ("head_dim", "null")])  # nulls the classes derive
def test_a_missing_field_gets_the_config_class_value(tmp_path, model_type, field, how):
    cfg = dict(SMALL, model_type=model_type, num_key_value_heads=2, head_dim=16, rope_theta=5e5, eos_token_id=7)
    if how == "absent":
        cfg.pop(field, None)
    else:
        cfg[field] = None
    _assert_same(_write(tmp_path, cfg))


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, "rope_theta": 5e5},
    {"rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128}},
    {"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                         "original_max_position_embeddings": 256, "rope_theta": 1e6}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
])
def test_rope_parameters_and_frequencies_equal_transformers(tmp_path, rope):
    _assert_same(_write(tmp_path, dict(SMALL, model_type="llama", **rope)))


def test_llama3_frequencies_equal_transformers_rope_init():
    cfg = AutoConfig.for_model("llama", **SMALL, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}, rope_theta=5e5)
    ref, ref_scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    inv, scale = compute_inv_freq(cfg, 16)
    assert torch.equal(inv, ref.float()) and scale == ref_scale


@pytest.mark.parametrize("cfg", [
    dict(SMALL, model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(SMALL, model_type="gpt2"),
])
def test_other_configs_go_to_autoconfig(tmp_path, cfg):
    got = load_hf_config(_write(tmp_path, cfg))
    assert not isinstance(got, CheckpointConfig) and got.model_type == cfg["model_type"]


@pytest.mark.parametrize("field,value", [("hidden_size", "64"), ("num_attention_heads", 0),
                                         ("vocab_size", None), ("num_hidden_layers", True)])
def test_a_malformed_size_is_named(tmp_path, field, value):
    path = _write(tmp_path, dict(SMALL, model_type="llama", **{field: value}))
    with pytest.raises(ValueError, match=f"^model_path .*: config.json: {field} must be a positive integer"):
        load_hf_config(path)


def test_a_llama3_rope_missing_keys_gets_transformers_error(tmp_path):
    path = _write(tmp_path, dict(SMALL, model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(KeyError, match="Missing required keys in `rope_parameters`"):
        load_hf_config(path)


def test_errors_name_the_folder(tmp_path):
    with pytest.raises(ValueError, match="is not a local checkpoint folder"):
        load_hf_config(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting ',' delimiter"):
        load_hf_config(str(tmp_path))


def test_an_engine_starts_without_importing_transformers():
    code = ("import sys, torch; torch.set_num_threads(1)\n"
            "from backend_lib import EngineConfig, SamplingParams\n"
            "from backend_lib.engine import LLMEngine\n"
            f"e = LLMEngine(EngineConfig(model_path={str(MODELS / 'tiny-llama')!r}, device='cpu', dtype='float32',"
            " max_num_seqs=2, max_model_len=64))\n"
            "out = e.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))\n"
            "print(len(out[0].token_ids), e.eos_token_ids, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["3", "(2,)", "[]"], r.stdout
