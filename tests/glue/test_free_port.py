"""Ports picked for listeners that bind later lie outside the kernel's ephemeral range, so no
client connection's source port can take them in between (CI lost a run to that)."""
from __future__ import annotations

import socket

from backend_lib import free_port as fp


def test_picked_ports_are_below_the_ephemeral_range_and_free():
    start = fp._ephemeral_start()
    ports = fp.free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        assert fp._LOWEST <= port < start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_never_picked(monkeypatch):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    taken = listener.getsockname()[1]
    # the only candidate offered is the taken port: the helper falls back to the kernel's pick
    monkeypatch.setattr(fp.random, "sample", lambda population, k: [taken])
    try:
        assert fp.free_port() != taken
    finally:
        listener.close()
