"""The parent's reader of the engine core's messages: multiprocessing.connection's framing (a
4-byte big-endian length, or -1 and an 8-byte length, then a pickle), read in large chunks.

Connection.recv() makes two reads per message and poll() one more system call; in the Triton
stub every system call releases the GIL, and taking it back waits behind the stub's other busy
threads (execute(), the stub's own C++ threads) for up to the switch interval. Here one read
takes every byte the core has written (often several steps' messages), and whether a message
is ready is first answered from the buffer.
"""
from __future__ import annotations

import os
import select
import struct
from multiprocessing.reduction import ForkingPickler
from typing import Optional

READ_CHUNK = 1 << 20
_LEN = struct.Struct("!i")
_LONG_LEN = struct.Struct("!Q")


class FrameReader:
    def __init__(self, fd: int):
        self._fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._buf = bytearray()
        self._chunk = bytearray(READ_CHUNK)
        self._pos = 0           # start of the first unread frame in _buf
        self.eof = False        # the socket ended (or failed); frames already buffered still count

    def _next_frame(self) -> Optional[tuple[int, int]]:
        """(body start, body end) of the first unread frame, when all of it is buffered."""
        avail = len(self._buf) - self._pos
        if avail < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self._buf, self._pos)
        start = self._pos + _LEN.size
        if n == -1:
            if avail < _LEN.size + _LONG_LEN.size:
                return None
            (n,) = _LONG_LEN.unpack_from(self._buf, start)
            start += _LONG_LEN.size
        end = start + n
        return (start, end) if end <= len(self._buf) else None

    def ready(self, timeout_s: float) -> bool:
        """A message (or the end) can be read now; waits up to timeout_s for the socket."""
        if self.eof or self._next_frame() is not None:
            return True
        return bool(self._poller.poll(int(timeout_s * 1000)))

    def read(self, max_messages: int) -> list:
        """The buffered messages, at most max_messages; when none is buffered, one read of
        what the socket holds (blocking until a whole message is in, as the core writes whole
        messages). An empty list with eof set: the socket ended."""
        msgs: list = []
        while len(msgs) < max_messages:
            span = self._next_frame()
            if span is None:
                if msgs or self.eof or not self._fill():
                    break
                continue
            start, end = span
            with memoryview(self._buf) as view, view[start:end] as body:
                msgs.append(ForkingPickler.loads(body))
            self._pos = end
        if self._pos:
            del self._buf[:self._pos]
            self._pos = 0
        return msgs

    def ended(self) -> bool:
        """The socket ended and every whole message before its end has been read."""
        return self.eof and self._next_frame() is None

    def _fill(self) -> bool:
        try:
            n = os.readv(self._fd, [self._chunk])  # into a buffer kept: no 1 MiB allocation a read
        except OSError:
            n = 0
        if not n:
            self.eof = True
            return False
        with memoryview(self._chunk) as view, view[:n] as data:
            self._buf += data
        return True
