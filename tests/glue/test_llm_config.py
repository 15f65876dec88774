"""model_repository/llm/config.pbtxt exposes every EngineConfig field as a parameter, and its
values build a valid EngineConfig (the one-to-one mapping the llm model relies on)."""
import re
from pathlib import Path

from backend_lib import EngineConfig
from backend_lib.config import engine_parameter_names

PBTXT = Path(__file__).resolve().parents[2] / "model_repository" / "llm" / "config.pbtxt"


def _parameters() -> dict[str, str]:
    return dict(re.findall(r'parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', PBTXT.read_text()))


def test_every_engine_field_is_a_parameter():
    params = _parameters()
    assert [n for n in engine_parameter_names() if n not in params] == []


def test_parameters_build_the_engine_config():
    cfg = EngineConfig.from_parameters(_parameters())
    assert cfg.async_token_handoff == "auto"
    assert cfg.pipeline_parallel_size == 1
    assert cfg.load_format == "safetensors"


def test_environment_overrides_parameters(monkeypatch):
    """LLM_PARAM_<name> changes an llm parameter without editing config.pbtxt."""
    from triton_glue.config import engine_config, glue_parameter

    config = {"parameters": {k: {"string_value": v} for k, v in _parameters().items()}}
    assert engine_config(config).max_num_seqs == 64
    monkeypatch.setenv("LLM_PARAM_max_num_seqs", "32")
    monkeypatch.setenv("LLM_PARAM_ENABLE_CHUNKED_PREFILL", "false")   # any case
    monkeypatch.setenv("LLM_PARAM_stream_coalesce", "off")            # a glue parameter
    cfg = engine_config(config)
    assert (cfg.max_num_seqs, cfg.enable_chunked_prefill) == (32, False)
    assert glue_parameter(config, "stream_coalesce") == "off"


def test_environment_override_errors_name_the_variable(monkeypatch):
    import pytest

    from triton_glue.config import engine_config

    config = {"parameters": {k: {"string_value": v} for k, v in _parameters().items()}}
    monkeypatch.setenv("LLM_PARAM_max_num_seq", "32")
    with pytest.raises(ValueError, match=r"LLM_PARAM_max_num_seq: 'max_num_seq' is not a parameter"):
        engine_config(config)
    monkeypatch.delenv("LLM_PARAM_max_num_seq")
    monkeypatch.setenv("LLM_PARAM_max_num_seqs", "lots")
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config(config)


def test_readme_documents_every_parameter():
    """README's LLM_PARAM table lists every llm parameter (EngineConfig fields + glue)."""
    from triton_glue.config import GLUE_PARAMETERS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("#### Engine settings without editing config.pbtxt", 1)[1].split("\n### ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert documented == set(engine_parameter_names()) | set(GLUE_PARAMETERS)
