"""The text routes written as BLS over the token-level `llm` model: `llm_bls` (TensorRT-LLM
interface) and `vllm_model` (vllm_backend interface) share this driver.

Per request, on a worker thread (execute only parses and submits):
  text -> ids (the `preprocessing` model through BLS, or the tokenizer in-process)
  -> `llm` with exec(decoupled=True), always streaming tokens
  -> IncrementalDetokenizer (stateful, exact) -> StopStringMatcher (stop strings on text,
     never sent) -> responses (streamed, or one at the end).
When a stop string hits, or the client cancels, the upstream llm request is cancelled (the
response iterator's cancel() where the Triton release has it; on 24.10 a control request to
`llm` carrying `cancel_request_id`) and the remaining upstream responses are read out: `llm`
ends a cancelled request promptly with a final response (finish_reason "abort").
Every request gets exactly one FINAL; `bls_inflight_requests{route}` counts the requests whose
worker has not finished (0 when idle: anything else is a leaked worker).

What keeps tritonserver 2.51 (python_backend r24.10) alive:
- `llm` never sends an error response to a BLS route (request id starting with CANCEL_PREFIX):
  r24.10 does not copy the response-iterator id into an error response
  (InferResponse::SaveToSharedMemory sets `id` only without an error; fixed upstream in
  python_backend #398, r25.04). The stub then files the error under a stale id: the route's
  iterator never ends (its worker blocks for good), and another live stream may receive that
  FINAL, whose cleanup then frees an InferPayload `llm` is still sending to: the SIGSEGV under
  TRITONBACKEND_ResponseSend after 20-150 stop strings or cancels. So `llm` reports errors to
  BLS routes in-band (finish_reason "error" + `error_message`) and aborts as finish_reason
  "abort"; errors here are only ever sent to the client.
- A response sender is never used after its FINAL (_Sender): r24.10 deletes the response
  factory with FINAL, and is_cancelled() would ask the server about that freed factory.
- A silent upstream ends the wait after `upstream_timeout_s` with an error naming it
  (upstream.BoundedResponses); the iterator cannot be interrupted on 24.10 (no cancel(), no
  timeout), so its helper thread stays until `llm` answers.
- Every upstream response iterator that has ended stays referenced here until a later
  request's is_cancelled() round trip (upstream.HeldIterators, at execute): dropped earlier,
  r24.10 frees it on a stub thread without the GIL, the stub dies with SIGSEGV, and `llm`'s
  sender then blocks for good in send() to that stub's requests (every route stalls).

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

from .config import metric_labels
from .detokenizer import IncrementalDetokenizer
from .inputs import InputError, TextRequest
from .logprob_tensors import Logprobs
from .stops import StopStringMatcher
from .tokenize import encode_prompt, model_tokenizer, words_to_single_token_ids
from .trtllm import parse_word_list, word_list_batch
from .upstream import (BoundedResponses, HeldIterators, UpstreamGone, UpstreamSilent, UpstreamWatch,
                       cancel_upstream_request)

log = logging.getLogger("triton_glue.bls")
# Triton request ids of the BLS routes' requests to `llm`: `llm` answers them in-band (no error
# responses) and aborts one on a control request carrying its id in `cancel_request_id`.
CANCEL_PREFIX = "bls-"
UPSTREAM_OUTPUTS = ["output_ids", "finish_reason", "error_message"]
# the output that carries an in-band error (a normal response holding only it)
ERROR_OUTPUT = "error_message"


def answers_in_band(request: Any) -> bool:
    """Whether a request comes from one of our BLS callers (its id starts with CANCEL_PREFIX),
    which get errors in-band (see the module docstring)."""
    return (request.request_id() or "").startswith(CANCEL_PREFIX)


def error_response(pb: Any, message: str, in_band: bool, code: Any = None) -> Any:
    """The response that reports a failed request: an error response, or for a BLS caller a
    normal response whose only output is `error_message`."""
    if in_band:
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor(ERROR_OUTPUT, np.asarray([[message.encode("utf-8", "replace")]], dtype=np.object_))])
    return pb.InferenceResponse(error=pb.TritonError(message) if code is None else pb.TritonError(message, code))
UPSTREAM_LOGPROB_OUTPUTS = ["output_log_probs", "cum_log_probs", "top_logprob_ids", "top_logprobs",
                            "output_log_prob_ranks"]
# off: a request waits on `llm` as long as the engine keeps it (queued behind max_num_seqs, as in
# vLLM); a dead upstream is detected regardless (upstream.UpstreamWatch)
DEFAULT_UPSTREAM_TIMEOUT_S: Optional[float] = None


@dataclass
class Chunk:
    """What one response to the client carries."""
    text: str
    num_output_tokens: int
    finish_reason: Optional[str]
    num_input_tokens: int
    final: bool
    logprobs: Optional[Logprobs] = None  # of this chunk's tokens, when the request wants them


class _Sender:
    """A request's response sender that is never used after its FINAL (sends are dropped then
    and is_cancelled() answers True without asking the server); errors go in-band to a BLS
    caller (in_band)."""

    def __init__(self, pb: Any, sender: Any, in_band: bool = False,
                 stopped: Callable[[], bool] = lambda: False):
        self._pb = pb
        self._sender = sender
        self._final_flag = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.in_band = in_band
        self._stopped = stopped  # cancelled by a control request (CallerCancels)
        self.closed = False

    def send_error(self, message: str, code: Any = None) -> None:
        """The request's FINAL, reporting message."""
        self.send(error_response(self._pb, message, self.in_band, code), flags=self._final_flag)

    def send(self, response: Any = None, flags: int = 0) -> None:
        if self.closed:
            return
        if flags == self._final_flag:
            self.closed = True
            sender, self._sender = self._sender, None
            sender.send(response, flags=flags)
        else:
            self._sender.send(response)

    def is_cancelled(self) -> bool:
        return self.closed or self._stopped() or self._sender.is_cancelled()


class CallerCancels:
    """Requests that a caller cancelled with a control request naming their Triton request id
    (`cancel_request_id`): the non-decoupled proxy `tensorrt_llm_bls` (triton_glue/sync_proxy.py)
    has no other way, r24.10's BLS response iterators having no cancel(). A cancel also aborts
    the parts' requests to `llm` at once (`abort_upstream(key)`), so one still queued in the
    engine leaves it without waiting for a first token. Only ids in flight are kept, so a late
    or unknown id leaves nothing behind."""

    def __init__(self, abort_upstream: Callable[[str], None] = lambda key: None):
        self._lock = threading.Lock()
        self._parts: dict[str, int] = {}  # request id -> its parts in flight (batch rows, n)
        self._keys: dict[str, list[str]] = {}  # request id -> its parts' upstream request ids
        self._cancelled: set[str] = set()
        self._abort_upstream = abort_upstream

    def started(self, request_id: str) -> Callable[[], bool]:
        """A part of request `request_id` starts; gives whether that request was cancelled."""
        with self._lock:
            self._parts[request_id] = self._parts.get(request_id, 0) + 1
        return lambda: request_id in self._cancelled

    def ended(self, request_id: str) -> None:
        with self._lock:
            left = self._parts.pop(request_id, 1) - 1
            if left > 0:
                self._parts[request_id] = left
            else:
                self._cancelled.discard(request_id)
                self._keys.pop(request_id, None)

    def upstream(self, request_id: str, key: str) -> None:
        """A part of `request_id` sends its request to `llm` under `key`."""
        with self._lock:
            if request_id not in self._parts:
                return
            self._keys.setdefault(request_id, []).append(key)
            cancelled = request_id in self._cancelled
        if cancelled:
            self._abort_upstream(key)

    def cancel(self, request_id: str) -> bool:
        """False when no request of that id is in flight."""
        with self._lock:
            if request_id not in self._parts:
                return False
            self._cancelled.add(request_id)
            keys = list(self._keys.get(request_id, ()))
        for key in keys:
            self._abort_upstream(key)
        return True


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

    def failed(self) -> None:
        """The request ended with an error (rejected upstream or in tokenization, a silent or
        dead upstream) instead of finished()."""


class _Once(RequestHooks):
    """A request's hooks that it leaves exactly once: finished() or failed(), whichever comes
    first (an error may still come after finished(), e.g. while the upstream is read out)."""

    def __init__(self, hooks: RequestHooks):
        self.hooks = hooks
        self.ended = False

    def tokens(self, n: int) -> None:
        self.hooks.tokens(n)

    def cancelling(self) -> None:
        self.hooks.cancelling()

    def cancelled(self) -> None:
        self.hooks.cancelled()

    def finished(self, reason: str, num_prompt: int, num_generated: int) -> None:
        if not self.ended:
            self.ended = True
            self.hooks.finished(reason, num_prompt, num_generated)

    def failed(self) -> None:
        if not self.ended:
            self.ended = True
            self.hooks.failed()


