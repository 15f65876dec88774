"""The text routes written as BLS over the token-level `llm` model: `llm_bls` (TensorRT-LLM
interface) and `vllm_model` (vllm_backend interface) share this driver.

Per request, on a worker thread (execute only parses and submits):
  text -> ids (the `preprocessing` model through BLS, or the tokenizer in-process)
  -> `llm` with exec(decoupled=True), always streaming tokens
  -> IncrementalDetokenizer (stateful, exact) -> StopStringMatcher (stop strings on text,
     never sent) -> responses (streamed, or one at the end).
When a stop string hits, or the client cancels, the upstream llm request is cancelled (the
response iterator's cancel() where the Triton release has it; on 24.10 a control request to
`llm` carrying `cancel_request_id`) and the remaining upstream responses are drained.
Every request gets exactly one FINAL.

pb_utils is passed in; nothing here imports it.
"""
from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .detokenizer import IncrementalDetokenizer
from .inputs import InputError, TextRequest
from .stops import StopStringMatcher
from .tokenize import encode_prompt, model_tokenizer, words_to_single_token_ids
from .trtllm import parse_word_list, word_list_batch
from .upstream import BoundedResponses, UpstreamGone, UpstreamWatch

log = logging.getLogger("triton_glue.bls")
CANCEL_PREFIX = "bls-"


@dataclass
class Chunk:
    """What one response to the client carries."""
    text: str
    num_output_tokens: int
    finish_reason: Optional[str]
    num_input_tokens: int
    final: bool


class RequestHooks:
    """Per-request events of a route (metrics, logs); these defaults do nothing."""

    def tokens(self, n: int) -> None:
        """n new tokens arrived from upstream."""

    def cancelling(self) -> None:
        """The client cancelled; the upstream cancel is about to be sent."""

    def cancelled(self) -> None:
        """The upstream cancel was sent."""

    def finished(self, reason: str, num_prompt: int, num_generated: int) -> None:
        """The request ended ("stop", "length", "abort")."""


class RouteHooks:
    def request(self, req: TextRequest) -> RequestHooks:
        return RequestHooks()


