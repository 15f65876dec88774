"""model_repository/postprocessing/1/model.py on stand-ins for Triton's requests: TensorRT-LLM's
token batches (TOKENS_BATCH [B, beams, N]) -> one string per sequence."""
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tokenizers_for_tests import llama_like  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, array): self._name, self._array = name, np.asarray(array)
        def name(self): return self._name
        def as_numpy(self): return self._array

    class TritonError:
        def __init__(self, message, code=None): self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None): self.output_tensors, self.error = output_tensors or [], error

    def get_input_tensor_by_name(request, name):
        return Tensor(name, request[name]) if name in request else None

    pb.Tensor, pb.TritonError, pb.InferenceResponse = Tensor, TritonError, InferenceResponse
    pb.get_input_tensor_by_name = get_input_tensor_by_name
    return pb


@pytest.fixture
def postprocessing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    # keep_torch_out() at import would hide torch from the rest of this test process
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch"))
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    spec = importlib.util.spec_from_file_location("postprocessing_under_test",
                                                  ROOT / "model_repository/postprocessing/1/model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m = mod.TritonPythonModel()  # initialize() would load the checkpoint's tokenizer
    m.tokenizer, m.skip = llama_like(), True
    return m


def _texts(m, request):
    (resp,) = m.execute([request])
    assert resp.error is None, resp.error.message
    (out,) = resp.output_tensors
    assert out.name() == "OUTPUT"
    return out.as_numpy()


@pytest.mark.parametrize("shape", [(1, 1, 0), (2, 1, 0), (2, 3, 0), (2, 0)])
def test_an_empty_chunk_gives_empty_text_per_sequence(postprocessing, shape):
    """`llm`'s abort FINAL carries no new tokens; the ensemble stream must still get its FINAL."""
    batch, beams = shape[0], (shape[1] if len(shape) == 3 else 1)
    request = {"TOKENS_BATCH": np.zeros(shape, np.int32),
               "SEQUENCE_LENGTH": np.zeros((batch, beams), np.int32)}
    out = _texts(postprocessing, request)
    assert out.shape == (batch * beams,) and out.tolist() == [b""] * (batch * beams)
    # as `llm` sends it in an ensemble: with the tokens before the chunk and a finish reason
    tok = llama_like()
    prefix = tok.encode("Hello world", add_special_tokens=False)
    request.update(PREFIX_IDS=np.array([prefix] * batch, np.int32),
                   FINISH_REASON=np.array([[b"abort"]] * batch, np.object_))
    assert _texts(postprocessing, request).tolist() == [b""] * (batch * beams)


def test_a_chunk_decodes_per_sequence(postprocessing):
    tok = llama_like()
    ids = [tok.encode(t, add_special_tokens=False) for t in ("Hello world", "The quick brown fox")]
    n = max(map(len, ids))
    toks = np.array([[i + [0] * (n - len(i))] for i in ids], np.int32)  # [2, 1, n], padded
    out = _texts(postprocessing, {"TOKENS_BATCH": toks,
                                  "SEQUENCE_LENGTH": np.array([[len(i)] for i in ids], np.int32)})
    assert [o.decode() for o in out] == ["Hello world", "The quick brown fox"]
