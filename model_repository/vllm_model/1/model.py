"""`vllm_model`: vllm_backend's interface (text_input, stream, sampling_parameters JSON with
string values coerced as vllm_backend does, exclude_input_in_output, return_finish_reason,
return_num_input_tokens, return_num_output_tokens) over the shared `llm` engine through BLS,
so vllm_backend clients and `genai-perf --backend vllm` work unchanged. See triton_glue/bls.py
and triton_glue/vllm_compat.py."""
import functools
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.bls import BlsRoute  # noqa: E402
from triton_glue.config import metric_labels, parameters_of  # noqa: E402
from triton_glue.inputs import client_parameters, reject_unknown_parameters, request_parameters  # noqa: E402
from triton_glue.logprob_tensors import vllm_logprobs_json  # noqa: E402
from triton_glue.sequences import SequenceJoiner, fan_out  # noqa: E402
from triton_glue.tokenize import keep_torch_out  # noqa: E402
from triton_glue.vllm_compat import SAMPLING_KEYS, parse_vllm_request  # noqa: E402
from triton_glue.vllm_metrics import VllmRouteHooks, report_custom_metrics  # noqa: E402

keep_torch_out()  # this stub only tokenizes: no torch in its process


class _Responses:
    """vllm_backend's create_response for one request: one entry per sequence in each output
    (n > 1: chunks[i] is sequence i's news, None when it has none)."""

    def __init__(self, req, decode):
        self.req = req
        self.decode = decode
        self.cumulative = [0.0] * req.num_sequences

    def __call__(self, chunks, finishes):
        req = self.req
        for i, c in enumerate(chunks):
            if c is not None and c.logprobs is not None and c.logprobs.cumulative is not None:
                self.cumulative[i] = c.logprobs.cumulative
        texts = [(c.text if c is not None else "").encode("utf-8") for c in chunks]
        tensors = [pb_utils.Tensor("text_output", np.array(texts, dtype=np.object_))]
        if req.return_finish_reason:
            tensors.append(pb_utils.Tensor("finish_reason", np.array([str(f).encode() for f in finishes],
                                                                     dtype=np.object_)))
        if req.return_cumulative_logprob:
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(self.cumulative, dtype=np.float32)))
        if req.return_logprobs:
            entries = [None if req.sampling.logprobs is None else
                       (c.logprobs.vllm_entries(self.decode) if c is not None and c.logprobs is not None else [])
                       for c in chunks]
            tensors.append(pb_utils.Tensor("logprobs", np.array([vllm_logprobs_json(e) for e in entries],
                                                                dtype=np.object_)))
        if req.return_num_input_tokens:
            n_in = next(c.num_input_tokens for c in chunks if c is not None)
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([n_in], dtype=np.uint32)))
        if req.return_num_output_tokens:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array(
                [c.num_output_tokens if c is not None else 0 for c in chunks], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)


def _parse(arrays, request):
    params = client_parameters(request_parameters(request.parameters()))
    if "sampling_parameters" in arrays:
        # the knobs come in the sampling_parameters input; request parameters that are
        # sampling keys too are ignored, as vllm_backend does (its own tests send both), others
        # are misspelt knobs
        reject_unknown_parameters(params, accepted=SAMPLING_KEYS)
    return parse_vllm_request(arrays, json.dumps(params) if params else None)


class TritonPythonModel:
    def initialize(self, args):
        params = parameters_of(json.loads(args["model_config"]))
        # vllm_backend's vllm:* metrics (REPORT_CUSTOM_METRICS) and cancellation log lines
        self.hooks = VllmRouteHooks(pb_utils, metric_labels(args, {"model": args["model_name"],
                                                                    "version": args["model_version"]}),
                                    metrics=report_custom_metrics(params))
        # tokenize in-process
        self.route = BlsRoute.from_model_args(pb_utils, args, preprocessing=False, make_response=self._response,
                                              hooks=self.hooks)
        self.decode = functools.lru_cache(maxsize=65536)(lambda t: self.route.tok.decode([t]))

    def _response(self, req, chunk):
        if req.num_sequences > 1:  # the SequenceJoiner builds the response of all sequences
            return req.sequence_index, chunk
        return _Responses(req, self.decode)([chunk], [chunk.finish_reason if chunk.final else None])

    def execute(self, requests):
        return self.route.execute(requests, _parse, submit=self._submit)

    def _submit(self, request, parsed):
        seqs = fan_out(parsed)
        if len(seqs) == 1:
            self.route.submit(request, parsed)
            return
        joiner = SequenceJoiner(pb_utils, request.get_response_sender(), len(seqs), parsed.stream,
                                _Responses(seqs[0], self.decode))
        for seq in seqs:
            self.route.submit(request, seq, sender=joiner.sequence())

    def finalize(self):
        self.route.close()
        self.hooks.close()
