"""A broken checkpoint or tokenizer folder is reported in one line that names the file or folder
and the problem (not safetensors' or the hub client's generic text)."""
from __future__ import annotations

import shutil

import pytest

from backend_lib import EngineConfig, LLMEngine
from triton_glue.config import load_tokenizer, resolve_tokenizer_path


@pytest.fixture()
def broken(tmp_path, tiny_llama_path):
    def copy(name: str):
        d = tmp_path / name
        shutil.copytree(tiny_llama_path, d)
        return d
    return copy


def _one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


def test_truncated_safetensors_names_the_file(broken):
    d = broken("trunc")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig(model_path=str(d)))
    msg = _one_line_error(e)
    assert msg.startswith(f"{d / 'model.safetensors'}: unreadable safetensors file, truncated or corrupt"), msg


def test_corrupt_safetensors_header_names_the_file(broken):
    d = broken("corrupt")
    with open(d / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig(model_path=str(d)))
    assert str(d / "model.safetensors") in _one_line_error(e)


def test_folder_without_config_json(broken):
    d = broken("noconfig")
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match=r"has no config.json"):
        LLMEngine(EngineConfig(model_path=str(d)))


def test_typo_in_tokenizer_path_names_the_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("MODEL_PATH", raising=False)
    monkeypatch.setenv("TOKENIZER_PATH", str(tmp_path / "tiny-lama"))
    with pytest.raises(ValueError) as e:
        load_tokenizer({"parameters": {}})
    msg = _one_line_error(e)
    assert msg == f"tokenizer folder {tmp_path / 'tiny-lama'} does not exist (from TOKENIZER_PATH)"
    assert "Repo id" not in msg
    monkeypatch.delenv("TOKENIZER_PATH")
    with pytest.raises(ValueError, match=r"tokenizer folder .*models/no-such-model does not exist "
                                         r"\(from the tokenizer_path/model_path parameter\)"):
        load_tokenizer({"parameters": {"tokenizer_path": {"string_value": "models/no-such-model"}}})


def test_folder_without_tokenizer_files(monkeypatch, broken):
    d = broken("notok")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink()
    monkeypatch.delenv("TOKENIZER_PATH", raising=False)
    monkeypatch.setenv("MODEL_PATH", str(d))
    with pytest.raises(ValueError) as e:
        load_tokenizer({"parameters": {}})
    msg = _one_line_error(e)
    assert msg.startswith(f"tokenizer folder {d} has no tokenizer files") and "from MODEL_PATH" in msg
    assert "TOKENIZER_PATH" in msg and "sentencepiece" not in msg


def test_tokenizer_path_separate_from_model_path(monkeypatch, broken, tiny_llama_path):
    """MODEL_PATH points at weights without a tokenizer; TOKENIZER_PATH at the tokenizer."""
    d = broken("weights-only")
    (d / "tokenizer.json").unlink()
    monkeypatch.setenv("MODEL_PATH", str(d))
    monkeypatch.setenv("TOKENIZER_PATH", str(tiny_llama_path))
    assert resolve_tokenizer_path("models/tiny-llama") == str(tiny_llama_path)
    tok = load_tokenizer({"parameters": {"model_path": {"string_value": "models/tiny-llama"}}})
    assert tok.name_or_path == str(tiny_llama_path) and tok.decode(tok.encode("Hello world")) == "Hello world"
    monkeypatch.delenv("TOKENIZER_PATH")
    assert resolve_tokenizer_path("models/tiny-llama") == str(d)  # MODEL_PATH still moves both
