"""BoundedResponses: a BLS route's wait on its upstream ends with an error when the upstream
stub process dies, instead of blocking forever (tritonserver 2.51 never answers it).
HeldIterators: an ended upstream iterator is let go only after a barrier that started after it
was held (tests/server/test_bls_iterator_lifetime.py shows why, on a real server)."""
import subprocess
import threading
import time
import weakref

import pytest

from triton_glue.upstream import BoundedResponses, HeldIterators, UpstreamGone, UpstreamWatch


def test_passes_responses_through_and_ends():
    watch = UpstreamWatch("llm")
    assert list(BoundedResponses(iter([1, 2, 3]), watch, poll_s=0.05)) == [1, 2, 3]


def test_reraises_the_iterators_error():
    def boom():
        yield 1
        raise ValueError("upstream broke")
    it = BoundedResponses(boom(), UpstreamWatch("llm"), poll_s=0.05)
    assert next(it) == 1
    with pytest.raises(ValueError, match="upstream broke"):
        next(it)


def test_a_dead_upstream_stub_ends_the_wait_with_an_error():
    stub = subprocess.Popen(["sleep", "60"])          # stands in for the llm stub
    deaths, never = [], threading.Event()
    watch = UpstreamWatch("llm", on_death=deaths.append)
    watch.pid = stub.pid

    def stuck():                                       # an upstream that never answers again
        yield "first"
        never.wait()
    it = BoundedResponses(stuck(), watch, poll_s=0.05)
    assert next(it) == "first"
    stub.kill()
    stub.wait()
    t0 = time.monotonic()
    with pytest.raises(UpstreamGone, match=rf"model 'llm' is gone: its Python stub \(pid {stub.pid}\) died"):
        next(it)
    assert time.monotonic() - t0 < 2
    assert len(deaths) == 1 and "llm" in deaths[0]
    assert not watch.alive() and len(deaths) == 1     # reported once
    never.set()


def test_cancel_is_the_wrapped_iterators():
    class It:
        cancelled = False

        def __iter__(self):
            return iter([])

        def cancel(self):
            self.cancelled = True
    raw = It()
    it = BoundedResponses(raw, UpstreamWatch("llm"), poll_s=0.05)
    it.cancel()
    assert raw.cancelled
    assert not hasattr(BoundedResponses(iter([]), UpstreamWatch("llm")), "cancel")


def test_a_request_after_the_death_fails_at_once_and_is_never_sent():
    """After the upstream's death is known, a new request fails when its wait is set up (no
    poll interval each: a backlog of queued BLS requests drains at once) and its upstream
    request is never sent."""
    stub = subprocess.Popen(["sleep", "60"])
    watch = UpstreamWatch("llm")
    watch.pid = stub.pid
    stub.kill()
    stub.wait()
    assert not watch.alive()
    sent = []

    def responses():
        sent.append(True)  # the upstream request goes out on the first step
        yield "never"
    t0 = time.monotonic()
    for _ in range(20):
        with pytest.raises(UpstreamGone, match="model 'llm' is gone"):
            BoundedResponses(responses(), watch, poll_s=1.0)
    assert time.monotonic() - t0 < 1.0
    time.sleep(0.1)
    assert not sent


class _Iterator:
    """Stands in for a BLS response iterator (weakref-able, to see when it is let go)."""


class _Request:
    """A request whose is_cancelled() (the barrier's round trip) runs `during` first."""

    def __init__(self, during=None, fails=False):
        self.during, self.fails, self.asked = during, fails, 0

    def is_cancelled(self):
        self.asked += 1
        if self.during is not None:
            self.during()
        if self.fails:
            raise RuntimeError("stub shutting down")
        return False


def _held(held, n=1):
    refs = []
    for _ in range(n):
        it = _Iterator()
        refs.append(weakref.ref(it))
        held.hold(it)
    return refs


def test_held_iterators_go_at_the_next_barrier_and_not_before():
    held = HeldIterators()
    refs = _held(held, 3)
    assert all(r() is not None for r in refs) and held.held() == 3
    request = _Request()
    held.barrier([request])
    assert request.asked == 1
    assert all(r() is None for r in refs) and held.held() == 0


def test_an_iterator_held_during_a_barrier_waits_for_the_next_one():
    """Its cleanup may be queued after the barrier's round trip: only a later barrier proves it ran."""
    held = HeldIterators()
    before = _held(held)
    during = []
    held.barrier([_Request(during=lambda: during.extend(_held(held)))])
    assert before[0]() is None
    assert during[0]() is not None and held.held() == 1
    held.barrier([_Request()])
    assert during[0]() is None and held.held() == 0


def test_a_failed_barrier_lets_nothing_go():
    held = HeldIterators()
    refs = _held(held, 2)
    held.barrier([_Request(fails=True)])
    assert all(r() is not None for r in refs) and held.held() == 2
    held.close()
    assert all(r() is None for r in refs) and held.held() == 0