class BlsRoute:
    def __init__(self, pb_utils: Any, tokenizer: Any, *, llm_model: str = "llm",
                 preprocessing_model: Optional[str] = None, max_workers: int = 256,
                 make_response: Callable[[TextRequest, Chunk], Any], hooks: Optional[RouteHooks] = None,
                 route_name: str = "bls"):
        self.pb = pb_utils
        self.hooks = hooks or RouteHooks()
        self.route_name = route_name
        self.tok = tokenizer
        self.llm_model = llm_model
        self.pre_model = preprocessing_model
        self.make_response = make_response
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bls")
        self._closing = threading.Event()
        # waits on llm end with an error if its stub dies (2.51 would leave them waiting forever)
        self.upstream = UpstreamWatch(llm_model, on_death=self._upstream_died, gauge=self._alive_gauge(llm_model))

    def _alive_gauge(self, llm_model: str) -> Any:
        self._gauge_family = None
        MF = getattr(self.pb, "MetricFamily", None)
        if MF is None:
            return None
        self._gauge_family = MF(name="bls_upstream_alive", kind=MF.GAUGE,
                                description="1 while the stub of the model a BLS route calls is alive")
        gauge = self._gauge_family.Metric(labels={"route": self.route_name, "upstream": llm_model})
        gauge.set(1)
        return gauge

    def _upstream_died(self, message: str) -> None:
        log.error(message)
        logger = getattr(self.pb, "Logger", None)
        if logger is not None:
            logger.log_error(f"[bls] {message}: failing the requests waiting on it")

    @classmethod
    def from_model_args(cls, pb_utils: Any, args: Any, *, preprocessing: bool,
                        make_response: Callable[[TextRequest, Chunk], Any],
                        hooks: Optional[RouteHooks] = None) -> "BlsRoute":
        """The route of a BLS model, from the `args` of its initialize(): the tokenizer and the
        parameters `llm_model`, `max_concurrent_requests` and (preprocessing=True) the
        `preprocessing_model` to tokenize through; preprocessing=False tokenizes in-process."""
        _, params, tok = model_tokenizer(args)
        return cls(pb_utils, tok, llm_model=params.get("llm_model", "llm"),
                   preprocessing_model=(params.get("preprocessing_model", "preprocessing") or None)
                   if preprocessing else None,
                   max_workers=int(params.get("max_concurrent_requests", "256")),
                   make_response=make_response, hooks=hooks,
                   route_name=str(args.get("model_name", "bls")))

    # ---- called from execute ------------------------------------------------------------
    def execute(self, requests: Any, parse: Callable[[dict, Any], TextRequest]) -> None:
        """A BLS model's execute(): parse(input arrays by name, request) and submit each request;
        one that fails to parse (InputError) gets the error as its only, FINAL, response."""
        pb = self.pb
        for request in requests:
            try:
                arrays = {t.name(): t.as_numpy() for t in request.inputs()}
                self.submit(request, parse(arrays, request))
            except InputError as e:
                request.get_response_sender().send(
                    pb.InferenceResponse(error=pb.TritonError(str(e))),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def submit(self, request: Any, parsed: TextRequest, sender: Any = None) -> None:
        """sender: the request's response sender, or a stand-in for it (a batch row's)."""
        sender = sender if sender is not None else request.get_response_sender()
        self.pool.submit(self._run_safe, sender, parsed)

    def close(self) -> None:
        self._closing.set()
        self.upstream.close()
        self._gauge_family = None  # after its metric (the Python backend requires that order)
        self.pool.shutdown(wait=True, cancel_futures=False)

    # ---- worker thread --------------------------------------------------------------------
    def _run_safe(self, sender: Any, req: TextRequest) -> None:
        FINAL = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            self._run(sender, req)
        except InputError as e:
            sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(str(e))), flags=FINAL)
        except (_UpstreamError, UpstreamGone) as e:
            sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(str(e))), flags=FINAL)
        except Exception as e:  # noqa: BLE001 - never leave a request without FINAL
            log.exception("BLS request failed")
            sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(f"internal error: {e!r}")),
                        flags=FINAL)

    def _tokenize(self, req: TextRequest) -> tuple[list[int], list[int], list[list[int]]]:
        """(prompt ids, bad token ids, stop token sequences). Through `preprocessing`
        (TensorRT-LLM's): stop words become token sequences the engine stops on."""
        if self.pre_model is None:
            ids = encode_prompt(self.tok, req.text)
            bad = words_to_single_token_ids(self.tok, "bad_words", req.bad_words)
            return ids, bad, []
        pb = self.pb
        inputs = [pb.Tensor("QUERY", np.array([[req.text.encode("utf-8")]], dtype=np.object_)),
                  pb.Tensor("REQUEST_OUTPUT_LEN", np.array([[16 if req.sampling.max_tokens is None else req.sampling.max_tokens]], dtype=np.int32))]
        for name, words in (("BAD_WORDS_DICT", req.bad_words), ("STOP_WORDS_DICT", req.stop_strings)):
            if words:
                inputs.append(pb.Tensor(name, np.array([[w.encode() for w in words]], dtype=np.object_)))
        resp = pb.InferenceRequest(model_name=self.pre_model, inputs=inputs,
                                   requested_output_names=["INPUT_ID", "REQUEST_INPUT_LEN", "BAD_WORDS_IDS",
                                                           "STOP_WORDS_IDS"]).exec()
        if resp.has_error():
            raise _UpstreamError(resp.error().message())
        n = int(pb.get_output_tensor_by_name(resp, "REQUEST_INPUT_LEN").as_numpy().reshape(-1)[0])
        ids = pb.get_output_tensor_by_name(resp, "INPUT_ID").as_numpy().reshape(-1).tolist()[:n]
        bad = [s[0] for s in parse_word_list("bad_words", pb.get_output_tensor_by_name(resp, "BAD_WORDS_IDS").as_numpy())]
        stops = parse_word_list("stop_words", pb.get_output_tensor_by_name(resp, "STOP_WORDS_IDS").as_numpy())
        return ids, bad, stops

    def _llm_request(self, req: TextRequest, ids: list[int], bad: list[int], stops: list[list[int]],
                     key: str) -> Any:
        pb, s = self.pb, req.sampling

        def t(name, value, dtype):
            return pb.Tensor(name, np.array([value], dtype=dtype).reshape(1, -1))

        # Sampling knobs are always explicit: `llm` reads absent top_k/top_p as TensorRT-LLM
        # does (greedy); None here means the vLLM defaults (temperature 1, no top-k/top-p).
        inputs = [t("input_ids", ids, np.int32), t("max_tokens", [16 if s.max_tokens is None else s.max_tokens], np.int32),
                  t("stream", [True], np.bool_), t("exclude_input_in_output", [True], np.bool_),
                  t("temperature", [1.0 if s.temperature is None else s.temperature], np.float32),
                  t("top_k", [-1 if s.top_k is None else s.top_k], np.int32),
                  t("top_p", [1.0 if s.top_p is None else s.top_p], np.float32)]
        if stops or s.stop_sequences:
            words = word_list_batch([list(s.stop_sequences) + stops])
            inputs.append(pb.Tensor("stop_words_list", words))
        if s.seed is not None:
            if s.seed < 0:
                raise InputError("seed", f"must be >= 0 (got {s.seed})")
            inputs.append(t("seed", [s.seed], np.uint64))
        if s.min_tokens:
            inputs.append(t("min_tokens", [s.min_tokens], np.int32))
        if s.stop_token_ids:
            inputs.append(t("stop_token_ids", s.stop_token_ids, np.int32))
        if bad or s.bad_token_ids:
            inputs.append(t("bad_token_ids", list(s.bad_token_ids) + bad, np.int32))
        if s.ignore_eos:
            inputs.append(t("ignore_eos", [True], np.bool_))
        return pb.InferenceRequest(model_name=self.llm_model, inputs=inputs, request_id=key,
                                   requested_output_names=["output_ids", "finish_reason"])

    def _cancel_upstream(self, it: Any, key: str) -> None:
        if hasattr(it, "cancel"):
            try:
                it.cancel()
                return
            except Exception:  # noqa: BLE001
                pass
        pb = self.pb
        ctl = pb.InferenceRequest(model_name=self.llm_model, request_id=key + "-cancel",
                                  inputs=[pb.Tensor("cancel_request_id",
                                                    np.array([[key.encode()]], dtype=np.object_))],
                                  requested_output_names=[])
        for _ in ctl.exec(decoupled=True):
            pass

    def _run(self, sender: Any, req: TextRequest) -> None:
        pb = self.pb
        FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        hooks = self.hooks.request(req)
        ids, bad, stop_seqs = self._tokenize(req)
        n_gen = 0
        key = f"{CANCEL_PREFIX}{uuid.uuid4().hex}"
        it = BoundedResponses(self._llm_request(req, ids, bad, stop_seqs, key).exec(decoupled=True),
                              self.upstream)
        detok = IncrementalDetokenizer(self.tok, ids, req.skip_special_tokens)
        # stop words that became token sequences are the engine's; the rest are matched on text
        stops = StopStringMatcher([] if self.pre_model else req.stop_strings, req.include_stop_str_in_output)
        prefix_text = req.text if not req.exclude_input else ""
        acc_text: list[str] = []
        n_acc = 0
        finish: Optional[str] = None
        stopped = cancelled = False
        for resp in it:
            if resp.has_error():
                if stopped or cancelled:
                    continue  # the upstream reports our own cancellation
                raise _UpstreamError(resp.error().message())
            out = pb.get_output_tensor_by_name(resp, "output_ids")
            if out is None:  # a flags-only final response
                continue
            if stopped or cancelled:
                continue
            new = out.as_numpy().reshape(-1).tolist()
            fr = pb.get_output_tensor_by_name(resp, "finish_reason")
            fr = fr.as_numpy().reshape(-1)[0] if fr is not None else b""
            fr = fr.decode() if isinstance(fr, bytes) else str(fr)
            up_final = fr != ""
            if new:
                n_gen += len(new)
                hooks.tokens(len(new))
            piece = detok.add(new, final=up_final)
            res = stops.feed(piece)
            text = res.text
            if res.stopped:
                stopped, finish = True, "stop"
                self._cancel_upstream(it, key)
            elif up_final:
                finish = fr
                text += stops.flush()
            if sender.is_cancelled():
                cancelled = True
                hooks.cancelling()
                self._cancel_upstream(it, key)
                hooks.cancelled()
                continue
            final = stopped or up_final
            if req.stream:
                if text or final or len(new):
                    if prefix_text:
                        text, prefix_text = prefix_text + text, ""
                    chunk = Chunk(text, len(new), finish if final else None, len(ids), final)
                    sender.send(self.make_response(req, chunk), flags=FINAL if final else 0)
            else:
                acc_text.append(text)
                n_acc += len(new)
                if final:
                    chunk = Chunk(prefix_text + "".join(acc_text), n_acc, finish, len(ids), True)
                    sender.send(self.make_response(req, chunk), flags=FINAL)
            if final:
                hooks.finished(finish, len(ids), n_gen)
                # drain whatever the upstream still sends (its own FINAL)
                for _ in it:
                    pass
                return
        hooks.finished("abort" if cancelled else (finish or "abort"), len(ids), n_gen)
        if cancelled:
            sender.send(pb.InferenceResponse(error=pb.TritonError("request cancelled",
                                                                  pb.TritonError.CANCELLED)), flags=FINAL)
            return
        # the upstream ended without a final chunk: never leave the client hanging
        sender.send(self.make_response(req, Chunk(stops.flush(), 0, finish or "abort", len(ids), True)),
                    flags=FINAL)


class _UpstreamError(RuntimeError):
    pass
