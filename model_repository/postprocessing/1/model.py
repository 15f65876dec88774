"""`postprocessing`: TensorRT-LLM's postprocessing tensors (TOKENS_BATCH INT32 [B, beams, N],
SEQUENCE_LENGTH [B, beams] -> OUTPUT, one string per sequence, 1-D), stateless and UTF-8 safe
(triton_glue.detokenizer.decode_delta): with PREFIX_IDS (the tokens before this chunk, sent by
`llm`) text = decode(prefix + new) - decode(prefix), an incomplete trailing character held
back until the chunk that completes it; FINISH_REASON "" marks a non-final chunk. Without
them (TensorRT-LLM's own clients) each call decodes its tokens as a whole."""
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.detokenizer import decode_delta  # noqa: E402
from triton_glue.tokenize import keep_torch_out, model_tokenizer  # noqa: E402

keep_torch_out()  # this stub only tokenizes: no torch in its process


class TritonPythonModel:
    def initialize(self, args):
        self.model_config, params, self.tokenizer = model_tokenizer(args)
        self.skip = params.get("skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {e!r}")))
        return responses

    def _one(self, request):
        toks = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
        batch = toks.shape[0]
        # beams from the shape, not -1: an empty chunk (N = 0, e.g. `llm`'s abort FINAL) cannot infer it
        toks = toks.reshape(batch, int(np.prod(toks.shape[1:-1])), toks.shape[-1]) if toks.ndim >= 2 \
            else toks.reshape(1, 1, -1)
        beams = toks.shape[1]
        lens = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH")
        lens = lens.as_numpy().reshape(batch, beams) if lens is not None else \
            np.full((batch, beams), toks.shape[2], np.int32)
        pre = pb_utils.get_input_tensor_by_name(request, "PREFIX_IDS")
        pre = pre.as_numpy().reshape(batch, -1) if pre is not None else np.zeros((batch, 0), np.int32)
        fin = pb_utils.get_input_tensor_by_name(request, "FINISH_REASON")
        fin = fin.as_numpy().reshape(batch, -1) if fin is not None else None
        texts = []
        for b in range(batch):
            final = fin is None or bool(fin[b, 0])  # no finish info: the chunk is whole
            prefix = [int(t) for t in pre[b] if t >= 0]
            for k in range(beams):
                ids = [int(t) for t in toks[b, k, :max(0, int(lens[b, k]))]]
                texts.append(decode_delta(self.tokenizer, prefix, ids, final, self.skip).encode("utf-8"))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_))])
