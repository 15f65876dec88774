"""`preprocessing`: text -> token ids with the checkpoint's own tokenizer; stop/bad words ->
token ids; request knobs passed on. Errors name the ensemble's input (text_input, stop_words, ...)."""
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.inputs import InputError, decode_utf8  # noqa: E402
from triton_glue.tokenize import encode_prompt, model_tokenizer, words_to_single_token_ids  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.model_config, params, self.tokenizer = model_tokenizer(args)
        self.add_special_tokens = params.get("add_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except InputError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocessing: {e!r}")))
        return responses

    def _one(self, request):
        query = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy()
        batch = query.shape[0]
        out_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN")
        out_len = out_len.as_numpy().reshape(batch, -1)[:, :1].astype(np.int32) if out_len is not None \
            else np.full((batch, 1), 16, np.int32)

        def strings(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy().reshape(batch, -1)

        stop_words, bad_words = strings("STOP_WORDS_DICT"), strings("BAD_WORDS_DICT")
        end_id = pb_utils.get_input_tensor_by_name(request, "END_ID")
        end_id = end_id.as_numpy().reshape(batch, -1)[:, :1].astype(np.int32) if end_id is not None \
            else np.full((batch, 1), -1, np.int32)

        ids_rows, stop_rows, bad_rows = [], [], []
        for b in range(batch):
            text = decode_utf8("text_input", query.reshape(batch, -1)[b, 0])
            ids_rows.append(encode_prompt(self.tokenizer, text, self.add_special_tokens))
            stop_rows.append(words_to_single_token_ids(
                self.tokenizer, "stop_words", [decode_utf8("stop_words", w) for w in stop_words[b]]
                if stop_words is not None else []))
            bad_rows.append(words_to_single_token_ids(
                self.tokenizer, "bad_words", [decode_utf8("bad_words", w) for w in bad_words[b]]
                if bad_words is not None else []))

        def pad(rows, fill):
            width = max([len(r) for r in rows] + [0])
            return np.array([r + [fill] * (width - len(r)) for r in rows], dtype=np.int64).reshape(batch, width)

        if batch > 1 and len({len(r) for r in ids_rows}) > 1:
            raise InputError("text_input", "a batch of prompts must tokenize to equal lengths; "
                                           "send one request per prompt")
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("INPUT_ID", pad(ids_rows, 0)),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(r)] for r in ids_rows], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len),
            # ragged lists padded with -1 (dropped by the llm model), as TensorRT-LLM does
            pb_utils.Tensor("STOP_WORDS_IDS", pad(stop_rows, -1)),
            pb_utils.Tensor("BAD_WORDS_IDS", pad(bad_rows, -1)),
            pb_utils.Tensor("OUT_END_ID", end_id),
        ])
