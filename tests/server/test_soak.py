"""Soak: ~600 streaming requests at concurrency 32 over `ensemble`, `llm_bls`, `vllm_model` and
`llm`, gRPC and HTTP, ~30 % cancelled by the client at random points (gRPC
stop_stream(cancel_requests=True), HTTP disconnect), ~30 % with stop strings picked from the
model's own greedy output so that they match mid-stream.

Asserted: every request that was not cancelled ends with exactly one FINAL (or an error) within
HANG_S and carries the in-process engine's greedy text (cut at its stop); a cancelled one has
received a prefix of it; the server stays alive and ready; afterwards a greedy request alone
gives the same text as before the soak on every route; `llm` holds no request and no KV block;
no BLS worker is left in flight (`bls_inflight_requests`); the stubs' RSS grows by less than
RSS_GROWTH_BOUND_MB. The figures are printed (run with -s to see them).

SOAK_REQUESTS / SOAK_SEED in the environment change the size and the draw.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest

from backend_lib import SamplingParams
from triton_glue.detokenizer import full_text

from .util import StreamClient, wait_for

N_REQUESTS = int(os.environ.get("SOAK_REQUESTS", "600"))
SEED = int(os.environ.get("SOAK_SEED", "9"))
CONCURRENCY = 32
WARMUP_REQUESTS = 96
MAX_TOKENS = 16
ROUTES = ("ensemble", "llm_bls", "vllm_model", "llm")
BLS_ROUTES = ("llm_bls", "vllm_model")
P_CANCEL, P_STOP = 0.3, 0.3
HANG_S = 90.0  # a loaded 2-core CI box answers a 16-token request in a few seconds
# Per stub process, after a warm-up at the same concurrency (thread pools, allocator arenas,
# tokenizer caches and the engine's buffers are at their steady size then). Python's allocator
# keeps freed arenas, so some growth is noise; a leak of what one request holds (a response
# iterator with its tensors, a worker thread's stack, a detokenizer: >= 64 KiB) over 600
# requests would be >= 38 MiB.
RSS_GROWTH_BOUND_MB = 32
# ThreadPoolExecutor adds a thread when none is idle at submit; at the same concurrency as
# the warm-up a few more may appear, a leaked worker per stop string or cancel is ~45 each
THREAD_SLACK = 12
STUB_MODELS = ("llm", "llm_bls", "vllm_model", "preprocessing", "postprocessing")
PROMPTS = [f"Soak {i}: tell me about {w}" for i, w in
           enumerate(["the sea", "rivers", "a cat", "mountains", "old books", "the moon", "bread", "trains"])]


# ---- references from the in-process engine -------------------------------------------------
@dataclass
class Ref:
    prompt: str
    ids: list[int]
    out: list[int]                 # greedy output, MAX_TOKENS (EOS allowed)
    text: str                      # its text
    stop_str: Optional[str] = None     # vllm_model: a stop string inside `text` (matched on text)
    stop_text: Optional[str] = None    # what vllm_model returns with it (the stop string cut)
    stop_word: Optional[str] = None    # ensemble / llm_bls: a stop word (token sequence, kept)
    stop_word_text: Optional[str] = None
    stop_token: Optional[int] = None   # llm: a stop token id
    stop_token_out: Optional[list[int]] = None


def _pick_stop_string(text: str) -> Optional[str]:
    for k in range(max(2, len(text) // 3), len(text) - 3):
        s = text[k:k + 3]
        if "\ufffd" not in s and s.strip() == s and text.find(s) == k:
            return s
    return None


def _build_ref(tok, engine, prompt: str) -> Ref:
    ids = tok.encode(prompt)
    greedy = lambda **kw: list(engine.generate([ids], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, **kw))[0].token_ids)
    out = greedy()
    text = full_text(tok, ids, out)
    ref = Ref(prompt, ids, out, text)
    ref.stop_str = _pick_stop_string(text)
    if ref.stop_str is not None:
        ref.stop_text = text[: text.find(ref.stop_str)]
    for k in range(2, len(out) - 2):
        tid = out[k]
        if tid in out[:k] or ref.stop_token is not None:
            continue
        stop_out = greedy(stop_token_ids=[tid])
        if len(stop_out) == k + 1:
            ref.stop_token, ref.stop_token_out = tid, stop_out
    # TensorRT-LLM's stop words: each encoded alone (preprocessing), the engine stops on the
    # sequence and keeps it; pick two output tokens whose text encodes back to them
    for k in range(2, len(out) - 3):
        seq = out[k:k + 2]
        word = tok.decode(seq)
        if not word.strip() or "\ufffd" in word or tok.encode(word, add_special_tokens=False) != seq:
            continue
        stop_out = greedy(stop_sequences=[seq])
        if len(stop_out) == k + 2:
            ref.stop_word, ref.stop_word_text = word, full_text(tok, ids, stop_out)
            break
    return ref


@pytest.fixture(scope="module")
def refs(tokenizer, reference_engine) -> list[Ref]:
    return [_build_ref(tokenizer, reference_engine, p) for p in PROMPTS]


# ---- one request ---------------------------------------------------------------------------
@dataclass
class Plan:
    n: int
    route: str
    transport: str              # grpc | http
    ref: Ref
    stop: bool
    cancel_after: Optional[int]  # cancel once this many responses arrived (0: right away)


@dataclass
class Outcome:
    plan: Plan
    text: str = ""
    ids: list = field(default_factory=list)
    finals: int = 0
    errors: list = field(default_factory=list)
    cancelled: bool = False     # the client cancelled before the FINAL arrived
    hung: bool = False
    seconds: float = 0.0


def _body(plan: Plan, http: bool) -> dict:
    ref, route = plan.ref, plan.route
    if route == "llm":
        b = {"input_ids": ref.ids if http else np.array([ref.ids], dtype=np.int32), "max_tokens": MAX_TOKENS,
             "temperature": 0.0, "stream": True, "exclude_input_in_output": True}
        if plan.stop:
            b["stop_token_ids"] = [ref.stop_token] if http else np.array([[ref.stop_token]], dtype=np.int32)
        return b
    if route == "vllm_model":
        sp = {"max_tokens": MAX_TOKENS, "temperature": 0}
        if plan.stop:
            sp["stop"] = [ref.stop_str]
        return {"text_input": ref.prompt, "stream": True, "exclude_input_in_output": True,
                "sampling_parameters": json.dumps(sp)}
    b = {"text_input": ref.prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
         "exclude_input_in_output": True}
    if plan.stop:
        b["stop_words"] = [ref.stop_word]
    return b


def _expected(plan: Plan):
    """(text, ids) the route must return for this plan when it is not cancelled."""
    ref, r = plan.ref, plan.route
    if r == "llm":
        return None, (ref.stop_token_out if plan.stop else ref.out)
    if not plan.stop:
        return ref.text, None
    return (ref.stop_text if r == "vllm_model" else ref.stop_word_text), None


def _run_grpc(url: str, plan: Plan) -> Outcome:
    o = Outcome(plan)
    t0 = time.monotonic()
    sc = StreamClient(url)
    try:
        c = sc.send(plan.route, _body(plan, False), f"soak{plan.n}", batched=plan.route != "vllm_model")
        if plan.cancel_after is not None:
            wait_for(lambda: len(c.responses) >= plan.cancel_after or c.done.is_set(), HANG_S, 0.005)
            o.cancelled = not c.done.is_set()
            if not o.cancelled:
                time.sleep(0.05)  # a second FINAL would arrive right after the first
        else:
            o.hung = not c.done.wait(HANG_S)
            time.sleep(0.05)
    finally:
        sc.close(cancel=o.cancelled)
    o.seconds = time.monotonic() - t0
    if plan.route == "llm":
        o.ids = sum(c.ids(), [])
    else:
        o.text = "".join(c.texts())
    if not o.cancelled:
        o.finals, o.errors = c.finals, list(c.errors)
    return o


def _run_http(host: str, port: int, plan: Plan) -> Outcome:
    """generate_stream; with cancel_after, the connection is dropped after that many events."""
    o = Outcome(plan)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=HANG_S)
    try:
        conn.request("POST", f"/v2/models/{plan.route}/generate_stream", json.dumps(_body(plan, True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            o.errors.append(f"HTTP {resp.status}: {resp.read().decode(errors='replace')}")
            o.finals = 1
            return o
        events = 0
        while True:
            if plan.cancel_after is not None and events >= plan.cancel_after:
                o.cancelled = True
                break
            try:
                line = resp.readline()
            except TimeoutError:
                o.hung = True
                break
            if not line:  # the body ended: the server sent the FINAL response
                o.finals = 1
                break
            if not line.startswith(b"data:"):
                continue
            events += 1
            ev = json.loads(line[5:])
            if "error" in ev:
                o.errors.append(ev["error"])
            elif plan.route == "llm":
                o.ids += list(np.asarray(ev["output_ids"]).reshape(-1).tolist())
            else:
                v = ev["text_output"]
                o.text += "".join(v) if isinstance(v, list) else v
        resp.close()
    finally:
        conn.close()  # with cancel_after: the disconnect that cancels the request
        o.seconds = time.monotonic() - t0
    return o


def _plans(refs: list[Ref], n: int, rng: random.Random) -> list[Plan]:
    plans = []
    for i in range(n):
        route = ROUTES[i % len(ROUTES)]
        transport = rng.choice(("grpc", "http"))
        u = rng.random()
        cancel_after = rng.randint(0, 6) if u < P_CANCEL else None
        ref = rng.choice(refs)
        has_stop = {"llm": ref.stop_token, "vllm_model": ref.stop_str}.get(route, ref.stop_word) is not None
        stop = P_CANCEL <= u < P_CANCEL + P_STOP and has_stop
        plans.append(Plan(i, route, transport, ref, stop, cancel_after))
    return plans


def _run_all(server, plans: list[Plan]) -> list[Outcome]:
    def one(plan: Plan) -> Outcome:
        try:
            if plan.transport == "grpc":
                return _run_grpc(server.grpc_url, plan)
            return _run_http("127.0.0.1", server.http_port, plan)
        except Exception as e:  # noqa: BLE001 - e.g. the server went away: reported below
            return Outcome(plan, errors=[f"client: {e!r}"])

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, plans))


# ---- server-side probes ----------------------------------------------------------------------
def _stub_pids(server) -> dict[str, int]:
    pids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != server.proc.pid:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for m in STUB_MODELS:
            if any(a.endswith(f"/{m}/1/model.py".encode()) for a in argv):
                pids[m] = int(d)
    return pids


def _proc_status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _rss_mb(pid: int) -> float:
    return _proc_status(pid, "VmRSS") / 1024


def _threads(pid: int) -> int:
    """Threads of a stub: a BLS worker that never finishes stays one (ThreadPoolExecutor starts
    a new thread for the next request), so this counts leaked workers without the gauge."""
    return _proc_status(pid, "Threads")


def _ready(server) -> bool:
    try:
        for path in ["/v2/health/ready", "/v2/health/live"] + [f"/v2/models/{m}/ready" for m in ROUTES]:
            with urllib.request.urlopen(f"http://{server.http_url}{path}", timeout=10) as r:
                if r.status != 200:
                    return False
        return True
    except Exception:  # noqa: BLE001
        return False


def _greedy_alone(server, refs: list[Ref]) -> dict[str, object]:
    """One greedy request per route, alone: its text (ids for llm)."""
    plans = [Plan(-1 - i, r, "grpc", refs[0], False, None) for i, r in enumerate(ROUTES)]
    return {p.route: (o.ids if p.route == "llm" else o.text)
            for p, o in zip(plans, (_run_grpc(server.grpc_url, p) for p in plans))}


def _assert_alive(server, phase: str, outcomes: list[Outcome]) -> None:
    summary = (f"{sum(bool(o.errors) for o in outcomes)} errors, {sum(o.hung for o in outcomes)} hangs "
               f"in {len(outcomes)} requests")
    assert server.proc.poll() is None, \
        f"tritonserver died during {phase} (rc={server.proc.returncode}; {summary}):\n{server.log_tail(40)}"
    assert _ready(server), f"server or a model not ready after {phase} ({summary})"


def _assert_drained(server) -> None:
    assert wait_for(server.idle, 30, 0.2), (
        "llm still holds requests or KV blocks: "
        + str({n: server.metric(n) for n in ("llm_num_requests_running", "llm_num_requests_waiting",
                                             "llm_kv_blocks_used")}))
    left = lambda: {r: server.metric("bls_inflight_requests", route=r) for r in BLS_ROUTES}
    assert wait_for(lambda: not any(left().values()), 30, 0.2), f"BLS workers left in flight: {left()}"


# ---- the soak ------------------------------------------------------------------------------
def test_soak_streams_cancels_stops(server, refs):
    _soak(server, refs, N_REQUESTS)


def _server_with(tmp_path_factory, name: str, param: str, value: str, logged: str):
    """A server of its own with one llm parameter set (LLM_PARAM_<param>); after its tests, no
    traceback in its log, and `logged` there (the setting took effect)."""
    from .conftest import SharedServer, _checked
    shared = SharedServer(tmp_path_factory.mktemp(name), extra_env={f"LLM_PARAM_{param}": value})
    try:
        yield from _checked(shared)
    finally:
        shared.srv.stop()
    log = shared.srv.log_path.read_text(errors="replace")
    assert not [l for l in log.splitlines() if "Traceback" in l], shared.srv.log_tail(120)
    assert logged in log


@pytest.fixture(scope="module")
def server_with_delivery_threads(tmp_path_factory):
    yield from _server_with(tmp_path_factory, "triton-delivery", "delivery_threads", "3", "3 delivery thread(s)")


def test_soak_with_three_delivery_threads(server_with_delivery_threads, refs):
    """llm's responses built and sent on three threads at once (delivery_threads=3; send()
    runs concurrently into tritonserver): the same soak, a third of its size."""
    _soak(server_with_delivery_threads, refs, N_REQUESTS // 3)


def _soak(server, refs, n_requests: int) -> None:
    assert all(r.stop_str for r in refs[:2]) and any(r.stop_word for r in refs) \
        and any(r.stop_token for r in refs), "the greedy outputs give no stop strings to test with"
    assert wait_for(lambda: _ready(server), 30)
    before = _greedy_alone(server, refs)
    assert before["llm"] == refs[0].out and before["vllm_model"] == refs[0].text
    assert before["ensemble"] == refs[0].text and before["llm_bls"] == refs[0].text

    rng = random.Random(SEED)
    warm = _run_all(server, _plans(refs, WARMUP_REQUESTS, rng))  # steady state for the RSS baseline
    _assert_alive(server, "the warm-up", warm)
    _assert_drained(server)
    pids = _stub_pids(server)
    assert set(pids) == set(STUB_MODELS), pids
    rss_before = {m: _rss_mb(p) for m, p in pids.items()}
    threads_before = {m: _threads(pids[m]) for m in BLS_ROUTES}

    plans = _plans(refs, n_requests, rng)
    t0 = time.monotonic()
    outcomes = _run_all(server, plans)
    soak_s = time.monotonic() - t0

    _assert_alive(server, "the soak", outcomes)
    hangs = [o for o in outcomes if o.hung]
    errors = [o for o in outcomes if o.errors]
    bad_finals = [o for o in outcomes if not o.cancelled and not o.hung and o.finals != 1]
    cancels = [o for o in outcomes if o.cancelled]
    wrong, stop_hits = [], 0
    for o in outcomes:
        exp_text, exp_ids = _expected(o.plan)
        got = o.ids if o.plan.route == "llm" else o.text
        exp = exp_ids if o.plan.route == "llm" else exp_text
        if o.cancelled:
            ok = got == exp[: len(got)]
        elif o.hung or o.errors:
            continue
        else:
            ok = got == exp
            stop_hits += bool(o.plan.stop and ok)
        if not ok:
            wrong.append((o.plan.n, o.plan.route, o.plan.transport, o.plan.stop, o.plan.cancel_after, got, exp))

    # idle pool threads stay (up to the soak's concurrency); the upstream readers have ended
    threads_grown = {m: _threads(pids[m]) - threads_before[m] for m in BLS_ROUTES}
    assert wait_for(lambda: all(_threads(pids[m]) - threads_before[m] <= THREAD_SLACK for m in BLS_ROUTES), 30), \
        f"BLS stub threads grew (leaked workers): {threads_grown}"
    _assert_drained(server)
    rss_after = {m: _rss_mb(p) for m, p in pids.items()}
    after = _greedy_alone(server, refs)
    figures = {
        "requests": len(outcomes), "seconds": round(soak_s, 1),
        "per_route": {r: sum(o.plan.route == r for o in outcomes) for r in ROUTES},
        "cancels": len(cancels),
        "cancels_grpc": sum(o.plan.transport == "grpc" for o in cancels),
        "cancels_http": sum(o.plan.transport == "http" for o in cancels),
        "stop_requests": sum(o.plan.stop for o in outcomes), "stop_hits": stop_hits,
        "errors": len(errors), "hangs": len(hangs), "wrong_text": len(wrong),
        "bls_stub_threads_grown": {m: _threads(pids[m]) - threads_before[m] for m in BLS_ROUTES},
        "rss_mb_before": {m: round(v, 1) for m, v in rss_before.items()},
        "rss_mb_after": {m: round(v, 1) for m, v in rss_after.items()},
    }
    print("\nSOAK FIGURES " + json.dumps(figures))
    assert not hangs, [(o.plan, o.seconds) for o in hangs[:5]]
    assert not errors, [(o.plan.n, o.plan.route, o.errors) for o in errors[:5]]
    assert not bad_finals, [(o.plan.n, o.plan.route, o.finals) for o in bad_finals[:5]]
    assert not wrong, wrong[:5]
    assert len(cancels) >= n_requests * P_CANCEL / 2 and stop_hits >= n_requests * P_STOP / 2, figures
    assert after == before, (before, after)
    grown = {m: rss_after[m] - rss_before[m] for m in pids}
    assert all(g < RSS_GROWTH_BOUND_MB for g in grown.values()), grown


# (route, body, what the error names): rejected by the `llm` engine, not by the BLS route, so
# the error travels back to the route in-band (see triton_glue/bls.py)
UPSTREAM_REJECTS = [
    ("llm_bls", {"text_input": "Hi", "max_tokens": 10**9}, "max_tokens"),
    ("llm_bls", {"text_input": "Hi", "max_tokens": 3, "temperature": -1.0}, "temperature"),
    ("vllm_model", {"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": 3, "top_p": 1.5})}, "top_p"),
    ("vllm_model", {"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": 10**9})}, "max_tokens"),
    ("vllm_model", {"text_input": "word " * 2100, "sampling_parameters": json.dumps({"max_tokens": 3})},
     "max_model_len"),
]


def test_bls_upstream_rejections_release_workers(server):
    def one(i: int):
        route, body, needle = UPSTREAM_REJECTS[i % len(UPSTREAM_REJECTS)]
        sc = StreamClient(server.grpc_url)
        try:
            c = sc.send(route, {**body, "stream": True}, f"rej{i}", batched=route != "vllm_model")
            done = c.done.wait(HANG_S)
            time.sleep(0.05)
        finally:
            sc.close()
        return route, needle, done, c

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8 * len(UPSTREAM_REJECTS))))
    for route, needle, done, c in results:
        assert done and c.finals == 1 and len(c.errors) == 1, (route, c.errors)
        assert needle in c.errors[0], (route, c.errors[0])
    _assert_alive(server, "the rejected requests", [])
    _assert_drained(server)


@pytest.fixture(scope="module")
def server_with_stream_interval(tmp_path_factory):
    yield from _server_with(tmp_path_factory, "triton-interval", "stream_interval", "3", "'stream_interval': '3'")


def test_soak_with_a_stream_interval(server_with_stream_interval, refs):
    """llm's engine outputs a request's tokens in chunks of three (stream_interval=3): the same
    soak, a third of its size (stop strings inside a chunk, cancels while tokens are held)."""
    _soak(server_with_stream_interval, refs, N_REQUESTS // 3)


@pytest.fixture(scope="module")
def server_with_async_handoff(tmp_path_factory):
    yield from _server_with(tmp_path_factory, "triton-async", "async_token_handoff", "on",
                            "'async_token_handoff': 'on'")


def test_soak_with_the_overlapped_path(server_with_async_handoff, refs):
    """async_token_handoff=on (the overlapped path, emulated on CPU), so llm's shipped
    step_lookahead=2 is in force: two steps are launched before the host reads the oldest, and
    a stop or cancel lands while a request still has steps in flight. The same soak, a third of
    its size; the steps ran overlapped (llm_async_steps_total)."""
    _soak(server_with_async_handoff, refs, N_REQUESTS // 3)
    assert server_with_async_handoff.metric("llm_async_steps_total") > 0
