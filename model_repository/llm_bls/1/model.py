"""`llm_bls`: the ensemble's route (TensorRT-LLM interface) written as BLS: `preprocessing`,
then `llm` streaming, detokenized incrementally here, with stop strings matched on text (the
stop string never reaches the client) and the upstream request cancelled when one hits.
See triton_glue/bls.py."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue import config as glue_config  # noqa: E402
from triton_glue.bls import BlsRoute  # noqa: E402
from triton_glue.inputs import InputError, parse_trtllm_text_request  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _response(req, chunk):
    tensors = [pb_utils.Tensor("text_output", np.array([[chunk.text.encode("utf-8")]], dtype=np.object_))]
    if req.return_num_input_tokens:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array([[chunk.num_input_tokens]], dtype=np.int32)))
    if req.return_num_output_tokens:
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array([[chunk.num_output_tokens]], dtype=np.int32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        params = glue_config.parameters_of(cfg)
        tok = glue_config.load_tokenizer(cfg, args["model_repository"])
        self.route = BlsRoute(pb_utils, tok, llm_model=params.get("llm_model", "llm"),
                              preprocessing_model=params.get("preprocessing_model", "preprocessing") or None,
                              max_workers=int(params.get("max_concurrent_requests", "256")),
                              make_response=_response)

    def execute(self, requests):
        for request in requests:
            try:
                arrays = {t.name(): t.as_numpy() for t in request.inputs()}
                self.route.submit(request, parse_trtllm_text_request(arrays))
            except InputError as e:
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
        return None

    def finalize(self):
        self.route.close()