class RouteHooks:
    def request(self, req: TextRequest) -> RequestHooks:
        return RequestHooks()

    def error_message(self, message: str) -> str:
        """The words of an error as this route's clients get them."""
        return message


class BlsRoute:
    def __init__(self, pb_utils: Any, tokenizer: Any, *, llm_model: str = "llm",
                 preprocessing_model: Optional[str] = None, max_workers: int = 256,
                 make_response: Callable[[TextRequest, Chunk], Any], hooks: Optional[RouteHooks] = None,
                 route_name: str = "bls", upstream_timeout_s: Optional[float] = DEFAULT_UPSTREAM_TIMEOUT_S,
                 instance_labels: Optional[dict[str, str]] = None):
        self.pb = pb_utils
        # this instance's own series when there are several (config.metric_labels)
        self.instance_labels = dict(instance_labels or {})
        self.hooks = hooks or RouteHooks()
        self.route_name = route_name
        self.tok = tokenizer
        self.llm_model = llm_model
        self.pre_model = preprocessing_model
        self.make_response = make_response
        self.upstream_timeout_s = float(upstream_timeout_s) if upstream_timeout_s else None  # 0: off
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bls")
        self._closing = threading.Event()
        self._inflight_lock = threading.Lock()
        self._inflight = 0
        self._inflight_gauge = self._route_gauge("bls_inflight_requests",
                                                 "BLS requests whose worker has not finished", 0)
        # waits on llm end with an error if its stub dies (2.51 would leave them waiting forever)
        self.upstream = UpstreamWatch(llm_model, on_death=self._upstream_died, gauge=self._alive_gauge(llm_model))
        self.iterators = HeldIterators()
        self.caller_cancels = CallerCancels(
            lambda key: threading.Thread(target=self._cancel_quietly, args=(key,), daemon=True).start())

    def _route_gauge(self, name: str, description: str, value: float) -> Any:
        MF = getattr(self.pb, "MetricFamily", None)
        if MF is None:
            return None
        family = MF(name=name, kind=MF.GAUGE, description=description)
        gauge = family.Metric(labels={"route": self.route_name, **self.instance_labels})
        gauge.set(value)
        self._families = getattr(self, "_families", []) + [family]  # they outlive their metrics
        return gauge

    def _count_inflight(self, delta: int) -> None:
        with self._inflight_lock:
            self._inflight += delta
            n = self._inflight
            if self._inflight_gauge is not None:
                try:
                    self._inflight_gauge.set(n)
                except Exception:  # noqa: BLE001 - metrics never fail a request
                    log.exception("bls_inflight_requests update failed")

    def inflight(self) -> int:
        """Requests whose worker has not finished (client FINAL sent and upstream read out)."""
        with self._inflight_lock:
            return self._inflight

    def _alive_gauge(self, llm_model: str) -> Any:
        self._gauge_family = None
        MF = getattr(self.pb, "MetricFamily", None)
        if MF is None:
            return None
        self._gauge_family = MF(name="bls_upstream_alive", kind=MF.GAUGE,
                                description="1 while the stub of the model a BLS route calls is alive")
        gauge = self._gauge_family.Metric(labels={"route": self.route_name, "upstream": llm_model,
                                                  **self.instance_labels})
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
        parameters `llm_model`, `max_concurrent_requests`, `upstream_timeout_s` and
        (preprocessing=True) the `preprocessing_model` to tokenize through; preprocessing=False
        tokenizes in-process."""
        _, params, tok = model_tokenizer(args)
        timeout = params.get("upstream_timeout_s", "")
        try:
            timeout_s = float(timeout) if timeout else DEFAULT_UPSTREAM_TIMEOUT_S
        except ValueError:
            raise ValueError(f"parameter 'upstream_timeout_s' must be a number of seconds, not {timeout!r}") from None
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"parameter 'upstream_timeout_s' must be >= 0 (0: off; got {timeout!r})")
        return cls(pb_utils, tok, llm_model=params.get("llm_model", "llm"),
                   preprocessing_model=(params.get("preprocessing_model", "preprocessing") or None)
                   if preprocessing else None,
                   max_workers=int(params.get("max_concurrent_requests", "256")),
                   make_response=make_response, hooks=hooks,
                   route_name=str(args.get("model_name", "bls")), upstream_timeout_s=timeout_s,
                   instance_labels=metric_labels(args, {}))

    # ---- called from execute ------------------------------------------------------------
    def execute(self, requests: Any, parse: Callable[[dict, Any], TextRequest],
                submit: Optional[Callable[[Any, TextRequest], None]] = None) -> None:
        """A BLS model's execute(): parse(input arrays by name, request) and submit each request
        (submit: the model's own, e.g. one that runs n sequences; default self.submit); one
        that fails to parse (InputError) gets the error as its only, FINAL, response."""
        pb = self.pb
        self.barrier(requests)
        for request in requests:
            try:
                arrays = {t.name(): t.as_numpy() for t in request.inputs()}
                parsed = parse(arrays, request)
            except InputError as e:
                message = str(e)
            except Exception as e:  # noqa: BLE001 - escaping execute would FINAL the batch twice
                log.exception("BLS request parsing failed")
                message = f"invalid request: {e!r}"
            else:
                (submit or self.submit)(request, parsed)
                continue
            message = self.hooks.error_message(message)
            request.get_response_sender().send(error_response(pb, message, answers_in_band(request)),
                                               flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def barrier(self, requests: Any) -> None:
        """First thing in execute (a model with its own execute calls it): releases the upstream
        iterators whose stub-side cleanup has run (upstream.HeldIterators)."""
        self.iterators.barrier(requests)

    def submit(self, request: Any, parsed: TextRequest, sender: Any = None) -> None:
        """sender: the request's response sender, or a stand-in for it (a batch row's)."""
        sender = sender if sender is not None else request.get_response_sender()
        self._count_inflight(+1)
        rid = request.request_id() or ""
        stopped = self.caller_cancels.started(rid) if rid else (lambda: False)
        self.pool.submit(self._run_safe, _Sender(self.pb, sender, answers_in_band(request), stopped), parsed, rid)

    def close(self) -> None:
        self._closing.set()
        self.upstream.close()
        self._inflight_gauge = None
        self._gauge_family = None  # after its metric (the Python backend requires that order)
        self._families = []
        self.pool.shutdown(wait=True, cancel_futures=False)
        self.iterators.close()

    # ---- worker thread --------------------------------------------------------------------
    def _run_safe(self, sender: "_Sender", req: TextRequest, request_id: str = "") -> None:
        try:
            try:
                self._run(sender, req, request_id)
            except (InputError, _UpstreamError, UpstreamGone) as e:
                sender.send_error(self.hooks.error_message(str(e)))
            except Exception as e:  # noqa: BLE001 - never leave a request without FINAL
                log.exception("BLS request failed")
                sender.send_error(self.hooks.error_message(f"internal error: {e!r}"))
        finally:
            if request_id:
                self.caller_cancels.ended(request_id)
            self._count_inflight(-1)

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
        for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                              ("frequency_penalty", 0.0), ("min_p", 0.0)):
            if getattr(s, name) != neutral:
                inputs.append(t(name, [getattr(s, name)], np.float32))
        outputs = UPSTREAM_OUTPUTS
        if req.wants_logprobs:
            inputs.append(t("num_top_logprobs", [s.logprobs or 0], np.int32))
            outputs = UPSTREAM_OUTPUTS + UPSTREAM_LOGPROB_OUTPUTS
        return pb.InferenceRequest(model_name=self.llm_model, inputs=inputs, request_id=key,
                                   requested_output_names=outputs)

    def _cancel_upstream(self, it: Any, key: str) -> None:
        if hasattr(it, "cancel"):
            try:
                it.cancel()
                return
            except Exception:  # noqa: BLE001
                pass
        cancel_upstream_request(self.pb, self.llm_model, key, self.iterators)

    def _cancel_quietly(self, key: str) -> None:
        try:
            self._cancel_upstream(None, key)
        except Exception:  # noqa: BLE001 - best effort: the client has its error already
            log.exception("BLS upstream cancel failed")

    def _run(self, sender: Any, req: TextRequest, request_id: str = "") -> None:
        hooks = _Once(self.hooks.request(req))
        try:
            self._stream(sender, req, hooks, request_id)
        except BaseException:
            hooks.failed()  # before the client hears of the error: the gauges are back by then
            raise

    def _stream(self, sender: Any, req: TextRequest, hooks: RequestHooks, request_id: str = "") -> None:
        pb = self.pb
        FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        ids, bad, stop_seqs = self._tokenize(req)
        n_gen = 0
        key = f"{CANCEL_PREFIX}{uuid.uuid4().hex}"
        if request_id:
            self.caller_cancels.upstream(request_id, key)
        upstream_request = self._llm_request(req, ids, bad, stop_seqs, key)

        def responses():  # exec() itself waits for the first response: on the helper thread
            upstream = upstream_request.exec(decoupled=True)
            try:
                yield from upstream
            finally:
                self.iterators.hold(upstream)

        bounded = BoundedResponses(responses(), self.upstream, silence_s=self.upstream_timeout_s,
                                   silence_message=f"no response from model '{self.llm_model}' within "
                                                   f"{self.upstream_timeout_s or 0:g} s (parameter upstream_timeout_s)")

        def guarded():  # a silent upstream may only be slow: ask it to stop, off this thread
            try:
                yield from bounded
            except UpstreamSilent:
                threading.Thread(target=self._cancel_quietly, args=(key,), daemon=True).start()
                raise

        it = guarded()
        detok = IncrementalDetokenizer(self.tok, ids, req.skip_special_tokens)
        # stop words that became token sequences are the engine's; the rest are matched on text
        stops = StopStringMatcher([] if self.pre_model else req.stop_strings, req.include_stop_str_in_output)
        prefix_text = req.text if not req.exclude_input else ""
        acc_text: list[str] = []
        n_acc = 0
        acc_lp = Logprobs() if req.wants_logprobs else None
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
            fr = _string_output(pb, resp, "finish_reason")
            up_final = fr != ""
            if fr == "error":  # llm's in-band error (see the module docstring)
                raise _UpstreamError(_string_output(pb, resp, "error_message") or f"model '{self.llm_model}' failed")
            if new:
                n_gen += len(new)
                hooks.tokens(len(new))
            lp = None
            if acc_lp is not None:
                lp = Logprobs.from_outputs(new, lambda name: _array_output(pb, resp, name))
            piece = detok.add(new, final=up_final)
            res = stops.feed(piece)
            text = res.text
            if res.stopped:
                stopped, finish = True, "stop"
                self._cancel_upstream(bounded, key)
            elif up_final:
                finish = fr
                text += stops.flush()
            if sender.is_cancelled():
                cancelled = True
                hooks.cancelling()
                self._cancel_upstream(bounded, key)
                hooks.cancelled()
                continue
            final = stopped or up_final
            if req.stream:
                if text or final or len(new):
                    if prefix_text:
                        text, prefix_text = prefix_text + text, ""
                    chunk = Chunk(text, len(new), finish if final else None, len(ids), final, lp)
                    sender.send(self.make_response(req, chunk), flags=FINAL if final else 0)
            else:
                acc_text.append(text)
                n_acc += len(new)
                if lp is not None:
                    acc_lp.extend(lp)
                if final:
                    chunk = Chunk(prefix_text + "".join(acc_text), n_acc, finish, len(ids), True, acc_lp)
                    sender.send(self.make_response(req, chunk), flags=FINAL)
            if final:
                hooks.finished(finish, len(ids), n_gen)
                # drain whatever the upstream still sends (its own FINAL)
                for _ in it:
                    pass
                return
        hooks.finished("abort" if cancelled else (finish or "abort"), len(ids), n_gen)
        if cancelled:
            sender.send_error("request cancelled", pb.TritonError.CANCELLED)
            return
        # the upstream ended without a final chunk: never leave the client hanging
        sender.send(self.make_response(req, Chunk(stops.flush(), 0, finish or "abort", len(ids), True,
                                                  Logprobs() if req.wants_logprobs else None)), flags=FINAL)


def _array_output(pb: Any, resp: Any, name: str) -> Optional[np.ndarray]:
    t = pb.get_output_tensor_by_name(resp, name)
    return None if t is None else t.as_numpy()


def _string_output(pb: Any, resp: Any, name: str) -> str:
    t = pb.get_output_tensor_by_name(resp, name)
    if t is None:
        return ""
    v = t.as_numpy().reshape(-1)
    if v.size == 0:
        return ""
    return v[0].decode("utf-8", "replace") if isinstance(v[0], bytes) else str(v[0])


class _UpstreamError(RuntimeError):
    pass
