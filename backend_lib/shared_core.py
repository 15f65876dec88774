"""Where the clients of a shared engine core find it: an abstract Unix socket (Linux: no file;
the name goes with its last holder) named after the share key. The first client to bind the
name spawns the core and hands it the listening socket; the others connect and wait for READY
(EngineProcessClient(share_key=...); the core's side is backend_lib/core_clients.py)."""
from __future__ import annotations

import hashlib
import os
import socket
import struct
import time
from multiprocessing.connection import Connection
from typing import Optional

from . import engine_wire as wire


def socket_name(share_key: str) -> bytes:
    return b"\0backend_lib-engine-" + hashlib.sha256(share_key.encode()).hexdigest()[:32].encode()


def bind(name: bytes) -> Optional[socket.socket]:
    """The listening socket of `name`, or None when a core (or a client starting one) holds it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
        listener.listen(64)
    except OSError:
        listener.close()
        return None
    return listener


def connect(name: bytes, deadline: float, send_timeout_s: float) -> Optional[tuple[Connection, dict]]:
    """(connection, READY's info) from the core listening on `name`; None when it went away
    first (it failed to start, or it stops): the caller tries again. TimeoutError past the
    deadline (monotonic clock)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(name)
    except OSError:  # the name was just released
        s.close()
        return None
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(send_timeout_s), 0))
    conn = Connection(s.detach())
    try:
        while not conn.poll(0.2):  # the core's READY comes once its engine is built
            if time.monotonic() > deadline:
                conn.close()
                raise TimeoutError("the shared engine did not start in time")
        msg = conn.recv()
    except (EOFError, OSError):
        conn.close()
        return None
    if msg[0] != wire.READY:
        conn.close()
        return None
    # An abstract socket has no file permissions: the name's holder must run as this user (a
    # stranger could have taken the name first). (Its pid is the process that listened: the
    # client that spawned the core, not the core.)
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        conn.close()
        raise RuntimeError(f"the shared engine socket is held by pid {pid} of uid {uid}, not by this user's "
                           f"engine core")
    return conn, msg[1]
