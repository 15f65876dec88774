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
