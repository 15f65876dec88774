"""`preprocessing`: TensorRT-LLM's preprocessing tensors. Text -> INT32 token ids with the
checkpoint's own tokenizer (a batch is padded with the pad id, REQUEST_INPUT_LEN gives each
row's length); stop/bad words -> `[2, -1]` word lists (each word encoded without special
tokens, as TensorRT-LLM does; multi-token stop words allowed, bad words single-token);
END_ID/PAD_ID default to the tokenizer's eos/pad. Errors name the ensemble's input."""
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.inputs import InputError  # noqa: E402
from triton_glue.tokenize import TrtllmTokenizer, keep_torch_out, model_tokenizer  # noqa: E402

keep_torch_out()  # this stub only tokenizes: no torch in its process


class TritonPythonModel:
    def initialize(self, args):
        self.model_config, params, tokenizer = model_tokenizer(args)
        add_special = params.get("add_special_tokens", "true").lower() == "true"
        self.tok = TrtllmTokenizer(tokenizer, add_special)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                arrays = {t.name(): t.as_numpy() for t in request.inputs()}
                out = self.tok.preprocess(arrays)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]))
            except InputError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocessing: {e!r}")))
        return responses
