"""FrameReader reads what multiprocessing.connection.Connection.send writes: messages split
across reads, several in one read, a large message, the 8-byte length header, a cap on the
messages per read, the end of the socket after buffered messages, and a message cut off by it."""
import os
import pickle
import socket
import struct
import threading
from multiprocessing.connection import Connection

import pytest

from backend_lib.wire_reader import READ_CHUNK, FrameReader


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    writer = Connection(a.detach())
    yield writer, b
    writer.close()
    b.close()


def test_messages_in_order_across_reads(pair):
    writer, sock = pair
    reader = FrameReader(sock.fileno())
    assert not reader.ready(0)
    big = list(range(3 * READ_CHUNK // 8))  # a pickle larger than one read
    sent = [("steps", [[(f"r{i}", [i], False)]]) for i in range(50)] + [("big", big), ("stats", 7)]

    def write():
        for m in sent:
            writer.send(m)
    t = threading.Thread(target=write)
    t.start()
    got = []
    while len(got) < len(sent):
        assert reader.ready(5)
        batch = reader.read(8)
        assert 1 <= len(batch) <= 8
        got += batch
    t.join()
    assert got == sent
    assert not reader.ready(0) and not reader.ended()


def test_long_length_header_and_end(pair):
    writer, sock = pair
    body = pickle.dumps({"x": 1})
    # the framing Connection uses above 2 GiB: -1, then an 8-byte length
    os.write(writer.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body)
    writer.send(("after", 2))
    writer.close()
    reader = FrameReader(sock.fileno())
    assert reader.ready(5)
    assert reader.read(1) == [{"x": 1}]
    assert not reader.ended()  # the socket's end is not seen until the buffered message is read
    assert reader.read(10) == [("after", 2)]
    assert reader.ready(5) and reader.read(10) == [] and reader.ended()


def test_message_cut_off_by_the_end(pair):
    writer, sock = pair
    body = pickle.dumps("whole")
    os.write(writer.fileno(), struct.pack("!i", len(body)) + body + struct.pack("!i", 100) + b"partial")
    writer.close()
    reader = FrameReader(sock.fileno())
    assert reader.read(10) == ["whole"]
    assert reader.read(10) == [] and reader.ended()
