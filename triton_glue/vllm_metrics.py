"""vllm_backend's metrics and cancellation logs for the `vllm_model` route, so dashboards and
log checks written for triton-inference-server/vllm_backend keep working.

Names, kinds, labels ({model, version}) and buckets follow vllm_backend's src/utils/metrics.py;
`vllm:request_success_total{finished_reason}` and the running/waiting gauges are vLLM's own
(vllm_backend of the vLLM 0.x days exported them too). Reported only when the model's
REPORT_CUSTOM_METRICS parameter is "true", as in vllm_backend. Differences, by construction:
counts are per request of this route (not per engine iteration), taken when the request ends;
`vllm:time_per_output_token_seconds` has one sample per token after the first (a response
carrying k tokens contributes k samples of its gap / k); running = requests of this route that
have their first token, waiting = those still before it.

pb_utils is passed in; nothing here imports it.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from .bls import RequestHooks, RouteHooks
from .inputs import TextRequest
from .metrics import _Locked  # one owner of the serialized-metric wrapper
from .vllm_compat import VLLM_ERROR_PREFIX

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
N_BUCKETS = [1, 2, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(max_value: int) -> list[int]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


def report_custom_metrics(params: dict[str, str]) -> bool:
    return params.get("REPORT_CUSTOM_METRICS", "").strip().lower() == "true"


class VllmRouteHooks(RouteHooks):
    """Cancellation logs and vllm_backend's wording of errors always; vllm:* metrics when
    `metrics` is on."""

    def __init__(self, pb_utils: Any, labels: dict[str, str], metrics: bool, max_model_len: int = 2048):
        self.logger = pb_utils.Logger
        self.m = _Metrics(pb_utils, labels, max_model_len) if metrics else None
        self._lock = threading.Lock()
        self._running = self._waiting = 0

    def request(self, req: TextRequest) -> RequestHooks:
        return _Request(self, req)

    def error_message(self, message: str) -> str:
        # vllm_backend words every request error so, the upstream's and the tokenizer's too
        return message if message.startswith(VLLM_ERROR_PREFIX) else VLLM_ERROR_PREFIX + message

    def _gauges(self, d_running: int, d_waiting: int) -> None:
        if self.m is None:
            return
        with self._lock:
            self._running += d_running
            self._waiting += d_waiting
            self.m.running.set(self._running)
            self.m.waiting.set(self._waiting)

    def close(self) -> None:
        if self.m is not None:
            self.m.close()
            self.m = None


class _Request(RequestHooks):
    def __init__(self, route: VllmRouteHooks, req: TextRequest):
        self.route = route
        self.t0 = self.t_last = time.monotonic()
        self.first = True
        self.done = False
        # n > 1 runs as n sequences (triton_glue/sequences.py): each counts its own tokens, the
        # first one observes the request's n
        self.n = 1 if req is None else (req.num_sequences if req.sequence_index == 0 else None)
        route._gauges(0, 1)

    def tokens(self, n: int) -> None:
        m, now = self.route.m, time.monotonic()
        if m is not None:
            if self.first:
                m.ttft.observe(now - self.t0)
                n -= 1
            gap = (now - self.t_last) / n if n > 0 and not self.first else 0.0
            for _ in range(n):
                m.tpot.observe(gap)
        if self.first:
            self.first = False
            self.route._gauges(1, -1)
        self.t_last = now

    def cancelling(self) -> None:
        self.route.logger.log_info("[vllm] Cancelling the request")

    def cancelled(self) -> None:
        self.route.logger.log_info("[vllm] Successfully cancelled the request")

    def _leave_gauges(self) -> bool:
        """False when the request has left them already."""
        if self.done:
            return False
        self.done = True
        self.route._gauges(-1 if not self.first else 0, -1 if self.first else 0)
        return True

    def failed(self) -> None:
        # counted in no vllm:* series but the gauges: as in vLLM, where a rejected request
        # never finishes
        self._leave_gauges()

    def finished(self, reason: str, num_prompt: int, num_generated: int) -> None:
        if not self._leave_gauges():
            return
        m = self.route.m
        if m is None:
            return
        m.prompt_tokens.increment(num_prompt)
        m.generation_tokens.increment(num_generated)
        m.e2e.observe(time.monotonic() - self.t0)
        m.req_prompt.observe(num_prompt)
        m.req_gen.observe(num_generated)
        if self.n is not None:
            m.n.observe(self.n)
        m.success[reason if reason in m.success else "abort"].increment(1)


class _Metrics:
    def __init__(self, pb: Any, labels: dict[str, str], max_model_len: int):
        MF = pb.MetricFamily
        self._lock = threading.Lock()
        self._families = []

        def fam(name, kind, desc):
            f = MF(name=name, description=desc, kind=kind)
            self._families.append(f)
            return f

        def metric(f, extra=None, buckets=None):
            lab = dict(labels, **(extra or {}))
            return _Locked(f.Metric(labels=lab, buckets=buckets) if buckets else f.Metric(labels=lab), self._lock)

        self.prompt_tokens = metric(fam("vllm:prompt_tokens_total", MF.COUNTER, "Number of prefill tokens processed."))
        self.generation_tokens = metric(fam("vllm:generation_tokens_total", MF.COUNTER,
                                            "Number of generation tokens processed."))
        self.ttft = metric(fam("vllm:time_to_first_token_seconds", MF.HISTOGRAM,
                               "Histogram of time to first token in seconds."), buckets=TTFT_BUCKETS)
        self.tpot = metric(fam("vllm:time_per_output_token_seconds", MF.HISTOGRAM,
                               "Histogram of time per output token in seconds."), buckets=TPOT_BUCKETS)
        self.e2e = metric(fam("vllm:e2e_request_latency_seconds", MF.HISTOGRAM,
                              "Histogram of end to end request latency in seconds."), buckets=E2E_BUCKETS)
        lens = buckets_1_2_5(max_model_len)
        self.req_prompt = metric(fam("vllm:request_prompt_tokens", MF.HISTOGRAM,
                                     "Number of prefill tokens processed."), buckets=lens)
        self.req_gen = metric(fam("vllm:request_generation_tokens", MF.HISTOGRAM,
                                  "Number of generation tokens processed."), buckets=lens)
        self.n = metric(fam("vllm:request_params_n", MF.HISTOGRAM, "Histogram of the n request parameter."),
                        buckets=N_BUCKETS)
        f = fam("vllm:request_success_total", MF.COUNTER, "Count of successfully processed requests.")
        self.success = {r: metric(f, {"finished_reason": r}) for r in FINISH_REASONS}
        self.running = metric(fam("vllm:num_requests_running", MF.GAUGE, "Number of requests in model execution."))
        self.waiting = metric(fam("vllm:num_requests_waiting", MF.GAUGE, "Number of requests waiting to be processed."))

    def close(self) -> None:
        # metrics before their families (the Python backend requires that order)
        for attr in list(vars(self)):
            if attr not in ("_families", "_lock"):
                setattr(self, attr, None)
        self._families.clear()
