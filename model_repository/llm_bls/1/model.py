"""`llm_bls`: the ensemble's route (TensorRT-LLM interface) written as BLS: `preprocessing`,
then `llm` streaming, detokenized incrementally here, with stop strings matched on text (the
stop string never reaches the client) and the upstream request cancelled when one hits.
See triton_glue/bls.py."""
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.bls import BlsRoute  # noqa: E402
from triton_glue.inputs import parse_trtllm_text_request  # noqa: E402


def _response(req, chunk):
    tensors = [pb_utils.Tensor("text_output", np.array([[chunk.text.encode("utf-8")]], dtype=np.object_))]
    if req.return_num_input_tokens:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array([[chunk.num_input_tokens]], dtype=np.int32)))
    if req.return_num_output_tokens:
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array([[chunk.num_output_tokens]], dtype=np.int32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


class TritonPythonModel:
    def initialize(self, args):
        self.route = BlsRoute.from_model_args(pb_utils, args, preprocessing=True, make_response=_response)

    def execute(self, requests):
        return self.route.execute(requests, lambda arrays, request: parse_trtllm_text_request(arrays))

    def finalize(self):
        self.route.close()
