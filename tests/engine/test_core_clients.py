"""The engine core's client registry and writer (backend_lib/core_clients.py), without an engine:
the last client to leave is not released before the engine stopped, a client whose socket goes
while the writer is inside a large write to it does not take the writer down, a client that
stops reading is dropped rather than stalling the others."""
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection

from backend_lib import engine_wire as wire
from backend_lib.core_clients import Clients, Writer


def _pair(clients):
    core_end, client_end = socket.socketpair()
    cid = clients.attach(Connection(core_end.detach()))
    return cid, Connection(client_end.detach())


def test_the_last_client_to_leave_waits_for_the_engine_stop():
    """STOP from the last client: the core stops the engine first (its finals, then STOPPED at
    the end); the writer must not release it early (its shutdown would return, and a spawner
    would kill the core, before the engine closed)."""
    clients = Clients(queue.SimpleQueue(), shared=True)
    a, a_end = _pair(clients)  # the client ends stay open: a closed one is a client gone
    b, b_end = _pair(clients)
    rids, ending = clients.detach(a, gone=False)
    assert (rids, ending) == ([], None) and clients.detaching == {a}  # b still serves
    rids, ending = clients.detach(b, gone=False)
    assert ending == "stop" and b not in clients.detaching and clients.closing
    assert clients.attach(Connection(socket.socketpair()[0].detach())) is None  # nobody attaches now
    a_end.close()
    b_end.close()


def test_a_client_gone_mid_write_leaves_the_writer_serving_the_others():
    lost = threading.Event()
    clients = Clients(queue.SimpleQueue(), shared=True)
    out = Writer(clients, on_last_client_lost=lost.set)
    a, a_end = _pair(clients)
    b, b_end = _pair(clients)
    out.control((wire.STATS, 0, b"x" * (8 << 20)), a)  # the writer blocks inside this write
    time.sleep(0.3)
    a_end.close()  # a's stub dies: its reader sees EOF, the loop detaches it
    assert clients.cmds.get(timeout=10) == (a, None)
    assert clients.detach(a, gone=True) == ([], None)
    out.control((wire.STATS, 1, "for b"), b)
    assert b_end.poll(5) and b_end.recv() == (wire.STATS, 1, "for b")
    assert out.thread.is_alive() and not lost.is_set()
    out.close()


def test_a_client_that_stops_reading_is_dropped(monkeypatch):
    import backend_lib.core_clients as cc
    monkeypatch.setattr(cc, "CLIENT_SEND_TIMEOUT_S", 1)
    clients = Clients(queue.SimpleQueue(), shared=True)
    out = Writer(clients, on_last_client_lost=lambda: None)
    a, a_end = _pair(clients)  # never reads
    b, b_end = _pair(clients)
    for i in range(40):
        out.control((wire.STATS, i, b"y" * (1 << 20)), a)
    out.control((wire.STATS, 99, "for b"), b)
    assert b_end.poll(15) and b_end.recv() == (wire.STATS, 99, "for b")
    assert a not in clients.conns
    out.close()
    a_end.close()
