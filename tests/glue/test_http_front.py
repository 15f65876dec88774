"""triton_glue.http_front against a stand-in upstream (aiohttp): bodies over the limit get 413
(with Content-Length or chunked), smaller ones pass unchanged, event streams pass chunk by
chunk, generate values of the wrong JSON type get 400 naming the key, an event stream that
tritonserver breaks off ends with an error event, and fail_inflight ends a live event stream
with an error event."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

web = pytest.importorskip("aiohttp.web")

from triton_glue.http_front import BodyLimitProxy, body_problem  # noqa: E402

LIMIT = 1000


@pytest.fixture(scope="module")
def front():
    # Both listeners bind port 0 and report what they got: a port picked free beforehand can
    # be taken as some other test's ephemeral source port before we bind it.
    upstream_sock = socket.socket()
    upstream_sock.bind(("127.0.0.1", 0))
    up_port = upstream_sock.getsockname()[1]
    release = threading.Event()

    async def echo(request):
        body = await request.read()
        return web.json_response({"bytes": len(body), "path": request.path_qs})

    async def headers(request):
        return web.json_response({k.lower(): v for k, v in request.headers.items()})

    async def metadata(request):
        return web.json_response({"inputs": [{"name": "max_tokens", "datatype": "INT32", "shape": [1]},
                                             {"name": "text_input", "datatype": "BYTES", "shape": [1]}]})

    async def stream(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {{\"i\": {i}}}\n\n".encode())
            await asyncio.sleep(0.05)
        if request.query.get("crash"):   # the server dies mid-stream: the connection just closes
            request.transport.abort()
            return resp
        while not release.is_set():   # then hangs, like a request on a dead stub
            await asyncio.sleep(0.05)
        try:
            await resp.write_eof()
        except ConnectionError:       # the front dropped this upstream request: expected
            pass
        return resp

    def serve_upstream(started):
        loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/echo", echo)
        app.router.add_post("/headers", headers)
        app.router.add_get("/v2/models/m", metadata)
        app.router.add_post("/v2/models/m/generate", echo)
        app.router.add_post("/v2/models/m/generate_stream", stream)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, upstream_sock).start())
        started.set()
        loop.run_forever()

    started = threading.Event()
    threading.Thread(target=serve_upstream, args=(started,), daemon=True).start()
    assert started.wait(10)
    proxy = BodyLimitProxy("127.0.0.1", 0, up_port, LIMIT)
    proxy.start()
    yield proxy, proxy.port, release
    release.set()
    proxy.stop()


def request(port, method, path, body=None, headers=None, chunked=False):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
    r = c.getresponse()
    return r.status, r.read().decode()


def test_bodies_over_the_limit_get_413(front):
    _, port, _ = front
    status, text = request(port, "POST", "/echo", b"x" * (LIMIT + 1))
    assert status == 413 and f"{LIMIT + 1} bytes exceeds the limit of {LIMIT} bytes" in text
    status, text = request(port, "POST", "/echo", iter([b"x" * 600, b"x" * 600]), chunked=True)
    assert status == 413 and "HTTP_MAX_BODY_BYTES" in text


def test_bodies_within_the_limit_pass_unchanged(front):
    _, port, _ = front
    status, text = request(port, "POST", "/echo?a=1", b"y" * LIMIT)
    assert status == 200 and json.loads(text) == {"bytes": LIMIT, "path": "/echo?a=1"}


def upstream_headers(port: int, headers: dict) -> dict:
    """The headers tritonserver's side receives for a POST carrying exactly `headers`
    (http.client adds none of its own but Host and Content-Length)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.putrequest("POST", "/headers", skip_accept_encoding=True)
    for k, v in {**headers, "Content-Length": "2"}.items():
        c.putheader(k, v)
    c.endheaders(b"{}")
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Encoding") is None
    return json.loads(r.read())


def test_request_headers_reach_tritonserver_as_the_client_sent_them(front):
    """No header of the proxy's own: an Accept-Encoding the client did not send made
    tritonserver gzip its answers to curl and perf_analyzer, which cannot read them."""
    _, port, _ = front
    seen = upstream_headers(port, {"Content-Type": "application/json"})
    for added in ("accept-encoding", "accept", "user-agent"):
        assert added not in seen, seen
    assert seen["content-type"] == "application/json"
    seen = upstream_headers(port, {"Accept-Encoding": "gzip", "User-Agent": "perf_analyzer", "Accept": "*/*"})
    assert (seen["accept-encoding"], seen["user-agent"], seen["accept"]) == ("gzip", "perf_analyzer", "*/*")
    assert "content-type" not in seen, seen


