"""The engine core's clients: who is attached, which client each request belongs to, and the one
thread that writes to them.

One client is the EngineProcessClient that spawned the core (a socketpair). A shared core
(several Triton model instances over one engine: `EngineProcessClient(share_key=...)`) also
listens on an abstract Unix socket and takes more clients there; each then has its own reader
thread. Requests carry ids unique across clients (the llm model prefixes its instance name).

A client's STOP detaches it: its requests are aborted, their final outputs delivered, then it
gets STOPPED and its socket closes. The last client's STOP stops the engine (engine_core); a
client whose socket closes is detached without deliveries; the last one gone ends the core.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import Callable, Optional

from . import engine_wire as wire
from .os_threads import NamedThread
from .request import OUTPUT_FIELDS

_ROW_REQUEST_ID, _ROW_FINISHED = OUTPUT_FIELDS.index("request_id"), OUTPUT_FIELDS.index("finished")

logger = logging.getLogger("backend_lib")

# What a reader puts in the loop's command queue when its client's socket closes.
GONE = None
# A write to one client blocked this long drops that client (it stopped reading) rather than
# stalling every other client's tokens.
CLIENT_SEND_TIMEOUT_S = 30
# EngineStats' counters: each client's stats replies carry its share of them (below).
COUNTER_FIELDS = ("prompt_tokens_total", "generation_tokens_total", "async_steps_total", "sync_steps_total",
                  "prefill_steps_total", "num_preemptions", "prefill_tokens_total", "prefix_cache_queried_tokens_total",
                  "prefix_cache_hit_tokens_total", "step_time_s", "wait_time_s", "schedule_time_s",
                  "submit_time_s", "update_time_s", "host_cpu_time_s")


class Clients:
    """The attached clients (cid -> Connection) and the owner of each request in the engine.
    The loop registers a request's owner before the engine sees the request; the writer drops
    it with the request's final output."""

    def __init__(self, cmds: "queue.SimpleQueue[tuple]", shared: bool):
        self.cmds = cmds                        # (cid, command list | GONE) for the engine loop
        self.shared = shared                    # clients may attach on a listening socket
        self.conns: dict[int, Connection] = {}
        self.owner: dict[str, int] = {}         # request id -> cid
        self.key_of: dict[str, str] = {}        # request id -> the key it was added under (ABORT_KEY)
        self.detaching: set[int] = set()        # STOP received: STOPPED once its requests ended
        self.lock = threading.Lock()
        self.closing = False                    # the engine stops: nobody attaches any more
        self._next_cid = 0
        self._handed = dict.fromkeys(COUNTER_FIELDS, 0)   # counters given to any client so far
        self._shares: dict[int, dict] = {}                # cid -> its counters (share())
        self._listener: Optional[socket.socket] = None

    def attach(self, conn: Connection, ready_info: Optional[dict] = None) -> Optional[int]:
        """Register a connection (greeted with READY first when ready_info is given) and start its
        reader; None (connection closed) once closing: the client then sees EOF before READY
        and tries again. Registration and the READY write happen under the lock, so a client
        that got READY is one the loop counts before it decides that the last one left."""
        if self.shared:  # a client that stops reading must not stall the others (Writer._send)
            with _socket_of(conn) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", CLIENT_SEND_TIMEOUT_S, 0))
        with self.lock:
            if self.closing:
                conn.close()
                return None
            if ready_info is not None:
                try:
                    conn.send((wire.READY, ready_info))
                except OSError:
                    conn.close()
                    return None
            cid = self._next_cid
            self._next_cid += 1
            self.conns[cid] = conn
        NamedThread(target=self._read, args=(cid, conn), name=f"core-reader-{cid}", os_name="core-reader",
                    daemon=True).start()
        return cid

    def detach(self, cid: int, gone: bool) -> tuple[list[str], Optional[str]]:
        """The client leaves (STOP) or is gone (its reader saw EOF): its requests (to abort), and
        what the core does next: None (serve the others), "stop" (it was the last client and
        asked: stop the engine, tell it STOPPED at the end) or "exit" (the last one is gone).
        A leaving client that is not the last waits in `detaching` for its requests' finals."""
        with self.lock:
            others = [c for c in self.conns if c != cid and c not in self.detaching]
            if not gone and cid in self.conns and others:
                self.detaching.add(cid)
            rids = [rid for rid, c in list(self.owner.items()) if c == cid]
            ending = None
            if not others:
                self.closing = True
                ending = "stop" if self.conns else "exit"
        return rids, ending

    def drop(self, cid: int) -> None:
        """Forget a client whose socket failed (the writer's); its reader then sees EOF."""
        with self.lock:
            conn = self.conns.pop(cid, None)
            self.detaching.discard(cid)
            if not self.conns:
                self.closing = True
        if conn is not None:
            _hang_up(conn)

    def share(self, cid: int, stats):
        """`stats` with each counter replaced by this client's share: what grew since any client
        last asked goes to this one. The instances of a model export the counters they are
        given into the same metrics, so the shares must add up to the engine's totals (each
        exporting the totals would count everything once per instance). One client: the totals."""
        mine = self._shares.setdefault(cid, dict.fromkeys(COUNTER_FIELDS, 0))
        for f in COUNTER_FIELDS:
            total = getattr(stats, f)
            mine[f] += total - self._handed[f]
            self._handed[f] = total
        return dataclasses.replace(stats, **mine)

    def last_stats(self, stats) -> list[tuple[int, object]]:
        """(client, its share of `stats`) for every client: sent unasked when the engine dies,
        so the counters of the steps since a client last asked are not lost with the core."""
        with self.lock:
            cids = list(self.conns)
        return [(cid, self.share(cid, stats)) for cid in cids]

    def close_listener(self) -> None:
        """Stop taking clients (the engine stops)."""
        with self.lock:
            self.closing = True
            lst, self._listener = self._listener, None
        if lst is not None:
            try:
                lst.shutdown(socket.SHUT_RDWR)  # wakes the acceptor's accept()
            except OSError:
                pass
            lst.close()

    def listen(self, listener: socket.socket, ready_info: dict) -> None:
        """Accept more clients on `listener` (already listening), each greeted with READY."""
        self._listener = listener
        NamedThread(target=self._accept, args=(listener, ready_info), name="core-acceptor", daemon=True).start()

    def _accept(self, listener: socket.socket, ready_info: dict) -> None:
        while True:
            try:
                s, _ = listener.accept()
            except OSError:  # closed: the engine stops
                return
            pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("3i")))
            if uid != os.getuid():  # an abstract socket has no file permissions: check who it is
                logger.warning("engine core: refused a connection from pid %d (uid %d)", pid, uid)
                s.close()
                continue
            self.attach(Connection(s.detach()), ready_info)

    def _read(self, cid: int, conn: Connection) -> None:
        """The only thread that closes `conn` (the others hang it up): a close under a thread
        blocked in recv() or send() on it could hand its descriptor to the next client."""
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                break
            self.cmds.put((cid, batch))
        with self.lock:
            if self.conns.get(cid) is conn:
                del self.conns[cid]
            self.detaching.discard(cid)
        conn.close()
        self.cmds.put((cid, GONE))


