"""`vllm_model`: vllm_backend's interface (text_input, stream, sampling_parameters JSON with
string values coerced as vllm_backend does, exclude_input_in_output, return_finish_reason,
return_num_input_tokens, return_num_output_tokens) over the shared `llm` engine through BLS,
so vllm_backend clients and `genai-perf --backend vllm` work unchanged. See triton_glue/bls.py
and triton_glue/vllm_compat.py."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.bls import BlsRoute  # noqa: E402
from triton_glue.config import parameters_of  # noqa: E402
from triton_glue.inputs import client_parameters, reject_unknown_parameters, request_parameters  # noqa: E402
from triton_glue.vllm_compat import parse_vllm_request  # noqa: E402
from triton_glue.vllm_metrics import VllmRouteHooks, report_custom_metrics  # noqa: E402


def _response(req, chunk):
    tensors = [pb_utils.Tensor("text_output", np.array([chunk.text.encode("utf-8")], dtype=np.object_))]
    if req.return_finish_reason:
        fr = chunk.finish_reason if chunk.final else None
        tensors.append(pb_utils.Tensor("finish_reason", np.array([str(fr).encode()], dtype=np.object_)))
    if req.return_num_input_tokens:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array([chunk.num_input_tokens], dtype=np.uint32)))
    if req.return_num_output_tokens:
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array([chunk.num_output_tokens], dtype=np.uint32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _parse(arrays, request):
    params = client_parameters(request_parameters(request.parameters()))
    if "sampling_parameters" in arrays:
        reject_unknown_parameters(params)  # the knobs come in the sampling_parameters input
    return parse_vllm_request(arrays, json.dumps(params) if params else None)


class TritonPythonModel:
    def initialize(self, args):
        params = parameters_of(json.loads(args["model_config"]))
        # vllm_backend's vllm:* metrics (REPORT_CUSTOM_METRICS) and cancellation log lines
        self.hooks = VllmRouteHooks(pb_utils, {"model": args["model_name"], "version": args["model_version"]},
                                    metrics=report_custom_metrics(params))
        # tokenize in-process
        self.route = BlsRoute.from_model_args(pb_utils, args, preprocessing=False, make_response=_response,
                                              hooks=self.hooks)

    def execute(self, requests):
        return self.route.execute(requests, _parse)

    def finalize(self):
        self.route.close()
        self.hooks.close()