def test_generate_values_of_the_wrong_json_type_get_400_naming_the_key(front):
    _, port, _ = front
    status, text = request(port, "POST", "/v2/models/m/generate", json.dumps({"text_input": "a", "max_tokens": "3"}))
    assert status == 400 and json.loads(text)["error"].startswith("max_tokens: must be an integer"), text
    status, text = request(port, "POST", "/v2/models/m/generate", json.dumps({"text_input": 5, "max_tokens": 3}))
    assert status == 400 and json.loads(text)["error"].startswith("text_input: must be a string"), text
    # tritonserver would narrow these without a word: 4294967299 -> 3
    for big in (2 ** 31, 4294967299, -2 ** 31 - 1):
        status, text = request(port, "POST", "/v2/models/m/generate", json.dumps({"text_input": "a", "max_tokens": big}))
        assert status == 400, (big, status, text)
        assert json.loads(text)["error"] == (f"max_tokens: must be an integer in [-2147483648, 2147483647] or a list of "
                                             f"them (input of type INT32), got {big}"), text
    status, _ = request(port, "POST", "/v2/models/m/generate", json.dumps({"text_input": "a", "max_tokens": 2 ** 31 - 1}))
    assert status == 200
    # tritonserver reads the first of two keys, the front's check and the models the last
    status, text = request(port, "POST", "/v2/models/m/generate", '{"text_input": "a", "max_tokens": "3", "max_tokens": 3}')
    assert status == 400 and json.loads(text)["error"] == "max_tokens: given more than once in the request body", text
    # a body past the test's LIMIT; the front's real limit is megabytes
    assert body_problem(b'{"text_input": "a", "max_tokens": ' + b"[" * 100000) == ("request body: JSON nested too deeply", None)
    assert body_problem(b'{"a": [[1]]}') == (None, {"a": [[1]]}) and body_problem(b"{") == (None, None)
    # keys that are not inputs are the model's business (request parameters)
    status, _ = request(port, "POST", "/v2/models/m/generate", json.dumps({"text_input": "a", "temprature": "x"}))
    assert status == 200


def events_of(port: int, path: str, on_event=lambda events: None) -> list:
    """The data events of an event stream, in order; on_event(events) after each."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, body=b"{}")
    r = c.getresponse()
    assert r.status == 200
    events = []
    for line in r:
        if line.startswith(b"data:"):
            events.append(json.loads(line[5:]))
            on_event(events)
    return events


def test_an_event_stream_broken_off_upstream_ends_with_an_error_event(front):
    _, port, _ = front
    events = events_of(port, "/v2/models/m/generate_stream?crash=1")
    assert events[:3] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert len(events) == 4 and events[3]["error"].startswith(
        "tritonserver ended the stream before its final response (the server may have crashed): "), events
    status, _ = request(port, "POST", "/echo", b"z")  # the front still serves
    assert status == 200


def test_event_streams_pass_and_fail_inflight_ends_them_with_an_error(front):
    proxy, port, _ = front

    def fail_after_three(events):
        if len(events) == 3:
            proxy.fail_inflight("the Python stub of model 'llm' died")

    events = events_of(port, "/v2/models/m/generate_stream", fail_after_three)
    assert events[:3] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert events[3:] == [{"error": "the Python stub of model 'llm' died"}]
    status, text = request(port, "GET", "/v2/models/m")
    assert status == 503 and "died" in text


def test_stop_with_a_message_ends_live_event_streams_with_it_before_the_front_closes(front):
    """tritonserver died (the supervisor stops the front at once): a stream whose upstream read
    has not yet seen the break still gets an error event naming the death, not a bare close
    (which http.client reads as a clean end)."""
    first, _, _ = front
    proxy = BodyLimitProxy("127.0.0.1", 0, first.upstream_port, LIMIT)
    proxy.start()
    message = "tritonserver died of SIGKILL before this stream's final response"

    def stop_after_three(events):
        if len(events) == 3:
            proxy.stop(message)

    t0 = time.monotonic()
    events = events_of(proxy.port, "/v2/models/m/generate_stream", stop_after_three)
    assert events == [{"i": 0}, {"i": 1}, {"i": 2}, {"error": message}]
    assert time.monotonic() - t0 < 5
    assert not proxy._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        request(proxy.port, "GET", "/v2/models/m")