class Writer:
    """The one thread that encodes outputs and writes to the clients; the engine loop only
    enqueues. Everything queued since its last write goes out as one message per client."""

    def __init__(self, clients: Clients, on_last_client_lost: Callable[[], None]):
        self.clients = clients
        self._lost = on_last_client_lost
        self.q: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self.thread = NamedThread(target=self._main, name="core-writer", daemon=True)
        self.thread.start()

    def steps(self, outs) -> None:
        if outs:
            self.q.put(outs)  # routed and sent on the writer thread, while the loop waits on the device

    def control(self, msg: tuple, cid: Optional[int] = None) -> None:
        """msg to client cid; None: to every client."""
        self.q.put((cid, msg))

    def wake(self) -> None:
        """Look at the detaching clients again (one may have no request left)."""
        self.q.put(())

    def close(self, timeout: float = 10.0) -> None:
        self.q.put(None)
        self.thread.join(timeout)

    def _main(self) -> None:
        while True:
            items = [self.q.get()]
            while True:  # everything queued meanwhile goes in the same write
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            pending: dict[int, list] = {}  # cid -> steps not written yet
            for item in items:
                if isinstance(item, list):
                    self._route(item, pending)
                    continue
                self._flush(pending)
                if item is None:
                    return
                if item:
                    cid, msg = item
                    for c in ([cid] if cid is not None else list(self.clients.conns)):
                        self._send(c, msg)
            self._flush(pending)
            if self.clients.detaching:
                self._release_detached()

    def _route(self, rows: list, pending: dict) -> None:
        """A step's rows (request.OUTPUT_FIELDS), split by the client that added each request."""
        owner = self.clients.owner
        by_client: dict[int, list] = {}
        for row in rows:
            rid = row[_ROW_REQUEST_ID]
            if row[_ROW_FINISHED]:
                self.clients.key_of.pop(rid, None)
            cid = owner.pop(rid, None) if row[_ROW_FINISHED] else owner.get(rid)
            if cid is None:  # its client is gone (a shared core keeps no output for nobody)
                continue
            mine = by_client.get(cid)
            if mine is None:
                mine = by_client[cid] = []
            mine.append(row)
        for cid, mine in by_client.items():
            pending.setdefault(cid, []).append(mine)

    def _flush(self, pending: dict) -> None:
        for cid, steps in pending.items():
            self._send(cid, (wire.STEPS, steps))
        pending.clear()

    def _send(self, cid: int, msg: tuple) -> None:
        conn = self.clients.conns.get(cid)
        if conn is None:
            return
        try:
            conn.send(msg)
        except Exception:  # noqa: BLE001 - gone, stuck (SO_SNDTIMEO), or hung up meanwhile
            self.clients.drop(cid)
            if self.clients.closing and not self.clients.conns:
                self._lost()

    def _release_detached(self) -> None:
        """A detaching client whose requests have all ended gets STOPPED, and is hung up."""
        with self.clients.lock:
            busy = set(self.clients.owner.values())
            done = [cid for cid in self.clients.detaching if cid not in busy]
        for cid in done:
            self._send(cid, (wire.STOPPED,))
            with self.clients.lock:
                self.clients.detaching.discard(cid)
                conn = self.clients.conns.pop(cid, None)
            if conn is not None:
                _hang_up(conn)


def _socket_of(conn: Connection) -> socket.socket:
    """A socket object over a duplicate of conn's descriptor (options and shutdown act on the
    socket both share); the caller closes it."""
    return socket.socket(fileno=os.dup(conn.fileno()))


def _hang_up(conn: Connection) -> None:
    """End a client's connection without closing it: its end and this side's reader thread see
    EOF, and the reader closes it."""
    try:
        with _socket_of(conn) as s:
            s.shutdown(socket.SHUT_RDWR)
    except (OSError, TypeError):  # closed already
        pass

