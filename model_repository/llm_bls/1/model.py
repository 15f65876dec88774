"""`llm_bls`: TensorRT-LLM's `tensorrt_llm_bls` interface (the ensemble's inputs) written as
BLS: `preprocessing` (stop words -> token sequences), then `llm` streaming, detokenized
incrementally here. As in TensorRT-LLM: [B, 1] inputs give B generations (batch_index on each
response), stop words stay in the output, streaming never carries the prompt, top_k = 0 and
top_p = 0 is greedy; num_return_sequences = n gives n sequences, one per response with
sequence_index; return_log_probs adds cum_log_probs / output_log_probs. See triton_glue/bls.py and triton_glue/trtllm.py."""
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.batch import BatchSender  # noqa: E402
from triton_glue.bls import BlsRoute, answers_in_band, error_response  # noqa: E402
from triton_glue.inputs import InputError, reject_unknown_parameters  # noqa: E402
from triton_glue.sequences import fan_out  # noqa: E402
from triton_glue.tokenize import keep_torch_out  # noqa: E402
from triton_glue.trtllm import parse_text_requests  # noqa: E402

keep_torch_out()  # this stub only tokenizes: no torch in its process


def _response(req, chunk):
    # text_output: one string per sequence, 1-D (TensorRT-LLM's postprocessing layout)
    tensors = [pb_utils.Tensor("text_output", np.array([chunk.text.encode("utf-8")], dtype=np.object_))]
    if req.batch_size > 1:
        tensors.append(pb_utils.Tensor("batch_index", np.array([[req.batch_index]], dtype=np.int32)))
    if req.num_sequences > 1:  # as TensorRT-LLM: one sequence per response, sequence_index when n > 1
        tensors.append(pb_utils.Tensor("sequence_index", np.array([[req.sequence_index]], dtype=np.int32)))
    if req.sampling.logprobs is not None and chunk.logprobs is not None:  # return_log_probs
        lp = chunk.logprobs
        tensors.append(pb_utils.Tensor("cum_log_probs", np.array([[lp.cumulative or 0.0]], dtype=np.float32)))
        tensors.append(pb_utils.Tensor("output_log_probs", np.array(lp.sampled, dtype=np.float32).reshape(1, 1, -1)))
    if req.return_num_input_tokens:
        tensors.append(pb_utils.Tensor("num_input_tokens", np.array([[chunk.num_input_tokens]], dtype=np.int32)))
    if req.return_num_output_tokens:
        tensors.append(pb_utils.Tensor("num_output_tokens", np.array([[chunk.num_output_tokens]], dtype=np.int32)))
    return pb_utils.InferenceResponse(output_tensors=tensors)



class TritonPythonModel:
    def initialize(self, args):
        self.route = BlsRoute.from_model_args(pb_utils, args, preprocessing=True, make_response=_response)

    def execute(self, requests):
        self.route.barrier(requests)
        for request in requests:
            control = pb_utils.get_input_tensor_by_name(request, "cancel_request_id")
            if control is not None:  # abort the in-flight request of that id (tensorrt_llm_bls's cancel)
                for raw in np.asarray(control.as_numpy()).reshape(-1)[:1]:  # an empty one names nothing
                    self.route.caller_cancels.cancel(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw))
                request.get_response_sender().send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            try:
                reject_unknown_parameters(request.parameters())
                rows = parse_text_requests({t.name(): t.as_numpy() for t in request.inputs()})
            except InputError as e:
                request.get_response_sender().send(error_response(pb_utils, str(e), answers_in_band(request)),
                                                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            seqs = [seq for row in rows for seq in fan_out(row)]  # num_return_sequences
            if len(seqs) == 1:
                self.route.submit(request, seqs[0])
                continue
            batch = BatchSender(pb_utils, request.get_response_sender(), len(seqs))
            for seq in seqs:
                self.route.submit(request, seq, sender=batch.row())
        return None

    def finalize(self):
        self.route.close()
