"""`postprocessing`: ids -> text for one streamed chunk, stateless and UTF-8 safe
(triton_glue.detokenizer.decode_delta): text = decode(prefix + new) - decode(prefix), holding
back an incomplete trailing character until the chunk that completes it (or the final one)."""
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.detokenizer import decode_delta  # noqa: E402
from triton_glue.tokenize import model_tokenizer  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.model_config, params, self.tokenizer = model_tokenizer(args)
        self.skip = params.get("skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                toks = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                batch = toks.shape[0]
                toks = toks.reshape(batch, -1)
                pre = pb_utils.get_input_tensor_by_name(request, "PREFIX_IDS")
                pre = pre.as_numpy().reshape(batch, -1) if pre is not None else np.zeros((batch, 0), np.int64)
                fin = pb_utils.get_input_tensor_by_name(request, "FINISH_REASON")
                fin = fin.as_numpy().reshape(batch, -1) if fin is not None else None
                texts = []
                for b in range(batch):
                    final = fin is None or bool(fin[b, 0])  # no finish info: treat chunk as whole
                    prefix = [int(t) for t in pre[b] if t >= 0]
                    texts.append(decode_delta(self.tokenizer, prefix, [int(t) for t in toks[b]],
                                              final, self.skip).encode("utf-8"))
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("OUTPUT", np.array(texts, dtype=np.object_).reshape(batch, 1))]))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {e!r}")))
        return responses
