"""`llm`: decoupled, token-level model on backend_lib.AsyncEngine.

Threads (per model instance):
  - Triton's execute thread: parse + validate + AsyncEngine.add_request, returns None at once;
  - the engine loop thread (backend_lib.AsyncEngine), or with engine_process=on the engine loop
    in a process of its own (backend_lib.EngineProcessClient) and nothing of it here;
  - the engine's dispatcher thread (engine_process=on: its output reader thread), or with
    delivery_threads > 1 that many delivery threads: the only senders; they turn RequestOutputs
    into responses, each request on one thread at a time;
  - a monitor thread: polls is_cancelled() of in-flight requests, one pass per cancel_poll_ms
    (-> AsyncEngine.abort), and exports engine stats to the metrics endpoint.
Every request gets exactly one FINAL: from the dispatcher (normal end, abort, engine error),
or from execute itself when the request is rejected before reaching the engine.
"""
import collections
import heapq
import http.client
import itertools
import json
import operator
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from backend_lib.envs import CORE_SWITCH_INTERVAL_ENV  # noqa: E402
from backend_lib.os_threads import NamedThread  # noqa: E402
from triton_glue import config as glue_config  # noqa: E402
from triton_glue.bls import CANCEL_PREFIX  # noqa: E402
from triton_glue.detokenizer import PREFIX_WINDOW  # noqa: E402
from triton_glue.inputs import InputError, get_bool, reject_unknown_parameters  # noqa: E402
from triton_glue.logprob_tensors import sampled_logprobs, top_logprobs  # noqa: E402
from triton_glue.trtllm import STOP_WITHOUT_ID, parse_token_requests  # noqa: E402
from triton_glue.metrics import EngineMetrics  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# is_cancelled() polls a second, all requests together. Each is a round trip to the server taken
# with the GIL held (the engine loop waits meanwhile); a poll of every stream each cancel_poll_ms
# would cost 12,800 of them a second at 256 streams. Cost: a cancel is seen within about
# max(cancel_poll_ms, streams / CANCEL_POLLS_PER_S s) (256 streams: ~1 s).
CANCEL_POLLS_PER_S = 250
_LAST_CANCEL_CHECK = operator.attrgetter("last_cancel_check")
EARLY_CANCEL_S = 30.0     # how long a cancel of a BLS key not seen yet waits for its request
EARLY_CANCEL_MAX = 4096
FINALIZE_TIMEOUT_S = 5.0  # engine stop + final outputs, well inside the launcher's exit timeout


class _Group:
    """One Triton request: its response sender, shared by its batch rows (TensorRT-LLM clients
    send [B, ...] inputs; each row is one engine request). FINAL goes with the last row's end."""
    __slots__ = ("sender", "rows", "remaining", "key", "bls", "lock", "closed", "error", "outputs", "stopped")

    def __init__(self, sender, size, bls=False, outputs=None):
        self.sender = sender
        self.outputs = outputs  # the outputs the client asked for (None: every one)
        self.rows = []
        self.remaining = size
        self.key = None
        self.bls = bls  # a BLS route's request: errors in-band (see _error_response)
        # is_cancelled() on a sender whose FINAL was sent crashes tritonserver 2.51 (the
        # response factory is gone): FINAL is sent, and polls happen, under this lock.
        self.lock = threading.Lock()
        self.closed = False
        self.error = None  # why the engine refused a row: the request's one error, on its last row's end
        # ended by TensorRT-LLM's stop request: a plain FINAL, as its executor ends a cancelled
        # request (finish reason CANCELLED), not the error a client's own cancel gets
        self.stopped = False


# No guard against a send() that never returns: that is a send to a BLS route's request whose
# stub has died (tritonserver 2.51 waits on the dead stub for good; triton_glue/upstream.HeldIterators
# keeps our BLS stubs from the crash that did it in the soak test), and nothing here can end it.


