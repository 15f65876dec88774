"""The public HTTP port: a small reverse proxy in front of tritonserver's HTTP endpoint that
rejects request bodies over a limit with 413 before they reach the server.

Why: tritonserver 2.51's HTTP frontend dies (Signal 11) on a request body of about half its
thread stack size or more, on any endpoint (measured: 8 MiB stack -> between 4.0 and 4.5 MB
crashes; 64 MiB -> 32-64 MB; 256 MiB -> 100-200 MB); 2.51 has no body-size option, and a
compressed body is not affected (only the bytes on the wire count). The launcher raises the
stack limit and runs this front with a limit well below the crash threshold; tritonserver's
own HTTP endpoint listens on a private loopback port.

It also checks the JSON types of HTTP generate requests: tritonserver 2.51 answers a value of
the wrong JSON type for an input (`"max_tokens": "3"`) with a 500 that names no field
("Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"); the
front answers 400 naming the key and the type the input takes (from the model's metadata).
So it does for what tritonserver would misread: an integer out of the input's range (2.51
narrows it), a key given twice (2.51 reads the first, the models the last), JSON nested past
Python's recursion limit. Keys that are not inputs are left alone: tritonserver passes them on as request parameters,
and the models reject the ones they do not read.

Everything else is passed through unchanged: method, path, query, headers (minus hop-by-hop
ones), the body, and the response streamed chunk by chunk (generate_stream's server-sent
events arrive as they are produced). A client that disconnects cancels its upstream request,
which closes the upstream connection, so tritonserver sees the disconnect as before.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from typing import Any, Optional

log = logging.getLogger("triton_glue.http_front")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
LIMIT_ENV = "HTTP_MAX_BODY_BYTES"
DRAIN_S = 30.0   # how long a rejected body is read and dropped
METADATA_TTL_S = 30.0
GENERATE_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/generate(?:_stream)?$")


def json_type_problem(datatype: str, value: Any) -> Optional[str]:
    """Why `value` (a generate request's JSON value) cannot fill an input of `datatype`, or None."""
    if datatype == "BYTES":
        ok, kind = (lambda v: isinstance(v, str)), "a string"
    elif datatype == "BOOL":
        ok, kind = (lambda v: isinstance(v, bool)), "true or false"
    elif datatype.startswith("INT") or datatype.startswith("UINT"):
        # tritonserver 2.51 narrows an integer out of the input's range without a word
        # (4294967299 becomes 3 for an INT32)
        lo, hi = integer_range(datatype)
        ok = (lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi)
        kind = f"an integer in [{lo}, {hi}]"
    elif datatype.startswith("FP") or datatype == "BF16":
        ok, kind = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
    else:
        return None
    values = value if isinstance(value, list) else [value]
    for v in values:
        for x in (v if isinstance(v, list) else [v]):
            if not ok(x):
                return f"must be {kind} or a list of them (input of type {datatype}), got {json.dumps(x)[:60]}"
    return None


def integer_range(datatype: str) -> tuple[int, int]:
    """[lo, hi] of a Triton integer datatype: INT32 -> [-2**31, 2**31 - 1]."""
    unsigned = datatype.startswith("UINT")
    bits = int(datatype[4:] if unsigned else datatype[3:])
    return (0, (1 << bits) - 1) if unsigned else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def body_problem(body: bytes) -> tuple[Optional[str], Any]:
    """(why tritonserver would misread a generate body, or None; the parsed document, or None
    when it is not JSON: tritonserver's own answer names the JSON error then). tritonserver
    reads the first of duplicated keys where the models' checks read the last."""
    try:
        return None, json.loads(body, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        return f"{e.args[0]}: given more than once in the request body", None
    except RecursionError:
        return "request body: JSON nested too deeply", None
    except ValueError:
        return None, None


def too_large_message(size: Optional[int], limit: int) -> str:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return (f"request body of {got} exceeds the limit of {limit} bytes ({LIMIT_ENV}); "
            "send large inputs over gRPC")


class BodyLimitProxy:
    """Listens on (host, port), forwards to 127.0.0.1:upstream_port. Runs its own event loop
    on a daemon thread: start() returns once the port is bound (or raises OSError); port 0
    binds a free one, read back from .port."""

    def __init__(self, host: str, port: int, upstream_port: int, max_body_bytes: int):
        self.host, self.port, self.upstream_port = host, port, upstream_port
        self.max_body = int(max_body_bytes)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner = None
        self._session = None
        self._inputs: dict[tuple, tuple[float, dict[str, str]]] = {}  # (model, version) -> (t, name->type)
        self._active: set = set()   # tasks of the requests being proxied
        self._fail_message: Optional[str] = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        started = threading.Event()
        error: list[BaseException] = []

        def main():
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start())
            except BaseException as e:  # noqa: BLE001 - reported to start()
                error.append(e)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._stop())
            loop.close()

        self._thread = threading.Thread(target=main, name="http-front", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError("http front did not start")
        if error:
            raise error[0]

    def fail_inflight(self, message: str) -> None:
        """From any thread: end every proxied request now with `message` as its error (an
        error event on an event stream, 503 before the response started), and answer new
        ones so. For requests tritonserver will never answer (their model's stub died): it
        would end their streams cleanly, truncated, when it exits."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, message)

    def _fail_all(self, message: str) -> None:
        self._fail_message = message
        for task in list(self._active):
            task.cancel()

    def stop(self, message: Optional[str] = None, drain_s: float = 3.0) -> None:
        """Close the front. With `message` (tritonserver is gone): first end every proxied
        request with it, as fail_inflight does, and wait up to drain_s for those endings to be
        written. Without that wait, a stream whose upstream read had not yet seen the break
        would be closed bare, which clients read as a clean end of a truncated stream."""
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            return
        if message is not None:
            self._loop.call_soon_threadsafe(self._fail_all, message)
            try:
                asyncio.run_coroutine_threadsafe(self._drain(drain_s), self._loop).result(drain_s + 1)
            except Exception:  # noqa: BLE001 - a loop already stopping: close anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _drain(self, timeout: float) -> None:
        if self._active:
            await asyncio.wait(list(self._active), timeout=timeout)

    async def _start(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
        # No connection cap (streams are long), no read timeout (a stream may idle), raw bytes
        # both ways (Content-Encoding is tritonserver's business). force_close: one upstream
        # connection per request, closed after it: on SIGINT tritonserver 2.51 waits for every
        # open HTTP connection (idle keep-alive ones too) before it even starts stopping.
        # skip_auto_headers: only the client's own headers go upstream; aiohttp's default
        # Accept-Encoding would make tritonserver gzip answers for clients that cannot read them.
        self._session = ClientSession(connector=TCPConnector(limit=0, force_close=True), auto_decompress=False,
                                      timeout=ClientTimeout(total=None, sock_connect=10),
                                      skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"))
        # client_max_size: aiohttp's own cap on request.read(), kept in step with ours
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client disconnect cancels the handler, hence the upstream call
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]   # the one the kernel chose when asked for port 0

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- one request --------------------------------------------------------------------
    async def _handle(self, request):
        from aiohttp import web
        if self._fail_message is not None:
            return self._unavailable()
        task = asyncio.current_task()
        self._active.add(task)
        state: dict = {}
        try:
            return await self._proxy(request, state)
        except asyncio.CancelledError:
            if self._fail_message is None:
                raise  # the client went away (handler cancellation)
            resp = state.get("resp")
            if resp is None or not resp.prepared:
                return self._unavailable()
            if state.get("ended"):
                return resp  # it already has its error event
            if resp.content_type != "text/event-stream":
                raise ConnectionResetError(self._fail_message) from None
            await self._end_stream(resp, state, self._fail_message, ConnectionResetError(self._fail_message))
            return resp
        finally:
            self._active.discard(task)

    @staticmethod
    async def _end_stream(resp, state: dict, message: str, cause: BaseException) -> None:
        """An error event, then the end of the stream (once); a client already gone gets `cause`."""
        state["ended"] = True
        try:
            await resp.write(f"data: {json.dumps({'error': message})}\n\n".encode())
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            raise cause from None

    def _unavailable(self):
        from aiohttp import web
        return web.Response(status=503, content_type="application/json",
                            text=json.dumps({"error": self._fail_message}))

    async def _proxy(self, request, state: dict):
        from aiohttp import ClientError, web
        size = request.content_length
        if size is not None and size > self.max_body:
            return await self._reject(request, size)
        body = b""
        if request.body_exists:
            try:
                body = await request.read()  # raises past client_max_size (chunked bodies)
            except web.HTTPRequestEntityTooLarge:
                return await self._reject(request, None)
            if len(body) > self.max_body:
                return await self._reject(request, len(body))
        bad = await self._check_generate(request, body)
        if bad is not None:
            return bad
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        url = f"http://127.0.0.1:{self.upstream_port}{request.rel_url}"
        try:
            async with self._session.request(request.method, url, headers=headers, data=body or None,
                                             allow_redirects=False) as up:
                resp = state["resp"] = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        resp.headers.add(k, v)
                if up.headers.get("Content-Length") is not None:
                    resp.content_length = int(up.headers["Content-Length"])
                await resp.prepare(request)
                while True:
                    try:
                        chunk = await up.content.readany()
                    except ClientError as e:
                        broken = e  # tritonserver broke the response off (it crashed or was killed)
                        break
                    if not chunk:
                        broken = None
                        break
                    await resp.write(chunk)
                if broken is None:
                    await resp.write_eof()
                elif resp.content_type == "text/event-stream":
                    # an error event, as for any other error mid-stream, not a clean end
                    await self._end_stream(resp, state, f"tritonserver ended the stream before its final "
                                                        f"response (the server may have crashed): {broken!r}", broken)
                else:
                    raise broken  # drop the connection: the client sees its body cut short
                return resp
        except (ClientError, ConnectionError, asyncio.TimeoutError) as e:
            if "resp" in state and state["resp"].prepared:
                raise  # the response has started: drop the connection, the client sees it
            return web.Response(status=502, content_type="application/json",
                                text=json.dumps({"error": f"tritonserver HTTP endpoint unavailable: {e!r}"}))

    async def _check_generate(self, request, body: bytes):
        from aiohttp import web
        m = GENERATE_PATH.match(request.path)
        if request.method != "POST" or m is None or request.headers.get("Content-Encoding"):
            return None
        problem, doc = body_problem(body)
        if problem is None and isinstance(doc, dict):
            inputs = await self._input_types(m.group(1), m.group(2) or "")
            problem = next((f"{key}: {p}" for key, value in doc.items()
                            if key in inputs and (p := json_type_problem(inputs[key], value))), None)
        if problem is None:
            return None
        return web.Response(status=400, content_type="application/json", text=json.dumps({"error": problem}))

    async def _input_types(self, model: str, version: str) -> dict[str, str]:
        """{input name: datatype} from the model's metadata (cached); {} when unavailable."""
        key = (model, version)
        hit = self._inputs.get(key)
        if hit is not None and time.monotonic() - hit[0] < METADATA_TTL_S:
            return hit[1]
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        types: dict[str, str] = {}
        try:
            async with self._session.get(f"http://127.0.0.1:{self.upstream_port}{path}") as r:
                if r.status == 200:
                    meta = json.loads(await r.read())
                    types = {i["name"]: i["datatype"] for i in meta.get("inputs", [])}
        except Exception:  # noqa: BLE001 - no check then; tritonserver answers the request
            return {}
        if types:
            self._inputs[key] = (time.monotonic(), types)
        return types

    async def _reject(self, request, size: Optional[int]):
        from aiohttp import web
        # Read (and drop) what the client is still sending, for a while, so that it reads our
        # answer instead of a reset; Connection: close ends the exchange either way.
        deadline = asyncio.get_running_loop().time() + DRAIN_S
        try:
            while not request.content.at_eof() and asyncio.get_running_loop().time() < deadline:
                await asyncio.wait_for(request.content.readany(), DRAIN_S)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        return web.Response(status=413, content_type="application/json", headers={"Connection": "close"},
                            text=json.dumps({"error": too_large_message(size, self.max_body)}))
