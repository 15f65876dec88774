"""TensorRT-LLM's request interface (NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm):
the token-level `tensorrt_llm` tensors that the `llm` model speaks, the text-level inputs of
`ensemble` / `tensorrt_llm_bls`, and the word lists in TensorRT-LLM's `[2, -1]` offsets format.

TensorRT-LLM semantics matched here:
  - requests are batched: `input_ids` [B, L] (padded; `input_lengths` [B, 1] trims each row),
    every other input [B, 1] (or [1, 1], broadcast); each row is one generation;
  - `runtime_top_k` (alias `top_k`) = 0 and `runtime_top_p` (alias `top_p`) = 0 (or absent)
    is greedy, whatever the temperature (its sampling layer turns k=0, p=0 into k=1); k > 0
    with p = 0 is plain top-k; p <= 0 means no top-p;
  - stop words are token sequences (multi-token allowed) that stay in the output;
  - streaming never carries the prompt; a non-streaming response leads with it unless
    `exclude_input_in_output`;
  - `repetition_penalty` (> 0), `presence_penalty` / `frequency_penalty` ([-2, 2]) and our
    `min_p` ([0, 1]) go to the engine (vLLM's semantics; the engine names a bad value's range);
  - `return_log_probs`: `output_log_probs` [1, beams=1, N] (the logprob of each token of the
    response, generated tokens only) and `cum_log_probs` [1, beams=1] (the sequence so far);
  - `num_return_sequences` = n: n sequences per row, each response one sequence, carrying
    `sequence_index` [1, 1] when n > 1; FINAL with the request's last response;
  - inputs this engine has no feature for are declared (Triton rejects undeclared inputs even
    at their neutral value) and accepted only at their neutral value; the error names them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from .inputs import Arrays, InputError, SamplingFields, TextRequest, TokenRequest, decode_utf8, parse_bool
from .logprob_tensors import RANK_WINDOW

# Input -> why a non-neutral value is refused. Neutral: false, 0, empty, all zeros, "" (or the
# value in NEUTRAL_VALUES); absent is always fine.
UNSUPPORTED = {
    "return_context_logits": "this engine does not return logits",
    "return_generation_logits": "this engine does not return logits",
    "return_perf_metrics": "per-request perf metrics are not returned by this engine",
    "beam_width": "beam search is not supported (only 1)",
    "len_penalty": "length penalty applies to beam search, which is not supported (only 1.0)",
    "length_penalty": "length penalty applies to beam search, which is not supported (only 1.0)",
    "beam_search_diversity_rate": "beam search is not supported (only 0.0)",
    "runtime_top_p_decay": "top-p decay is not supported (only 1.0)",
    "embedding_bias": "embedding bias is not supported (only zeros)",
    "embedding_bias_words": "embedding bias is not supported",
    "embedding_bias_weights": "embedding bias is not supported",
    "prompt_embedding_table": "prompt tuning is not supported",
    "prompt_vocab_size": "prompt tuning is not supported (only 0)",
    "prompt_table_extra_ids": "prompt tuning is not supported (only zeros)",
    "prompt_table_extra_id": "prompt tuning is not supported (only 0)",
    "lora_task_id": "LoRA is not supported",
    "lora_weights": "LoRA is not supported",
    "lora_config": "LoRA is not supported",
    "draft_input_ids": "speculative decoding with draft tokens is not supported",
    "decoder_text_input": "encoder-decoder models are not supported",
    "encoder_input_features": "encoder-decoder models are not supported",
    "encoder_output_lengths": "encoder-decoder models are not supported",
    "cross_attention_mask": "encoder-decoder models are not supported",
    "skip_cross_attn_blocks": "encoder-decoder models are not supported",
    "mrope_rotary_cos_sin": "multimodal inputs are not supported",
    "mrope_position_deltas": "multimodal inputs are not supported",
    "image_input": "multimodal inputs are not supported",
    "image_bytes_input": "multimodal inputs are not supported",
    "image_url_input": "multimodal inputs are not supported",
    "video_bytes_input": "multimodal inputs are not supported",
    "context_phase_params": "disaggregated serving is not supported",
    "guided_decoding_guide_type": "guided decoding is not supported",
    "guided_decoding_guide": "guided decoding is not supported",
    "lookahead_window_size": "lookahead decoding is not supported",
    "lookahead_ngram_size": "lookahead decoding is not supported",
    "lookahead_verification_set_size": "lookahead decoding is not supported",
    "retention_token_range_starts": "KV-cache retention is not supported",
    "retention_token_range_ends": "KV-cache retention is not supported",
    "retention_token_range_priorities": "KV-cache retention is not supported",
    "retention_token_range_durations_ms": "KV-cache retention is not supported",
    "retention_decode_priority": "KV-cache retention is not supported",
    "retention_decode_duration_ms": "KV-cache retention is not supported",
}
NEUTRAL_VALUES = {"beam_width": 1, "len_penalty": 1.0, "length_penalty": 1.0, "runtime_top_p_decay": 1.0}
# Accepted and without effect here: they only matter with a feature above (beam search,
# top-p decay, draft tokens) or name the pad token / decoder side of a decoder-only model.
IGNORED = ("early_stopping", "runtime_top_p_min", "runtime_top_p_reset_ids", "draft_acceptance_threshold",
           "pad_id", "decoder_input_lengths", "input_lengths", "stop")
# A stop request (stop=true) names its target by request id; TensorRT-LLM's words for one without
STOP_WITHOUT_ID = "Trying to stop a request but request ID is not provided"
# decoder_input_ids: TensorRT-LLM's preprocessing sends [[pad_id]] for decoder-only models.
DECODER_INPUT_MAX = 1


def _is_neutral(name: str, arr: np.ndarray) -> bool:
    arr = np.asarray(arr)
    if arr.size == 0:
        return True
    if name in NEUTRAL_VALUES:
        return bool(np.all(arr.astype(np.float64) == NEUTRAL_VALUES[name]))
    if arr.dtype.kind in "OSU":
        return all((x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)) == "" for x in arr.reshape(-1))
    return not np.any(arr)


def check_unsupported(arrays: Arrays) -> None:
    """A non-neutral value of an input this engine has no feature for: InputError naming it."""
    for name, why in UNSUPPORTED.items():
        arr = arrays.get(name)
        if arr is not None and not _is_neutral(name, arr):
            value = np.asarray(arr).reshape(-1)[:4].tolist()
            raise InputError(name, f"{why} (got {value})")
    dec = arrays.get("decoder_input_ids")
    if dec is not None and np.asarray(dec).reshape(np.asarray(dec).shape[0], -1).shape[1] > DECODER_INPUT_MAX:
        raise InputError("decoder_input_ids", "encoder-decoder models are not supported (decoder-only: "
                                              "at most the one pad token TensorRT-LLM's preprocessing sends)")


# ---- per-row access -----------------------------------------------------------------------
def row(arrays: Arrays, name: str, b: int, batch: int) -> Optional[np.ndarray]:
    """Row b of an input batched as [B, ...] ([1, ...] broadcasts), or None when absent."""
    arr = arrays.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim == 0:
        return arr.reshape(1)
    if arr.shape[0] == batch:
        return arr[b]
    if arr.shape[0] == 1:
        return arr[0]
    raise InputError(name, f"batch size {arr.shape[0]} does not match input_ids' {batch}")


def scalar(arrays: Arrays, name: str, b: int, batch: int) -> Optional[Any]:
    r = row(arrays, name, b, batch)
    if r is None:
        return None
    r = np.asarray(r).reshape(-1)
    if r.size != 1:
        raise InputError(name, f"expected one value per batch row, got {r.size}")
    return r[0]


def _int(arrays: Arrays, names: tuple[str, ...], b: int, batch: int) -> Optional[int]:
    vals = {n: scalar(arrays, n, b, batch) for n in names}
    vals = {n: v for n, v in vals.items() if v is not None}
    if not vals:
        return None
    out = {}
    for n, v in vals.items():
        if isinstance(v, (float, np.floating)) and not float(v).is_integer():
            raise InputError(n, f"must be an integer (got {v!r})")
        out[n] = int(v)
    if len(set(out.values())) > 1:
        a, c = list(out)[:2]
        raise InputError(a, f"and its alias {c} disagree ({out[a]} vs {out[c]})")
    return next(iter(out.values()))


def _float(arrays: Arrays, names: tuple[str, ...], b: int, batch: int) -> Optional[float]:
    for n in names:
        v = scalar(arrays, n, b, batch)
        if v is not None:
            f = float(v)
            if f != f or f in (float("inf"), float("-inf")):
                raise InputError(n, f"must be a finite number (got {f!r})")
            return f
    return None


def _bool(arrays: Arrays, names: tuple[str, ...], b: int, batch: int, default: bool) -> bool:
    for n in names:
        v = scalar(arrays, n, b, batch)
        if v is not None:
            if isinstance(v, (bytes, str)):
                return parse_bool(n, v.decode() if isinstance(v, bytes) else v)
            return bool(v)
    return default


# ---- word lists: [2, L] = (concatenated ids, end offsets padded with -1) --------------------
def parse_word_list(name: str, arr: Optional[np.ndarray]) -> list[list[int]]:
    """The token sequences of one row of a `[2, -1]` word list (TensorRT-LLM's format)."""
    if arr is None:
        return []
    arr = np.asarray(arr)
    if arr.size == 0:
        return []
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2 or arr.dtype.kind not in "iu":
        raise InputError(name, f"must be an integer [2, N] word list (ids, end offsets padded with -1), "
                               f"got {arr.dtype} shape {list(arr.shape)}")
    ids, offsets = arr[0].tolist(), arr[1].tolist()
    out, start = [], 0
    for end in offsets:
        if end < 0:
            continue
        if end <= start or end > len(ids):
            raise InputError(name, f"offsets must increase within the {len(ids)} ids (got {offsets})")
        out.append([int(t) for t in ids[start:end]])
        start = end
    return out


def to_word_list(seqs: list[list[int]], width: Optional[int] = None) -> np.ndarray:
    """[2, width] int32 word list of one row (TensorRT-LLM's preprocessing layout: ids padded
    with 0, offsets with -1)."""
    flat = [t for s in seqs for t in s]
    offs = list(np.cumsum([len(s) for s in seqs]).tolist()) if seqs else []
    width = max(1, len(flat), len(offs)) if width is None else width
    return np.array([flat + [0] * (width - len(flat)), offs + [-1] * (width - len(offs))], dtype=np.int32)


def word_list_batch(rows: list[list[list[int]]]) -> np.ndarray:
    """[B, 2, W] word lists of a batch (W: the widest row, at least 1)."""
    width = max([max(sum(len(s) for s in r), len(r)) for r in rows] + [1])
    return np.stack([to_word_list(r, width) for r in rows]).astype(np.int32)


# ---- sampling ---------------------------------------------------------------------------------
def sampling_fields(arrays: Arrays, b: int = 0, batch: int = 1) -> SamplingFields:
    f = SamplingFields()
    f.max_tokens = _int(arrays, ("request_output_len", "max_tokens"), b, batch)
    mt = _int(arrays, ("min_tokens", "min_length"), b, batch)
    f.min_tokens = mt or 0
    f.temperature = _float(arrays, ("temperature",), b, batch)
    k = _int(arrays, ("runtime_top_k", "top_k"), b, batch)
    p = _float(arrays, ("runtime_top_p", "top_p"), b, batch)
    k = 0 if k is None or k == -1 else k
    p = 0.0 if p is None or p <= 0 else p
    if k == 0 and p == 0.0:
        # greedy, as TensorRT-LLM's sampling layer does (an invalid temperature stays, so the
        # engine still rejects it by name)
        f.temperature = 0.0 if f.temperature is None or f.temperature >= 0 else f.temperature
    else:
        f.top_k = k if k > 0 else -1
        f.top_p = p if p > 0 else 1.0
    f.seed = _int(arrays, ("seed", "random_seed"), b, batch)
    # None leaves SamplingParams' neutral default; the engine checks the ranges by name
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
        v = _float(arrays, (name,), b, batch)
        if v is not None:
            setattr(f, name, v)
    n = _int(arrays, ("num_return_sequences",), b, batch)
    if n is not None:
        from backend_lib.request import MAX_N
        if not 1 <= n <= MAX_N:
            raise InputError("num_return_sequences", f"must be in [1, {MAX_N}] (got {n})")
        f.n = n
    if _bool(arrays, ("return_log_probs",), b, batch, False):
        f.logprobs = 0  # the sampled token's logprob (TensorRT-LLM returns no top-N)
    f.ignore_eos = _bool(arrays, ("ignore_eos",), b, batch, False)
    ids = row(arrays, "stop_token_ids", b, batch)  # ours: single ids, -1 pads ragged lists
    f.stop_token_ids = [int(t) for t in np.asarray(ids).reshape(-1) if t >= 0] if ids is not None else []
    ids = row(arrays, "bad_token_ids", b, batch)
    f.bad_token_ids = [int(t) for t in np.asarray(ids).reshape(-1) if t >= 0] if ids is not None else []
    f.stop_sequences = parse_word_list("stop_words_list", row(arrays, "stop_words_list", b, batch))
    for seq in parse_word_list("bad_words_list", row(arrays, "bad_words_list", b, batch)):
        if len(seq) != 1:
            raise InputError("bad_words_list", f"multi-token bad words are not supported (a word of "
                                               f"{len(seq)} tokens: {seq}); single-token words only")
        f.bad_token_ids.append(seq[0])
    end_id = _int(arrays, ("end_id",), b, batch)
    if end_id is not None and end_id >= 0:
        # TensorRT-LLM's end_id replaces the model's EOS, and ignore_eos ignores it as it would
        # the EOS: the ensemble's preprocessing fills end_id in from the tokenizer on every
        # request, which would otherwise end an ignore_eos stream at its first sampled EOS.
        if not f.ignore_eos:
            f.stop_token_ids = list(f.stop_token_ids) + [end_id]
        f.ignore_eos = True
    return f


# ---- the token-level model (llm / tensorrt_llm) ----------------------------------------------
@dataclass
class TokenRow(TokenRequest):
    batch_index: int = 0
    batch_size: int = 1


def _top_logprobs(arrays: Arrays, b: int, batch: int) -> Optional[int]:
    """Ours (`num_top_logprobs`, what vllm_model asks for): the top-N logprobs per token."""
    top = _int(arrays, ("num_top_logprobs",), b, batch)
    if top is not None and not 0 <= top <= RANK_WINDOW:
        raise InputError("num_top_logprobs", f"must be in [0, {RANK_WINDOW}] (got {top})")
    return top


def parse_token_requests(arrays: Arrays) -> list[TokenRow]:
    """One TokenRow per batch row of a TensorRT-LLM `tensorrt_llm` request."""
    check_unsupported(arrays)
    ids = arrays.get("input_ids")
    if ids is None:
        raise InputError("input_ids", "is required")
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InputError("input_ids", f"must hold integer token ids (got dtype {ids.dtype})")
    if ids.ndim == 1:
        ids = ids.reshape(1, -1)
    if ids.ndim != 2:
        raise InputError("input_ids", f"must be [batch, tokens] (got shape {list(ids.shape)})")
    batch = ids.shape[0]
    out = []
    for b in range(batch):
        prompt = ids[b].tolist()
        n = _int(arrays, ("input_lengths",), b, batch)
        if n is not None:
            if not (0 <= n <= len(prompt)):
                raise InputError("input_lengths", f"must be in [1, {len(prompt)}] (got {n})")
            prompt = prompt[:n]
        if not prompt:
            raise InputError("input_ids", "prompt must not be empty")
        samp = sampling_fields(arrays, b, batch)
        if samp.max_tokens is None:
            raise InputError("request_output_len", "is required (alias max_tokens)")
        top = _top_logprobs(arrays, b, batch)
        if top is not None:
            samp.logprobs = RANK_WINDOW  # the sampled token's rank needs the top of the distribution
        stream = _bool(arrays, ("streaming", "stream"), b, batch, False)
        exclude = _bool(arrays, ("exclude_input_in_output",), b, batch, False)
        out.append(TokenRow(top_logprobs=top,
            prompt_ids=prompt, sampling=samp, stream=stream,
            exclude_input=exclude or stream,  # TensorRT-LLM never streams the prompt
            return_num_input_tokens=_bool(arrays, ("return_num_input_tokens",), b, batch, False),
            return_num_output_tokens=_bool(arrays, ("return_num_output_tokens",), b, batch, False),
            batch_index=b, batch_size=batch))
    return out


# ---- the text-level routes (ensemble's preprocessing, tensorrt_llm_bls) ----------------------
@dataclass
class TextRow(TextRequest):
    batch_index: int = 0
    batch_size: int = 1


def _strings(arrays: Arrays, name: str, b: int, batch: int) -> list[str]:
    r = row(arrays, name, b, batch)
    if r is None:
        return []
    return [s for s in (decode_utf8(name, x) for x in np.asarray(r).reshape(-1)) if s != ""]


def parse_text_requests(arrays: Arrays) -> list[TextRow]:
    """One TextRow per batch row of an ensemble / tensorrt_llm_bls request. Stop words stay
    text here; the route turns them into token sequences (preprocessing)."""
    check_unsupported(arrays)
    text = arrays.get("text_input")
    if text is None:
        raise InputError("text_input", "is required")
    text = np.asarray(text)
    batch = text.shape[0] if text.ndim >= 2 else 1
    out = []
    for b in range(batch):
        t = np.asarray(row(arrays, "text_input", b, batch)).reshape(-1)
        if t.size != 1:
            raise InputError("text_input", f"expected one string per batch row, got {t.size}")
        prompt = decode_utf8("text_input", t[0])
        if prompt == "":
            raise InputError("text_input", "prompt must not be empty")
        samp = sampling_fields(arrays, b, batch)
        if samp.max_tokens is None:
            raise InputError("max_tokens", "is required")
        samp.check_ranges()  # before any row (or any of its n sequences) reaches the engine
        stream = _bool(arrays, ("stream", "streaming"), b, batch, False)
        out.append(TextRow(
            text=prompt, sampling=samp, stop_strings=_strings(arrays, "stop_words", b, batch),
            bad_words=_strings(arrays, "bad_words", b, batch), stream=stream,
            exclude_input=_bool(arrays, ("exclude_input_in_output",), b, batch, False) or stream,
            return_finish_reason=True,
            return_num_input_tokens=_bool(arrays, ("return_num_input_tokens",), b, batch, False),
            return_num_output_tokens=_bool(arrays, ("return_num_output_tokens",), b, batch, False),
            batch_index=b, batch_size=batch))
    return out


def with_stop_sequences(req: TextRow, seqs: list[list[int]]) -> TextRow:
    """The row with its stop words as token sequences (and no text-level stop strings)."""
    return replace(req, sampling=replace(req.sampling, stop_sequences=seqs), stop_strings=[])