class _SendTotals:
    """Responses sent and the seconds spent sending them (by every delivery thread)."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        self._lock = threading.Lock()

    def add(self, seconds):
        with self._lock:
            self.count += 1
            self.seconds += seconds


_SENDS = _SendTotals()


def _requested_outputs(request):
    """The output names the client asked for, None for all. Triton drops the other outputs of
    a response only after the stub has paid to send them, and send() grows with each tensor:
    on the CPU box a response of output_ids alone cost ~75-110 us, with prefix_ids and
    finish_reason too ~180-230 us (bench/sender_cost.py). The BLS routes ask for output_ids and
    finish_reason, the ensemble for what postprocessing reads, TensorRT-LLM's clients name
    theirs; a client that names none gets all."""
    names = getattr(request, "requested_output_names", None)
    if names is None:
        return None
    try:
        asked = names()
    except Exception:  # noqa: BLE001 - unknown: send everything, as before
        return None
    return frozenset(asked) if asked else None


def _error_response(message, in_band):
    """The FINAL response of a failed request. A BLS route's request (in_band: its request id
    starts with CANCEL_PREFIX) gets a normal response with finish_reason "error" and the
    message in `error_message`: tritonserver 2.51 loses the BLS response-iterator id of an
    error response, and the caller then hangs or crashes the server (see triton_glue/bls.py)."""
    if not in_band:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("output_ids", np.zeros((1, 1, 0), dtype=np.int32)),
        pb_utils.Tensor("sequence_length", np.zeros((1, 1), dtype=np.int32)),
        pb_utils.Tensor("prefix_ids", np.zeros((1, 0), dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.asarray([[b"error"]], dtype=np.object_)),
        pb_utils.Tensor("error_message", np.asarray([[message.encode("utf-8", "replace")]], dtype=np.object_)),
    ])


class _Sequence:
    """What the sender keeps per sequence of a request (n > 1: one per sequence index)."""
    __slots__ = ("tail", "first_sent", "pending", "pending_logprobs")

    def __init__(self, prompt):
        self.tail = list(prompt[-PREFIX_WINDOW:])  # tokens before the next chunk
        self.first_sent = False
        self.pending = []           # non-streaming: the tokens so far
        self.pending_logprobs = []  # and their logprob dicts, when requested


class _Inflight:
    __slots__ = ("rid", "group", "batch_index", "batch_size", "stream", "exclude_input", "prompt",
                 "seqs", "n", "logprobs", "top_n", "ret_in", "ret_out", "t_arrival", "t_first",
                 "t_last", "n_out", "cancelled", "last_cancel_check")

    def __init__(self, rid, group, req):
        self.rid = rid
        self.group = group
        self.batch_index = req.batch_index
        self.batch_size = req.batch_size
        self.stream = req.stream
        self.exclude_input = req.exclude_input
        self.prompt = req.prompt_ids
        self.seqs = {}
        self.n = req.sampling.n
        # return_log_probs (top_n None: TensorRT-LLM's outputs only) or num_top_logprobs = N
        self.logprobs = req.sampling.logprobs is not None
        self.top_n = req.top_logprobs
        self.ret_in = req.return_num_input_tokens
        self.ret_out = req.return_num_output_tokens
        self.t_arrival = time.monotonic()
        self.t_first = None
        self.t_last = None
        self.n_out = 0
        self.cancelled = False
        self.last_cancel_check = 0.0

    def seq(self, index):
        s = self.seqs.get(index)
        if s is None:
            s = self.seqs[index] = _Sequence(self.prompt)
        return s


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("llm must use the decoupled transaction policy")
        self.name = args["model_name"]
        self.version = args["model_version"]
        self.instance = args["model_instance_name"]
        self.logger = pb_utils.Logger
        # An invalid parameter fails the load here with a ValueError naming it.
        cfg = glue_config.engine_config(self.model_config, args["model_repository"])
        self.cancel_poll_s = float(glue_config.glue_parameter(self.model_config, "cancel_poll_ms")) / 1e3
        self.stats_interval_s = float(glue_config.glue_parameter(self.model_config, "stats_interval_ms")) / 1e3
        coalesce = glue_config.glue_parameter(self.model_config, "stream_coalesce")
        if coalesce not in ("auto", "off"):
            raise ValueError(f"parameter 'stream_coalesce' must be 'auto' or 'off', not {coalesce!r}")
        self.coalesce = coalesce == "auto"
        switch_ms = glue_config.glue_parameter(self.model_config, "gil_switch_interval_ms").strip()
        if switch_ms:
            sys.setswitchinterval(glue_config.positive_ms("gil_switch_interval_ms", switch_ms) / 1e3)
            os.environ[CORE_SWITCH_INTERVAL_ENV] = switch_ms  # and the engine core's, started from here
        self.metrics = EngineMetrics(pb_utils, glue_config.metric_labels(args, {"model": self.name,
                                                                                "version": self.version}))

        in_process = not glue_config.engine_process(self.model_config)
        fault_after = int(glue_config.glue_parameter(self.model_config, "test_fault_after_steps"))
        delivery_threads = glue_config.delivery_threads(self.model_config)
        self.logger.log_info(f"[llm] starting engine ({'in process' if in_process else 'engine process'}, "
                             f"{delivery_threads} delivery thread(s)): {cfg.to_json()}")
        # stream_coalesce=auto: when the sender lags the engine, a response carries every token
        # its sequence made while it waited, and first tokens and finals go ahead of the others
        # (backend_lib/delivery.py). Both re-raise the engine's start-up errors.
        # Several instances (instance_group count) share one engine core: each stub sends and
        # receives its own requests' tokens on its own GIL (bench/RESULTS.md).
        kw = {} if in_process else {"share_key": glue_config.engine_share_key(self.model_config, cfg, self.name,
                                                                              self.version)}
        # Imported here, one of the two: the engine process's client never loads torch in this stub.
        if in_process:
            from backend_lib import AsyncEngine as engine_cls
        else:
            from backend_lib import EngineProcessClient as engine_cls
        self.engine = engine_cls(cfg, merge_queued_outputs=self.coalesce, fault_after_steps=fault_after,
                                 delivery_threads=delivery_threads, **kw)
        if fault_after > 0:
            self.logger.log_warn(f"[llm] test hook: the engine will fail after {fault_after} steps")
        self.logger.log_info(f"[llm] engine ready (vocab={self.engine.vocab_size}, "
                             f"max_model_len={self.engine.max_model_len})")
        self._ids = itertools.count()
        # Request ids are unique across the instances that share one engine core, also across a
        # reload whose new instances (same names) attach to it while the old ones still stream.
        self._rid_prefix = f"{self.instance}-{os.getpid()}-"
        self._inflight = {}
        # Triton request id -> _Group: control cancels (BLS "bls-..." keys) and TensorRT-LLM stop requests
        self._by_key = {}
        self._early_cancels = collections.OrderedDict()  # key -> until when a request under it is aborted
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Triton calls finalize only after every in-flight request has sent FINAL, so an
        # unload would wait for the longest stream. The monitor watches the model's readiness
        # (it drops when an unload starts) and then aborts what is in flight.
        self._seen_ready = False
        self._unloading = False
        self._http_down = 0     # consecutive readiness polls the server's HTTP endpoint refused
        # Set by finalize: from then on no thread of this model calls into the server (a stub
        # whose server is gone hangs in any such call, keeps its memory and its /dev/shm region).
        self._finalized = False
        base = glue_config.server_http_url()
        self._ready_url = f"{base}/v2/models/{self.name}/versions/{self.version}/ready" if base else None
        self._monitor = NamedThread(target=self._monitor_main, name="llm-monitor", daemon=True)
        self._monitor.start()

    # ---- execute: parse + enqueue only --------------------------------------------------
    def execute(self, requests):
        self._seen_ready = True  # requests only arrive once the model is ready
        in_engine = []  # the rows of this call handed to the engine
        # With the engine in its own process, the whole call's requests reach it in one message.
        with self.engine.batched_adds():
            for request in requests:
                self._enqueue(request, in_engine)
        # Rows were in _inflight (cancellation polls, an unload's abort-all) before the engine had
        # them, and the engine ignores an abort of an id it does not know yet: abort again now
        # that it has them.
        for ctx in in_engine:
            if self._unloading or ctx.cancelled:
                self.engine.abort(ctx.rid)
        return None

    def _enqueue(self, request, in_engine):
        """Parse, validate and add one Triton request's rows (into in_engine); a rejected one gets
        its error response and FINAL here."""
        sender = request.get_response_sender()
        tid = request.request_id() or ""
        bls = tid.startswith(CANCEL_PREFIX)
        try:
            if self._unloading:
                raise RuntimeError("model is unloading (or the server is shutting down)")
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            if "cancel_request_id" in arrays:
                self._control_cancel(arrays["cancel_request_id"])
                sender.send(flags=FINAL)
                return
            if "stop" in arrays and get_bool(arrays, "stop", False):
                # TensorRT-LLM's stop request: end the in-flight request with this request id;
                # answered, as its backend does, with an empty response (a client that asked for
                # no empty finals still gets it), an id already finished included
                if not tid:
                    raise ValueError(STOP_WITHOUT_ID)
                self._cancel_key(tid, stopped=True)
                sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                return
            reject_unknown_parameters(request.parameters())
            rows = parse_token_requests(arrays)
            params = [r.sampling.to_params() for r in rows]
            # every row before any reaches the engine
            prompts = [self.engine.validate(r.prompt_ids, p) for r, p in zip(rows, params)]
            group = _Group(sender, len(rows), bls, _requested_outputs(request))
            ctxs = [_Inflight(f"{self._rid_prefix}{next(self._ids)}", group, r) for r in rows]
            group.rows = ctxs
            with self._lock:
                for ctx in ctxs:
                    self._inflight[ctx.rid] = ctx
                if tid and tid not in self._by_key:
                    group.key = tid
                    self._by_key[tid] = group
                cancelled_early = self._early_cancels.pop(tid, 0.0) > time.monotonic()
            added = 0
            try:
                for ctx, prompt, p in zip(ctxs, prompts, params):
                    self.engine.add_request(ctx.rid, prompt, p, callback=self._on_output, validated=True,
                                            key=group.key or "")
                    added += 1
            except BaseException as e:
                with self._lock:
                    for ctx in ctxs[added:]:
                        self._inflight.pop(ctx.rid, None)
                if added == 0:
                    with self._lock:
                        if group.key:
                            self._by_key.pop(group.key, None)
                    with group.lock:
                        group.closed = True  # the monitor must not poll it any more
                    raise
                # rows already in the engine end as aborted; the error goes with the last
                group.error = f"batch row {added}: {e}"
                group.remaining = added
                for ctx in ctxs[:added]:
                    self._cancel(ctx)
                self.logger.log_warn(f"[llm] batch row {added} rejected; aborting the {added} row(s) before it")
            if cancelled_early:
                self._cancel(ctxs[0])
            in_engine.extend(ctxs[:added])
        except (InputError, ValueError, RuntimeError) as e:
            self.metrics.request_rejected()
            sender.send(_error_response(str(e), bls), flags=FINAL)
        except Exception as e:  # noqa: BLE001 - never leave a request without FINAL
            self.metrics.request_rejected()
            sender.send(_error_response(f"internal error: {e!r}", bls), flags=FINAL)

    # ---- the sender: runs on the engine's dispatcher thread -----------------------------
    def _on_output(self, out):
        if self._finalized:
            return
        with self._lock:
            ctx = self._inflight.get(out.request_id)
            if ctx is not None and out.finished:
                del self._inflight[out.request_id]
                g = ctx.group
                if g.key and g.remaining <= 1 and self._by_key.get(g.key) is g:
                    del self._by_key[g.key]
        if ctx is None:
            return
        now = time.monotonic()
        new = out.new_token_ids
        if new:
            if ctx.t_first is None:
                ctx.t_first = now
                self.metrics.first_token(now - ctx.t_arrival)
            ctx.t_last = now
            ctx.n_out += len(new)
        if out.finished:
            self._account(ctx, out)
        if out.error is not None:
            self._send(ctx, _error_response(out.error, ctx.group.bls), True)
            return
        if out.finished and ctx.group.error is not None:
            self._send(ctx, _error_response(ctx.group.error, ctx.group.bls), True, only_if_last=True)
            return
        if out.finished and ctx.cancelled and not (ctx.group.bls or ctx.group.stopped):  # else finish_reason "abort"
            self._send(ctx, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "request cancelled", pb_utils.TritonError.CANCELLED)), True, only_if_last=True)
            return
        # n > 1: `finished` comes once, with the request's last output; a sequence ends with
        # its finish_reason
        seq_done = out.finished or out.finish_reason is not None
        seq = ctx.seq(out.index)
        lps = out.new_logprobs or []
        if not ctx.stream:
            seq.pending.extend(new)
            seq.pending_logprobs.extend(lps)
            if not seq_done:
                return
            new, lps = seq.pending, seq.pending_logprobs
        elif not new and not seq_done:
            return
        ids = new
        prefix = seq.tail
        if not seq.first_sent and not ctx.exclude_input:
            ids = list(ctx.prompt) + list(new)
            prefix = []
        seq.first_sent = True
        seq.tail = (seq.tail + list(new))[-PREFIX_WINDOW:]
        # TensorRT-LLM's layout: output_ids [1, beams, N], sequence_length [1, beams]
        # (output_ids first: benchmark_core_model.py reads the first output's shape)
        wanted = ctx.group.outputs
        tensors = [pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1))]
        if wanted is None or "sequence_length" in wanted:
            tensors.append(pb_utils.Tensor("sequence_length", np.asarray([[len(ids)]], dtype=np.int32)))
        if wanted is None or "prefix_ids" in wanted:
            tensors.append(pb_utils.Tensor("prefix_ids", np.asarray(prefix, dtype=np.int32).reshape(1, -1)))
        if wanted is None or "finish_reason" in wanted:
            tensors.append(pb_utils.Tensor("finish_reason", np.asarray(
                [[str(out.finish_reason).encode() if seq_done else b""]], dtype=np.object_)))
        if ctx.batch_size > 1:
            tensors.append(pb_utils.Tensor("batch_index", np.asarray([[ctx.batch_index]], dtype=np.int32)))
        if ctx.n > 1:  # TensorRT-LLM sends sequence_index only with num_return_sequences > 1
            tensors.append(pb_utils.Tensor("sequence_index", np.asarray([[out.index]], dtype=np.int32)))
        if ctx.logprobs:
            tensors.append(pb_utils.Tensor("output_log_probs", sampled_logprobs(new, lps)))
            cum = out.cumulative_logprob if out.cumulative_logprob is not None else 0.0
            tensors.append(pb_utils.Tensor("cum_log_probs", np.asarray([[cum]], dtype=np.float32)))
            if ctx.top_n is not None:
                top_ids, top_vals, ranks = top_logprobs(new, lps, ctx.top_n)
                tensors += [pb_utils.Tensor("top_logprob_ids", top_ids), pb_utils.Tensor("top_logprobs", top_vals),
                            pb_utils.Tensor("output_log_prob_ranks", ranks)]
        if ctx.ret_in:
            tensors.append(pb_utils.Tensor("num_input_tokens",
                                           np.asarray([[len(ctx.prompt)]], dtype=np.int32)))
        if ctx.ret_out:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.asarray([[len(new)]], dtype=np.int32)))
        self._send(ctx, pb_utils.InferenceResponse(output_tensors=tensors), out.finished)

    @staticmethod
    def _send(ctx, response, final, only_if_last=False):
        """`final`: this row's last response; FINAL goes with the group's last row.
        only_if_last: drop the response unless it is the group's last (one cancellation
        error per request, not per row)."""
        g = ctx.group
        # Under the group's lock, as is FINAL: nothing is ever sent after a request's FINAL.
        with g.lock:
            if g.closed:
                return
            flags = 0
            if final:
                g.remaining -= 1
                if g.remaining > 0 and only_if_last:
                    return
                if g.remaining <= 0:
                    g.closed = True
                    flags = FINAL
            t0 = time.perf_counter()
            g.sender.send(response, flags=flags)
            _SENDS.add(time.perf_counter() - t0)
            if flags:
                # Drop the sender now, while the backend is up, and the group <-> rows cycle
                # with it: left to the cyclic collector, a sender can be freed at the stub's
                # exit, after its shared memory is unmapped (a segfault in the stub).
                g.sender, g.rows = None, []

    @staticmethod
    def _is_cancelled(ctx):
        g = ctx.group
        with g.lock:
            if g.closed:
                return False
            return g.sender.is_cancelled()

    def _account(self, ctx, out):
        tpot = (ctx.t_last - ctx.t_first) / (ctx.n_out - 1) if ctx.n_out >= 2 and ctx.t_first is not None else None
        self.metrics.request_finished(str(out.finish_reason) if out.finish_reason is not None else "error",
                                      num_prompt=len(ctx.prompt), num_generated=ctx.n_out, tpot=tpot)

    def _control_cancel(self, arr):
        raw = np.asarray(arr).reshape(-1)[0]
        key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        self._cancel_key(key)

    def _cancel_key(self, key, stopped=False):
        with self._lock:
            group = self._by_key.get(key)
            if group is None and key.startswith(CANCEL_PREFIX):
                # a BLS caller's cancel can overtake its request (sent while the caller's exec()
                # was still delivering it): remembered a while, the request is aborted on arrival
                now = time.monotonic()
                self._early_cancels[key] = now + EARLY_CANCEL_S
                while self._early_cancels and (len(self._early_cancels) > EARLY_CANCEL_MAX
                                               or next(iter(self._early_cancels.values())) < now):
                    self._early_cancels.popitem(last=False)
        if group is None:
            # another instance of this model (one engine core, count > 1) may hold it: Triton
            # sends a cancel or stop to any instance
            self.engine.abort_key(key)
        elif group.rows:
            group.stopped = group.stopped or stopped
            self._cancel(group.rows[0])

    def _cancel(self, ctx):
        """Cancel the whole Triton request: every batch row of ctx's group."""
        for row in ctx.group.rows:
            if not row.cancelled:
                row.cancelled = True
                self.engine.abort(row.rid)

    # ---- monitor: cancellation polling + stats ------------------------------------------
    def _monitor_main(self):
        next_stats = next_ready = 0.0
        while not self._stop.wait(self.cancel_poll_s):
            now = time.monotonic()
            if now >= next_ready:
                next_ready = now + 0.5
                self._watch_readiness()
            # The only cancellation poll (each is_cancelled() is a round trip to the server that
            # competes with the sender): one pass per interval, at most CANCEL_POLLS_PER_S a
            # second in all, the longest-unpolled requests first.
            with self._lock:
                live = [c for c in self._inflight.values() if not c.cancelled]
            budget = max(1, int(self.cancel_poll_s * CANCEL_POLLS_PER_S))
            todo = live if len(live) <= budget else heapq.nsmallest(budget, live, key=_LAST_CANCEL_CHECK)
            for ctx in todo:
                ctx.last_cancel_check = now
                try:
                    if self._is_cancelled(ctx):
                        self._cancel(ctx)
                except Exception:  # noqa: BLE001
                    pass
            if now >= next_stats:
                next_stats = now + self.stats_interval_s
                self._export_stats()

    def _watch_readiness(self):
        # Over the server's own HTTP health API (TRITON_HTTP_PORT, exported by our launcher):
        # pb_utils.is_model_ready() from this thread races execute's IPC and can abort
        # tritonserver 2.51 (boost::interprocess::lock_exception).
        # On SIGINT/SIGTERM tritonserver 2.51 first closes its HTTP endpoint to new connections
        # (it resets them) and waits, up to its exit timeout, for open HTTP connections, and only
        # then for in-flight requests; nothing tells a model. A reset (or refusal) from an
        # endpoint that was serving is that shutdown: abort what is in flight so that every
        # stream gets its FINAL and the server can exit, instead of running out its timeout.
        if self._ready_url is None:
            return
        try:
            with urllib.request.urlopen(self._ready_url, timeout=2) as r:
                ready = r.status == 200
        except urllib.error.HTTPError:
            ready = False
        except (ConnectionError, http.client.RemoteDisconnected) as e:
            self._http_down += 1
            if self._seen_ready and self._http_down >= 2:
                self._stop_serving(f"server is shutting down (its HTTP endpoint {type(e).__name__})")
            return
        except urllib.error.URLError as e:
            if isinstance(e.reason, ConnectionError):
                self._http_down += 1
                if self._seen_ready and self._http_down >= 2:
                    self._stop_serving(f"server is shutting down (its HTTP endpoint {type(e.reason).__name__})")
            return
        except Exception:  # noqa: BLE001 - server busy (timeout): decide next time
            return
        self._http_down = 0
        if ready:
            self._seen_ready = True
        elif self._seen_ready:
            self._stop_serving("unload requested")

    def _stop_serving(self, why):
        """Reject new requests and abort those in flight: each ends with finish_reason "abort"
        and FINAL."""
        if self._unloading:
            return
        self._unloading = True
        with self._lock:
            todo = list(self._inflight.values())
        self.logger.log_info(f"[llm] {why}: aborting {len(todo)} in-flight request(s)")
        for ctx in todo:
            self.engine.abort(ctx.rid)

    def _export_stats(self):
        try:
            self.metrics.export(self.engine, lambda: (_SENDS.count, _SENDS.seconds))
        except Exception as e:  # noqa: BLE001
            self.logger.log_warn(f"[llm] stats export failed: {e!r}")

    def finalize(self):
        # Bounded, in this order: no new requests; the monitor stops polling and exporting;
        # shutdown() aborts every in-flight request, whose final outputs the dispatcher sends
        # (every stream receives FINAL); anything left gets an error FINAL from here; then no
        # thread of this model calls into the server any more (_finalized), before the stub is
        # told to exit.
        self.logger.log_info("[llm] finalize: shutting the engine down")
        self._unloading = True
        self._stop.set()
        self._monitor.join(5)
        try:
            self.engine.shutdown(timeout=FINALIZE_TIMEOUT_S)
        finally:
            with self._lock:
                leftover, self._inflight = list(self._inflight.values()), {}
            for ctx in leftover:  # anything the engine never answered
                try:
                    self._send(ctx, _error_response("model is unloading", ctx.group.bls), True)
                except Exception:  # noqa: BLE001
                    pass
            self._finalized = True
            try:
                self.metrics.flush()  # the last requests' counts
            except Exception:  # noqa: BLE001
                pass
            self.metrics.close()
