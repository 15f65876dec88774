"""Free TCP ports for listeners that must be told their port before they bind (tritonserver,
torch.distributed's store, uvicorn).

A port the kernel hands out for bind(0) lies in the ephemeral range, the same range it draws
outgoing connections' source ports from: between our picking it and the listener binding it,
any client connection on the machine may take it ("address already in use"). Ports below that
range are never handed out implicitly, so we pick there and check that nothing listens."""
from __future__ import annotations

import random
import socket

_LOWEST = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on, outside the ephemeral range where possible."""
    host = "127.0.0.1" if host in ("", "localhost") else host
    top = _ephemeral_start()
    candidates = random.sample(range(_LOWEST, top), min(64, top - _LOWEST)) if top > _LOWEST else []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # the range below is full or absent: take the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports
